"""The four parallel dimensions, each applied from outside to the unmodified model.

layout (pure Python): the degrees and the rank numbering; mesh: the DeviceMesh; tp, dp: tensor and
data parallelism; grad: the global gradient norm over sharded gradients.
"""
