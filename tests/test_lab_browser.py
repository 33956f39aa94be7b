"""The lab page in a real headless Chromium (Debian's, driven by Playwright): GPipe's readouts, blocks
drawn per GPU as the schedule says, text that keeps its size from 800 to 1,600 px, the URL following the
sliders, the cluster row's colours, traces on one time axis. A screenshot of the bench is kept in
test-artifacts/ and decoded."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fourd.lab.server import LabServer
from fourd.schedules import build_schedule

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="Debian's chromium is not installed (`make install` installs it)"
)
sync_api = pytest.importorskip("playwright.sync_api")
expect = sync_api.expect
expect.set_options(
    timeout=30_000
)  # a loaded 2-core machine draws a 16-stage timeline in more than the default 5 s

FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


@pytest.fixture(scope="module")
def url():
    # the pages render what the API answers; the answers' time bound (1.5 s, test_lab_server.py) is
    # not what they test, and a plan beside a 16-rank training run on the other core takes longer
    server = LabServer("127.0.0.1", 0, compute_limit_s=30.0)
    server.serve_in_thread()
    yield server.url
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser():
    pw = sync_api.sync_playwright().start()
    b = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
    yield b
    b.close()
    pw.stop()


@pytest.fixture
def page(browser):
    p = browser.new_page(viewport={"width": 1280, "height": 900})
    errors = []
    p.on("pageerror", lambda e: errors.append(str(e)))
    p.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    p.lab_errors = errors  # a test that provokes an error takes it off this list
    yield p
    p.close()
    assert errors == []


def test_dump_dom_shows_the_gpipe_readouts(url, tmp_path):
    """What a plain `chromium --dump-dom` sees once the page has loaded (no scripting of the page)."""
    for query, idle, speedup in (
        ("p=16&m=16&schedule=gpipe", "48.4 %", "8.26×"),
        ("p=16&m=64&schedule=gpipe", "19.0 %", "12.96×"),
        ("p=1&m=16&schedule=gpipe", "0.0 %", "1.00×"),
    ):
        dom = subprocess.run(
            [
                CHROMIUM,
                "--headless",
                *FLAGS,
                f"--user-data-dir={tmp_path / 'profile'}",
                "--virtual-time-budget=5000",
                "--dump-dom",
                f"{url}?{query}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        assert f'<output id="idle">{idle}</output>' in dom, query
        assert f'<output id="speedup">{speedup}</output>' in dom, query


def drawn(page):
    """Per timeline row: the kinds of its blocks, left to right in drawing order."""
    return page.evaluate("""[...document.querySelectorAll('#timeline g.row')].map(
        (g) => [...g.querySelectorAll('rect.blk')].map((r) => r.classList[1]))""")


@pytest.mark.parametrize(
    "schedule,p,m,v",
    [
        ("gpipe", 4, 6, 1),
        ("1f1b", 5, 7, 1),
        ("interleaved", 4, 8, 2),
        ("zero-bubble", 4, 6, 1),
        ("gpipe", 16, 64, 1),
    ],
)
def test_blocks_per_stage_are_the_schedules_actions(page, url, schedule, p, m, v):
    query = f"p={p}&m={m}&schedule={schedule}" + (f"&v={v}" if v > 1 else "")
    page.goto(f"{url}?{query}")
    sched = build_schedule(schedule, p, m, v)
    expect(page.locator("#timeline g.row")).to_have_count(p)
    rows = drawn(page)
    assert [len(r) for r in rows] == [len(a) for a in sched.ranks]
    assert rows == [[a.kind for a in actions] for actions in sched.ranks]
    peaks = page.locator("#timeline text.peak").all_text_contents()
    if v == 1:
        plural = {1: "peak 1 microbatch"}
        assert peaks == [
            plural.get(n, f"peak {n} microbatches") for n in map(sched.peak_in_flight, range(p))
        ]
    else:  # each in-flight (stage, microbatch) of an interleaved GPU holds 1/V of a microbatch's activations
        assert peaks == [
            f"peak {sched.peak_in_flight(r) / v:g} microbatches' worth" for r in range(p)
        ]
        assert (
            peaks[0] == "peak 5.5 microbatches' worth"
        )  # 11 stage-microbatches in flight on GPU 0


def test_the_words_say_what_is_drawn(page, url):
    page.goto(f"{url}?p=4&m=8&schedule=gpipe")
    expect(page.locator("#speedup")).to_have_text("2.91×")
    expect(page.locator(".readouts").first).to_contain_text(
        "speed-up over one GPU running every stage 2.91×"
    )
    expect(page.locator("#legend-b")).to_have_text("backward")
    expect(page.locator("#legend-w")).to_be_hidden()
    expect(page.locator("#timeline g.row text").first).to_have_text("GPU 0")
    page.locator("#schedule").select_option("zero-bubble")
    expect(page.locator("#legend-b")).to_have_text("input gradients (the first half of backward)")
    expect(page.locator("#legend-w")).to_have_text("weight gradients")
    page.locator("#schedule").select_option("interleaved")
    expect(page.locator("#timeline g.row text").first).to_have_text("GPU 0 · stages 0,4")
    expect(page.locator("#legend-peak")).to_have_text(
        "peak: the most activations a GPU holds at once, in microbatches' worth "
        "(each of its 2 stages holds 1/2 of a microbatch's)"
    )


# Every label of a drawing as the screen shows it: the computed font size times the SVG's scale.
LABEL_PX = """[...document.querySelectorAll('SEL text')].map(
    (t) => parseFloat(getComputedStyle(t).fontSize) * t.getScreenCTM().a)"""


@pytest.mark.parametrize("width", [800, 1600])
def test_the_drawing_keeps_its_text_size_from_800_to_1600_px(browser, url, width):
    page = browser.new_page(viewport={"width": width, "height": 900})
    try:
        page.goto(f"{url}?p=16&m=64&schedule=interleaved&v=8")
        expect(page.locator("#timeline g.row")).to_have_count(16)
        sizes = page.evaluate(LABEL_PX.replace("SEL", "#timeline"))
        assert len(sizes) >= 16 * 2 + 2 and min(sizes) >= 11, sizes[:4]
        box = page.locator("#timeline svg").bounding_box()
        assert box["x"] >= 0 and box["x"] + box["width"] <= width  # no part of it off the screen
        assert page.evaluate("document.documentElement.scrollWidth") <= width
    finally:
        page.close()


def test_the_drawing_follows_the_window_width(browser, url):
    page = browser.new_page(viewport={"width": 1600, "height": 900})
    try:
        page.goto(f"{url}?p=4&m=8")
        expect(page.locator("#timeline g.row")).to_have_count(4)
        wide = page.locator("#timeline svg").bounding_box()["width"]
        page.set_viewport_size({"width": 800, "height": 900})
        expect(page.locator("#timeline svg")).to_have_attribute(
            "width", "768"
        )  # 800 less the page's margins
        assert wide == 1200  # the page's column
        assert min(page.evaluate(LABEL_PX.replace("SEL", "#timeline"))) >= 11
    finally:
        page.close()


def test_sliders_update_the_readouts_and_the_url(page, url):
    page.goto(f"{url}?p=16&m=16&schedule=gpipe")
    expect(page.locator("#idle")).to_have_text("48.4 %")
    page.locator("#m").fill("64")
    expect(page.locator("#idle")).to_have_text("19.0 %")
    expect(page).to_have_url(f"{url}?p=16&m=64&schedule=gpipe")
    page.locator("#p").fill("1")
    expect(page.locator("#idle")).to_have_text("0.0 %")
    expect(page.locator("#speedup")).to_have_text("1.00×")
    expect(page).to_have_url(f"{url}?p=1&m=64&schedule=gpipe")
    page.locator("#schedule").select_option("interleaved")
    page.locator("#p").fill("8")
    page.locator("#v").fill("4")
    expect(page).to_have_url(f"{url}?p=8&m=64&schedule=interleaved&v=4")
    # bubble/compute (p−1)/(V·m) = 7/256 of a 3·64-unit step
    expect(page.locator("#idle")).to_have_text(f"{100 * 7 / (256 + 7):.1f} %")
    page.reload()
    expect(page.locator("#p-value")).to_have_text("8")
    expect(page.locator("#v-value")).to_have_text("4")
    expect(page.locator("#schedule")).to_have_value("interleaved")


def test_a_link_with_capital_v_sets_the_stages_per_gpu(page, url):
    page.goto(f"{url}?p=4&m=8&schedule=interleaved&V=4")
    expect(page.locator("#v-value")).to_have_text("4")
    expect(page.locator("#idle")).to_have_text(f"{100 * 3 / (4 * 8 + 3):.1f} %")
    expect(page).to_have_url(f"{url}?p=4&m=8&schedule=interleaved&v=4")


def test_out_of_range_link_is_clamped_to_the_sliders(page, url):
    page.goto(f"{url}?p=99&m=0&schedule=nonsense")
    expect(page.locator("#p-value")).to_have_text("16")
    expect(page.locator("#m-value")).to_have_text("1")
    expect(page.locator("#schedule")).to_have_value("gpipe")
    expect(page.locator("#idle")).to_have_text(f"{100 * 15 / 16:.1f} %")


def test_screenshot_of_the_bench_is_kept(page, url):
    """The PNG decodes to the page's size, and inside the drawing's plot backward covers twice the pixels of
    forward (1 and 2 units each, for 16 GPUs × 16 microbatches) and both cover what the timeline says."""
    page.goto(f"{url}?p=16&m=16&schedule=gpipe")
    expect(page.locator("#idle")).to_have_text("48.4 %")
    # the planner and cluster panels fill in from their own requests: the page's height settles after
    page.wait_for_load_state("networkidle")
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "lab-bench-p16-m16-gpipe.png"
    page.screenshot(path=str(shot), full_page=True)
    image = Image.open(shot).convert("RGB")
    assert image.size == (1280, page.evaluate("document.documentElement.scrollHeight"))
    svg = page.locator("#timeline svg").bounding_box()
    drawing = np.asarray(
        image.crop((svg["x"], svg["y"], svg["x"] + svg["width"], svg["y"] + svg["height"]))
    )
    boxes = page.evaluate("""['F', 'B'].map((k) => [...document.querySelectorAll(`#timeline rect.blk.${k}`)].map(
        (r) => { const b = r.getBoundingClientRect(); return b.width * b.height; }).reduce((a, b) => a + b, 0))""")
    plot = page.locator("#timeline rect.row-bg").first.bounding_box()
    # Forward is 16 of each row's 93 units and backward 32, on 16 rows.
    assert boxes == pytest.approx(
        [16 * plot["width"] * plot["height"] * k / 93 for k in (16, 32)], rel=1e-3
    )
    # The screenshot shows those blocks in their colours, less block edges and the microbatch numbers.
    for area, colour in zip(boxes, ((0x2F, 0x6F, 0xD6), (0x9C, 0xC4, 0xF5))):
        pixels = int((drawing == colour).all(axis=-1).sum())
        assert 0.6 * area <= pixels <= area, (colour, pixels, area)


def relative_luminance(rgb) -> float:
    """WCAG 2.x relative luminance of an sRGB colour."""
    lin = [
        c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in (v / 255 for v in rgb)
    ]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def cielab(rgb) -> tuple[float, float, float]:
    """CIE L*a*b* (D65) of an sRGB colour."""
    r, g, b = (
        c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in (v / 255 for v in rgb)
    )
    xyz = (
        (0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047,
        relative_luminance(rgb),
        (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883,
    )
    f = [t ** (1 / 3) if t > 216 / 24389 else (24389 / 27 * t + 16) / 116 for t in xyz]
    return 116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])


def test_group_colours_are_distinct_and_carry_white_text(page, url):
    """The 16 TP groups of tp=8,pp=16 get 16 colours, every two at least ΔE*ab 30 apart (2.3 is just
    noticeable), each at least 3:1 against the white index written on it (WCAG's minimum for large text)."""
    page.goto(f"{url}?p=4&m=4")
    expect(page.locator("#racks .gpu[data-rank]")).to_have_count(128)
    page.locator("#colour-by").select_option("tp")
    expect(page.locator('#racks .gpu[data-rank="127"]')).to_have_attribute("data-group", "120")
    styles = page.evaluate(
        "[...document.querySelectorAll('#racks .gpu[data-rank]')].map((g) => getComputedStyle(g).backgroundColor)"
    )
    colours = sorted({tuple(map(int, re.findall(r"\d+", c)[:3])) for c in styles})
    assert len(colours) == 16
    closest = min(math.dist(cielab(a), cielab(b)) for a, b in itertools.combinations(colours, 2))
    assert closest >= 30, closest
    assert min(1.05 / (relative_luminance(c) + 0.05) for c in colours) >= 3.0


def test_groups_that_straddle_servers_say_so(page, url):
    page.goto(f"{url}?p=4&m=4&layout=tp%3D3%2Cpp%3D16")
    expect(page.locator("#spans li")).to_have_text(
        [
            "TP: 16 groups of 3: 12 inside one server (NVLink), 2 inside one rack, 2 across racks inside one pod; "
            "tp=3 does not divide a server's 8 GPUs, so 4 groups straddle servers",
            "PP: 3 groups of 16, each across racks inside one pod",
        ]
    )


def test_cluster_row_colours_the_groups_of_a_layout(page, url):
    page.goto(f"{url}?p=4&m=4")
    gpus = page.locator("#racks .gpu[data-rank]")
    expect(gpus).to_have_count(128)
    expect(page.locator("#racks .rack")).to_have_count(8)
    expect(page.locator("#racks .server")).to_have_count(16)

    def colours():
        return len(
            set(
                page.evaluate(
                    "[...document.querySelectorAll('#racks .gpu[data-rank]')].map((g) => g.style.background)"
                )
            )
        )

    assert colours() == 8  # tp=8,pp=16 coloured by pipeline: one pipeline per GPU slot of a server
    page.locator("#colour-by").select_option("tp")
    expect(page.locator('#racks .gpu[data-rank="127"]')).to_have_attribute("data-group", "120")
    assert colours() == 16  # one TP group per server
    expect(page.locator("#colour-by option[value=cp]")).to_be_disabled()
    page.locator("#layout").fill("tp=2,cp=2,pp=4,dp=2")
    expect(page.locator("#racks .gpu.unused")).to_have_count(128 - 32)
    expect(page.locator("#spans li")).to_have_text(
        [
            "TP: 16 groups of 2, each inside one server (NVLink)",
            "CP: 16 groups of 2, each inside one server (NVLink)",
            "PP: 8 groups of 4, each inside one rack",
            "DP: 16 groups of 2, each across racks inside one pod",  # ranks r and r+16: two racks
        ]
    )
    assert "layout=tp%3D2%2Ccp%3D2%2Cpp%3D4%2Cdp%3D2" in page.url
    page.locator("#colour-by").select_option("cp")
    expect(page.locator('#racks .gpu[data-rank="3"]')).to_have_attribute("data-group", "1")
    assert colours() == 16
    page.locator("#layout").fill("tp=3,zz=1")
    expect(page.locator("#cluster-error")).to_have_text(
        "layout 'tp=3,zz=1': bad item 'zz=1'; write key=value with keys tp, cp, pp, dp"
    )
    assert page.lab_errors == [
        "Failed to load resource: the server responded with a status of 400 (Bad Request)"
    ]
    page.lab_errors.clear()


def test_a_measured_trace_opens_from_a_file(page, url, tmp_path):
    events = [
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}}
        for r in range(2)
    ]
    events += [
        {
            "ph": "X",
            "name": f"{k}0.{j}",
            "pid": 0,
            "tid": r,
            "ts": 1000 * (j + 3 * r + (k == "B")),
            "dur": 800,
        }
        for r in range(2)
        for j in range(3)
        for k in "FB"
    ]
    events += [
        {"ph": "B", "name": "W", "pid": 0, "tid": 1, "ts": 20000},
        {"ph": "E", "name": "W", "pid": 0, "tid": 1, "ts": 21000},
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    page.goto(url)
    # the page's first plan drawn: its options and panels are in place (under load the file chosen
    # before that was lost once: no measured row within 30 s, 2026-12-07)
    expect(page.locator("#memory .bar")).to_have_count(16)
    page.locator("#trace-file").set_input_files(str(trace))
    page.locator("#trace-form button[type=submit]").click()
    rows = page.locator("#measured g.row")
    expect(rows).to_have_count(2)
    expect(page.locator("#measured g.row text").first).to_have_text("rank 0")
    kinds = page.evaluate("""[...document.querySelectorAll('#measured g.row')].map(
        (g) => [...g.querySelectorAll('rect.blk')].map((r) => r.classList[1]))""")
    assert kinds == [["F", "B"] * 3, ["F", "B"] * 3 + ["W"]]
    expect(page.locator("#measured text.axis")).to_have_text(["0", "5", "10", "15", "20 ms"])
    expect(page.locator("#measured-name")).to_have_text("trace.json · 21 ms")
    # The simulated step of a 2-GPU pipeline is drawn on the same axis, as long as the longer of the two.
    for field, value in (
        ("#plan-gpus", "2"),
        ("#plan-layout", "pp=2"),
        ("#plan-microbatches", "4"),
    ):
        page.locator(field).fill(value)
    page.locator("#plan-seq").fill("256")
    page.locator("#plan-tokens").fill("4096")
    page.locator("#plan-model").select_option("debug")
    page.locator("#plan-schedule").select_option("1f1b")
    page.locator("#simulate").click()
    expect(page.locator("#simulated g.row")).to_have_count(4)
    axes = [page.locator(f"#{w} text.axis").all_text_contents() for w in ("measured", "simulated")]
    assert axes[0] == axes[1] and axes[0][-1].endswith(" ms")
    ticks = (
        "[...document.querySelectorAll('#WHICH line.tick')].map((l) => l.getBoundingClientRect().x)"
    )
    assert page.evaluate(ticks.replace("WHICH", "measured")) == page.evaluate(
        ticks.replace("WHICH", "simulated")
    )
    simulated_ms = float(
        re.search(r"· ([\d.,]+) ms$", page.locator("#simulated-name").text_content())[1].replace(
            ",", ""
        )
    )
    spans = [max(21, simulated_ms)] * 2
    assert float(axes[0][-1].split()[0].replace(",", "")) <= spans[0]


def test_planner_panel_shows_the_plans_mfu_and_a_memory_bar_per_pipeline_rank(page, url):
    from fourd.lab import api

    page.goto(url)
    plan = api.plan(
        {
            "model": "llama3-405b",
            "cluster": "llama3-h100",
            "gpus": "16384",
            "layout": "tp=8,pp=16,dp=128",
            "schedule": "interleaved",
            "microbatches": "16",
            "seq": "8192",
            "global_batch_tokens": "16M",
        }
    )["plan"]
    expect(page.locator("#plan-mfu")).to_have_text(f"{100 * plan['mfu']:.1f} %")
    expect(page.locator("#memory .bar")).to_have_count(16)
    page.locator("#plan-layout").fill("tp=8,pp=4,dp=2")
    page.locator("#plan-gpus").fill("64")
    page.locator("#plan-model").select_option("llama3-70b")
    page.locator("#plan-form button[type=submit]").click()
    expect(page.locator("#memory .bar")).to_have_count(4)
    expect(page.locator("#plan-config")).to_contain_text("tp=8,cp=1,pp=4,dp=2 · interleaved")


def test_the_simulated_trace_of_the_planner_panels_layout(page, url):
    page.goto(url)
    expect(page.locator("#memory .bar")).to_have_count(16)  # the default plan has drawn
    for field, value in (
        ("#plan-gpus", "8"),
        ("#plan-layout", "pp=4,dp=2"),
        ("#plan-microbatches", "8"),
        ("#plan-seq", "256"),
        ("#plan-tokens", "8192"),
    ):
        page.locator(field).fill(value)
    page.locator("#plan-model").select_option("debug")
    page.locator("#plan-schedule").select_option("1f1b")
    page.locator("#simulate").click()
    expect(page.locator("#simulated g.row")).to_have_count(8)  # per pipeline rank: compute, sends
    kinds = page.evaluate("""[...document.querySelectorAll('#simulated g.row')].map(
        (g) => [...g.querySelectorAll('rect.blk')].map((r) => r.classList[1]))""")
    sched = build_schedule("1f1b", 4, 8)
    assert [kinds[2 * r] for r in range(4)] == [[a.kind for a in sched.ranks[r]] for r in range(4)]
    assert all(set(kinds[2 * r + 1]) <= {"pp", "dp"} and "pp" in kinds[2 * r + 1] for r in range(4))


def test_a_trace_opens_by_path_under_the_trace_dir(page, tmp_path):
    """`fourd sim step --trace` writes the file; the page opens it by name through /api/trace."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fourd",
            "sim",
            "step",
            "--model",
            "debug",
            "--gpus",
            "4",
            "--layout",
            "pp=2,dp=2",
            "--schedule",
            "gpipe",
            "--microbatches",
            "4",
            "--seq",
            "256",
            "--global-batch-tokens",
            "4096",
            "--trace",
            str(tmp_path / "step.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    # the page's own start-up requests share the server with the trace's: a compute limit that a
    # machine busy with the rest of the suite does not reach (the limit has tests of its own)
    server = LabServer("127.0.0.1", 0, trace_dir=tmp_path, compute_limit_s=30.0)
    server.serve_in_thread()
    try:
        page.goto(server.url)
        page.locator("#trace-path").fill("step.json")
        page.locator("#trace-form button[type=submit]").click()
        expect(page.locator("#measured g.row")).to_have_count(4)  # 2 pipeline ranks: compute, sends
        expect(page.locator("#measured-name")).to_have_text(
            re.compile(r"^step\.json · [0-9.]+ ms$")
        )
        blocks = page.evaluate(
            "document.querySelector('#measured g.row').querySelectorAll('rect.blk').length"
        )
        assert blocks == 8  # GPipe on rank 0: 4 forwards, 4 backwards
        page.locator("#trace-path").fill("../step.json")
        page.locator("#trace-form button[type=submit]").click()
        expect(page.locator("#trace-error")).to_contain_text("is outside the lab's --trace-dir")
        assert page.lab_errors == [
            "Failed to load resource: the server responded with a status of 400 (Bad Request)"
        ]
        page.lab_errors.clear()
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
def test_a_trace_written_by_fourd_train_beside_the_simulated_step(page, tmp_path):
    """Two real ranks train one step with 1F1B and write trace.json; the page draws, for each rank,
    the schedule's actions in order, and the simulated step of the same layout beneath."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fourd",
            "train",
            "--model",
            "debug",
            "--layout",
            "pp=2",
            "--schedule",
            "1f1b",
            "--microbatches",
            "4",
            "--steps",
            "1",
            "--run-dir",
            str(tmp_path / "run"),
            "--run.trace=true",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    server = LabServer("127.0.0.1", 0, trace_dir=tmp_path)
    server.serve_in_thread()
    try:
        page.goto(server.url)
        page.locator("#trace-path").fill("run/trace.json")
        page.locator("#trace-form button[type=submit]").click()
        expect(page.locator("#measured g.row")).to_have_count(2)
        for field, value in (
            ("#plan-gpus", "2"),
            ("#plan-layout", "pp=2"),
            ("#plan-microbatches", "4"),
            ("#plan-seq", "256"),
            ("#plan-tokens", "4096"),
        ):
            page.locator(field).fill(value)
        page.locator("#plan-model").select_option("debug")
        page.locator("#plan-schedule").select_option("1f1b")
        page.locator("#simulate").click()
        expect(page.locator("#simulated g.row")).to_have_count(4)
        kinds = "[...document.querySelectorAll('#WHICH g.row')].map((g) => [...g.querySelectorAll('rect.blk')].map((r) => r.classList[1]))"
        sched = [[a.kind for a in actions] for actions in build_schedule("1f1b", 2, 4).ranks]
        assert page.evaluate(kinds.replace("WHICH", "measured")) == sched
        assert page.evaluate(kinds.replace("WHICH", "simulated"))[::2] == sched
    finally:
        server.shutdown()
        server.server_close()
