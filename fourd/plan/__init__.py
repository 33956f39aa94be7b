"""The planner: memory, step time and MFU of a model on a cluster with a 4D layout, and the search
for the best layout; pure Python (no torch). docs/planner.md maps the modules."""
