"""Collectives; and the bus factors with which every part of fourd prices them (torch-free)."""

BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send": lambda n: 1.0,
}


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw: the share of the buffer each rank's link carries in a ring `op`
    over n ranks (all-reduce 2(n−1)/n, the lower bound, Patarasuk & Yuan 2009)."""
    return BUS_FACTOR[op](n) if n > 1 else 0.0
