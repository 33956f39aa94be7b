"""Transfers as fluid flows sharing links equally, each capped by its own bandwidth; a link may
carry a fraction of a flow's bytes (a ring with k members per server: 1/k through each NIC).
Delivered `latency` after the end."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(eq=False)
class Flow:
    size: float  # bytes still to move
    links: tuple  # ((port, ...) link id, fraction of the flow's bytes it carries)
    cap: float  # bytes/s it can reach alone
    latency: float
    done: Callable[[float], None]  # called with the delivery time
    rate: float = 0.0


class Network:
    def __init__(self, capacity: dict):
        self.capacity = capacity  # port -> bytes/s of each link (port, ...) of that port
        self.flows: list[Flow] = []
        self.dirty = False

    def add(self, flow: Flow, now: float) -> None:
        self.flows.append(flow)
        self.dirty = True

    def _rates(self) -> None:
        users = Counter(link for f in self.flows for link, _ in f.links)
        for f in self.flows:
            f.rate = min(
                [f.cap] + [self.capacity[link[0]] / users[link] / share for link, share in f.links]
            )
        self.dirty = False

    def next_finish(self, now: float) -> float:
        if self.dirty:
            self._rates()
        return min((now + f.size / f.rate for f in self.flows), default=float("inf"))

    def advance(self, now: float, dt: float) -> list[Flow]:
        """Move every flow dt seconds forward; return the flows that finished (their bytes all
        sent)."""
        if self.dirty:
            self._rates()
        for f in self.flows:
            f.size -= f.rate * dt
        finished = [
            f for f in self.flows if f.size <= 1e-3
        ]  # bytes below that: float noise, not data
        if finished:
            self.flows, self.dirty = [f for f in self.flows if f.size > 1e-3], True
        return finished
