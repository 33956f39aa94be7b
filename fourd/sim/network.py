"""Transfers as fluid flows sharing links equally, each capped by its own bandwidth; a link may
carry a fraction of a flow's bytes (a ring with k members per server: 1/k through each NIC).
Delivered `latency` after the end."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(eq=False, kw_only=True)
class Flow:
    size: float  # bytes still to move
    links: tuple  # ((port, ...) link id, fraction of the flow's bytes it carries)
    cap: float  # bytes/s it can reach alone
    latency: float  # seconds from its last byte sent to its delivery
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
        """Each flow's rate: the least of its own cap and, over its links, the link's bandwidth
        shared equally among the link's flows, divided by the share of the flow's bytes the link
        carries (rate = min(cap, bandwidth / users / share))."""
        users = Counter(link for flow in self.flows for link, _ in flow.links)
        for flow in self.flows:
            shared = [self.capacity[link[0]] / users[link] / share for link, share in flow.links]
            flow.rate = min([flow.cap] + shared)
        self.dirty = False

    def next_finish(self, now: float) -> float:
        if self.dirty:
            self._rates()
        return min((now + flow.size / flow.rate for flow in self.flows), default=float("inf"))

    def advance(self, now: float, seconds: float) -> list[Flow]:
        """Move every flow dt seconds forward; return the flows that finished (their bytes all
        sent)."""
        if self.dirty:
            self._rates()
        for flow in self.flows:
            flow.size -= flow.rate * seconds
        # bytes below 1e-3: float noise, not data
        finished = [flow for flow in self.flows if flow.size <= 1e-3]
        if finished:
            self.flows = [flow for flow in self.flows if flow.size > 1e-3]
            self.dirty = True
        return finished
