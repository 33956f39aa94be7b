"""fourd.train.heartbeat in one process, on torch's in-memory store: the line a failed step leaves names the
ranks that never began it, each with the last step it began; every rank at the step, or a lone rank, says so."""

from __future__ import annotations

import torch.distributed as dist

from fourd.train.heartbeat import Heartbeat


def test_the_ranks_behind_are_named_with_the_last_step_each_began():
    store = dist.HashStore()
    beats = [Heartbeat(rank, 4, store) for rank in range(4)]
    for rank, step in enumerate((5, 4, 5, 3)):
        for begun in range(1, step + 1):
            beats[rank].beat(begun)
    failure = TimeoutError("Timed out waiting 600000ms for recv")
    assert beats[0].report(failure) == (
        "step 5 failed (TimeoutError: Timed out waiting 600000ms for recv); did not begin step 5: "
        "rank 1 (last began step 4), rank 3 (last began step 3) — hung or dead"
    )
    assert beats[1].report(failure).startswith("step 4 failed (TimeoutError: Timed out waiting")
    assert (
        beats[1]
        .report(failure)
        .endswith("did not begin step 4: rank 3 (last began step 3) — hung or dead")
    )


def test_every_rank_at_the_step_means_one_died_inside_it_and_a_lone_rank_has_no_store():
    store = dist.HashStore()
    beats = [Heartbeat(rank, 2, store) for rank in range(2)]
    for beat in beats:
        beat.beat(7)
    assert beats[1].report(RuntimeError("NCCL error\nmore")) == (
        "step 7 failed (RuntimeError: NCCL error); every rank began step 7: one is stuck or died inside it"
    )
    alone = Heartbeat(0, 1, store)
    alone.beat(2)
    assert alone.report(ValueError()) == "step 2 failed (ValueError: ValueError)"
