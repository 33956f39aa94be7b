"""The planner: memory, step time and MFU of a model on a cluster with a 4D layout, and the search for the
best layout. Pure Python (no torch), so `fourd plan` answers at once.

request.py  the one resolver of planner settings (fourd plan, sim step, the lab, the trainer)
job.py      what is planned: the run and one rank's work per microbatch
cluster.py  cluster profiles and where a parallel group lands in the topology
block.py    what a transformer block moves and keeps, counted op by op
kernels.py  one kernel's time: GEMMs, attention, memory-bound work, collectives
memory.py   bytes per GPU;  perf.py  seconds per step;  search.py  plans and the search;  report.py  text
calibrate.py  `fourd calibrate`: measures this machine and writes its profile (torch inside functions only)
"""
