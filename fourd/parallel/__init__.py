"""The four parallel dimensions, each applied from outside to the unmodified model (docs/parallelism.md,
docs/pipeline-context.md).

layout (pure Python): the degrees, the rank numbering and the refusals; mesh: the DeviceMesh; tp, cp, pp,
dp: tensor, context, pipeline and data parallelism; grad: the global gradient norm over sharded gradients.
"""
