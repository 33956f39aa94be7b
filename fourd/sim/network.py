"""Transfers as fluid flows over shared links: flows on a link share it equally, each capped by its own
bandwidth; a link may carry only a fraction of a flow's bytes (a ring with k members per server sends 1/k
through each NIC). Rates change only when a flow starts or ends; a flow is delivered `latency` after its
last byte leaves."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(eq=False)
class Flow:
    size: float  # bytes still to move
    links: tuple  # ((port, ...) link id, fraction of the flow's bytes it carries)
    cap: float  # bytes/s it can reach alone
    latency: float
    done: Callable[[float], None]  # called with the delivery time
    start: float = 0.0
    rate: float = field(default=0.0)


class Network:
    def __init__(self, capacity: dict):
        self.capacity = capacity  # port -> bytes/s of each link (port, ...) of that port
        self.flows: list[Flow] = []
        self.dirty = False

    def add(self, flow: Flow, now: float) -> None:
        flow.start = now
        self.flows.append(flow)
        self.dirty = True

    def _rates(self) -> None:
        users: dict = {}
        for f in self.flows:
            for link, _ in f.links:
                users[link] = users.get(link, 0) + 1
        for f in self.flows:
            f.rate = min([f.cap] + [self.capacity[link[0]] / users[link] / share for link, share in f.links])
        self.dirty = False

    def next_finish(self, now: float) -> float:
        if self.dirty:
            self._rates()
        return min((now + f.size / f.rate for f in self.flows), default=float("inf"))

    def advance(self, now: float, dt: float) -> list[Flow]:
        """Move every flow dt seconds forward; return the flows that finished (their bytes all sent)."""
        if self.dirty:
            self._rates()
        finished: list = []
        running: list = []
        for f in self.flows:
            f.size -= f.rate * dt
            (finished if f.size <= 1e-3 else running).append(f)  # bytes: float noise, not data
        if finished:
            self.flows = running
            self.dirty = True
        return finished
