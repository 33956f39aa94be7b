"""The planner: memory, step time and MFU of a model on a cluster with a 4D layout, and the search for the
best layout. Pure Python (no torch), so `fourd plan` answers instantly.

cluster.py  cluster profiles and where a parallel group lands in the topology
memory.py   bytes per GPU: weights, gradients, optimizer state, activations
perf.py     seconds: GEMMs, attention, collectives, one stage, one step (shared with fourd.sim)
search.py   every valid configuration, ranked
report.py   the readable report
calibrate.py  `fourd calibrate`: measures this machine and writes its profile (the only module that uses torch)
"""
