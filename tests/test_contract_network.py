"""The step simulator's network (fourd.sim.network) on flows of a few bytes, where its float-noise threshold
(a flow is done below 1e-3 bytes left) must not end a transfer early: 2 bytes over a 1 B/s link finish at
2 s, not when one byte is left; two flows sharing the link each get half of it."""

from __future__ import annotations

import pytest

from fourd.sim.network import Flow, Network


def _flow(size: float, delivered: list) -> Flow:
    return Flow(size=size, links=((("nic",), 1.0),), cap=10.0, latency=0.0, done=delivered.append)


def test_small_flows_finish_when_their_last_byte_is_sent():
    net, delivered = Network({"nic": 1.0}), []
    first, second = _flow(2.0, delivered), _flow(3.0, delivered)
    net.add(first, 0.0)
    net.add(second, 0.0)
    assert net.next_finish(0.0) == pytest.approx(4.0)  # each at 0.5 B/s: the 2-byte one at 4 s
    assert net.advance(0.0, 3.0) == []  # half a byte of the first still to send
    assert first.size == pytest.approx(0.5) and second.size == pytest.approx(1.5)
    assert net.advance(3.0, 1.0) == [first]
    assert net.next_finish(4.0) == pytest.approx(5.0)  # the second alone on the link: 1 B/s
    assert net.advance(4.0, 0.5) == []
    assert net.advance(4.5, 0.5) == [second] and net.flows == []
