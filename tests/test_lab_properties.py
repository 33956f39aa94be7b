"""Property-based tests of the lab's API (hypothesis): whatever query string a client sends to any
endpoint, the server's answer is a 200 with JSON or a 4xx whose body is one line, {"error": ...};
never a 500 and never an exception out of the server."""

from __future__ import annotations

import json
import math
from urllib.parse import quote, urlencode

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fourd.lab import api
from fourd.lab.server import LabServer
from fourd.layout import DIMS, RECOMPUTE
from fourd.model.config import PRESETS
from fourd.schedules import SCHEDULES

PARAMS = {
    "schedule": ["p", "m", "schedule", "v"],
    "cluster": ["layout", "cluster"],
    "plan": list(api.PLAN_PARAMS),
    "simtrace": list(api.PLAN_PARAMS),
    "trace": ["path"],
    "options": [],
}
VALUES = [
    "0",
    "1",
    "2",
    "3",
    "4",
    "7",
    "8",
    "16",
    "64",
    "128",
    "256",
    "8192",
    "16384",
    "-1",
    "1e3",
    "nan",
    "inf",
    "99999999999999999999",
    "16M",
    "4096",
    "1T",
    "-5T",
    "0.5M",
    "tp=8,pp=16",
    "tp=3",
    "pp=2,dp=2",
    "pp=4",
    "tp=1,pp=1,dp=16384",
    "tp=8,pp=16,dp=128",
    "cp=2,pp=2",
    "tp=0",
    "dp=99999999",
    "tp=8,tp=8",
    "gpipe",
    "1f1b",
    "interleaved",
    "zero-bubble",
    "debug",
    "llama3-8b",
    "llama3-405b",
    "llama3-h100",
    "../x",
    "trace.json",
    "../../etc/passwd",
    "a" * 300 + ".json",
    "none",
    "selective",
    "full",
    "",
    " ",
    "\x00",
    "é",
]
value = st.one_of(
    st.sampled_from(VALUES), st.integers(-(10**12), 10**12).map(str), st.text(max_size=12)
)
layouts = st.lists(
    st.tuples(st.sampled_from(DIMS), st.sampled_from([1, 2, 3, 4, 8, 16, 128, 16384])),
    max_size=4,
    unique_by=lambda t: t[0],
)
layout_text = lambda items: ",".join(f"{d}={n}" for d, n in items)  # noqa: E731


often = st.sampled_from([True, True, True, True, False])
ints = lambda lo, hi: st.integers(lo, hi).map(str)  # noqa: E731
VALID = {
    "p": ints(1, 16),
    "m": ints(1, 64),
    "v": ints(1, 8),
    "schedule": st.sampled_from(list(SCHEDULES)),
    "model": st.sampled_from(list(PRESETS)),
    "cluster": st.just("llama3-h100"),
    "gpus": st.sampled_from(["1", "2", "4", "8", "64", "128", "1024", "16384"]),
    "seq": st.sampled_from(["256", "2048", "4096", "8192"]),
    "microbatches": ints(1, 32),
    "global_batch_tokens": st.sampled_from(["16M", "8192", "65536", "1M"]),
    "zero": ints(0, 3),
    "recompute": st.sampled_from(list(RECOMPUTE)),
    "path": st.just("trace.json"),
    "layout": layouts.map(layout_text),
}


# simtrace simulates the plan step by step, every action of every pipeline rank: its examples stay small
# (at most 64 GPUs, 8 microbatches, short sequences), so that each answers in seconds whatever the lab's own
# bounds on such requests. Every other endpoint gets the whole range.
small_layouts = st.lists(
    st.tuples(st.sampled_from(DIMS), st.sampled_from([1, 2, 4, 8])),
    max_size=4,
    unique_by=lambda t: t[0],
)
SMALL_VALUES = [v for v in VALUES if not any(c.isdigit() for c in v) or len(v) <= 2]
small_value = st.one_of(
    st.sampled_from(SMALL_VALUES),
    st.integers(-100, 100).map(str),
    st.text(alphabet=st.characters(exclude_categories=["Nd"]), max_size=12),
)
SMALL = VALID | {
    "gpus": st.sampled_from(["1", "2", "4", "8", "16", "64"]),
    "seq": st.sampled_from(["256", "2048"]),
    "microbatches": ints(1, 8),
    "global_batch_tokens": st.sampled_from(["8192", "65536"]),
    "layout": small_layouts.map(layout_text),
    "model": st.sampled_from([m for m in PRESETS if m != "llama3-405b"]),
}


@st.composite
def requests(draw) -> tuple[str, str]:
    """An endpoint and a query string: mostly its own parameters, four in five of them well-formed, gpus
    often the layout's product; sometimes other keys, repeats and any text."""
    endpoint = draw(st.sampled_from(sorted(api.ENDPOINTS)))
    small = endpoint == "simtrace"
    valid, anything = (SMALL, small_value) if small else (VALID, value)
    q = []
    for key in PARAMS[endpoint]:
        if draw(often):
            q.append((key, draw(valid.get(key, anything) if draw(often) else anything)))
    if "gpus" in PARAMS[endpoint] and draw(st.booleans()):
        items = draw(small_layouts if small else layouts)
        q = [(k, v) for k, v in q if k not in ("layout", "gpus")] + [("layout", layout_text(items))]
        q.append(("gpus", str(math.prod(n for _, n in items))))
    if not draw(often):
        q += draw(
            st.lists(
                st.tuples(
                    st.sampled_from(["p", "gpus", "path", "V", ""]) | st.text(max_size=4),
                    anything,
                )
            )
        )
    return endpoint, urlencode(draw(st.permutations(q)))


# Text that is not a well-formed query at all: stray %, &, =, and any character, escaped only as far as a
# request line needs (no spaces or line breaks).
odd_query = st.text(max_size=60).map(lambda t: quote(t, safe="=&%+;/?:@,$!*'()"))


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("traces")
    (root / "trace.json").write_text(
        json.dumps({"traceEvents": [{"ph": "X", "name": "F0.0", "ts": 0, "dur": 1}]})
    )
    server = LabServer("127.0.0.1", 0, trace_dir=root)
    yield server
    server.server_close()


def answer(lab, endpoint: str, q: str) -> tuple[int, dict]:
    """Status and JSON body of GET /api/<endpoint>?<q>, as the server answers it on a socket."""
    head = f"GET /api/{endpoint}?{q} HTTP/1.1\r\nHost: 127.0.0.1:{lab.server_address[1]}\r\n\r\n"
    status_line, _, rest = lab.respond(head.encode("latin-1", "replace")).partition(b"\r\n")
    body = rest.partition(b"\r\n\r\n")[2]
    return int(status_line.split()[1]), json.loads(body)


def check(lab, endpoint: str, q: str) -> None:
    status, doc = answer(lab, endpoint, q)
    assert status == 200 or (
        400 <= status < 500 and list(doc) == ["error"] and "\n" not in doc["error"]
    ), (
        endpoint,
        q,
        status,
        doc,
    )


@pytest.fixture(scope="module", autouse=True)
def examples_from_the_strategies_alone():
    """Hypothesis also draws, now and then, constants it finds in the source of every local module imported so
    far; which those are depends on what else pytest collected, so the examples would too. Here they come from
    the strategies and the derandomized seed alone: the same alone and in the whole suite."""
    from hypothesis.internal.conjecture import providers

    providers.CONSTANTS_CACHE.cache.clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(providers, "_get_local_constants", providers.Constants)
        yield
    providers.CONSTANTS_CACHE.cache.clear()


# The same examples on every run (derandomize), so that `make test` passes or fails for the code alone.
SETTINGS = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@pytest.mark.timeout(300)
@SETTINGS
@given(request=requests())
def test_any_parameters_get_an_answer_or_one_line(lab, request):
    check(lab, *request)


@pytest.mark.timeout(300)
@SETTINGS
@given(endpoint=st.sampled_from(sorted(api.ENDPOINTS)), q=odd_query)
def test_any_query_text_gets_an_answer_or_one_line(lab, endpoint, q):
    check(lab, endpoint, q)
