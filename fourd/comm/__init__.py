"""Collectives; and the bus factors with which every part of fourd prices them (torch-free)."""

# collective -> the share of its buffer that crosses each rank's link, given the ranks
# (nccl-tests, doc/PERFORMANCE.md: busbw = algbw × this factor)
BUS_FACTOR = {
    "all_reduce": lambda ranks: 2 * (ranks - 1) / ranks,
    "all_gather": lambda ranks: (ranks - 1) / ranks,
    "reduce_scatter": lambda ranks: (ranks - 1) / ranks,
    "all_to_all": lambda ranks: (ranks - 1) / ranks,
    "broadcast": lambda ranks: 1.0,
    "send": lambda ranks: 1.0,
}


def bus_factor(collective: str, ranks: int) -> float:
    """nccl-tests' busbw / algbw: the share of the buffer each rank's link carries in a ring `op`
    over n ranks (all-reduce 2(n−1)/n, the lower bound, Patarasuk & Yuan 2009)."""
    if ranks <= 1:
        return 0.0
    return BUS_FACTOR[collective](ranks)
