"""Simulators: one training step on a cluster (`fourd sim step`) and months of failures (`fourd sim
faults`)."""
