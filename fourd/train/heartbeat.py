"""Which rank is behind: each rank records the step it has begun in the job's store (one small write
per step), so that the rank that sees a collective time out or lose a peer names the ranks that
never began that step."""

from __future__ import annotations

import torch.distributed as dist


class Heartbeat:
    def __init__(self, rank: int, world: int, store: dist.Store):
        """store: the job's store, under a prefix of this attempt's own (the store outlives
        restarts)."""
        self.rank, self.world, self.step = rank, world, 0
        self.store = store if world > 1 else None

    def beat(self, step: int) -> None:
        self.step = step
        if self.store is not None:
            self.store.set(f"fourd/began/{self.rank}", str(step))

    def report(self, error: BaseException) -> str:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        where = f"step {self.step} failed ({type(error).__name__}: {first})"
        if self.store is None:
            return where
        try:  # each rank's last begun step, 0 for none yet
            keys = {r: f"fourd/began/{r}" for r in range(self.world)}
            began = {
                r: int(self.store.get(k)) if self.store.check([k]) else 0 for r, k in keys.items()
            }
        except Exception as e:  # noqa: BLE001 - the store itself is gone: say what we know
            return f"{where}; the rendezvous store is unreachable ({e})"
        behind = sorted(r for r, s in began.items() if s < self.step)
        if not behind:
            return f"{where}; every rank began step {self.step}: one is stuck or died inside it"
        names = ", ".join(f"rank {r} (last began step {began[r]})" for r in behind)
        return f"{where}; did not begin step {self.step}: {names} — hung or dead"
