"""The four parallel dimensions, each applied from outside to the unmodified model (docs/parallelism.md,
docs/pipeline-context.md).

mesh: the DeviceMesh; tp, cp, pp, dp: tensor, context, pipeline and data parallelism; grad: the global
gradient norm over sharded gradients. The degrees themselves (pure Python) are in fourd.layout.
"""
