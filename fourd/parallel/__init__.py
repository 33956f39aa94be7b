"""The four parallel dimensions (mesh, tp, cp, pp, dp), each applied from outside to the unmodified
model in the order of apply.py (docs/parallelism.md, docs/pipeline-context.md); the degrees
themselves are fourd.layout's."""
