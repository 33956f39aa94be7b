"""The pre-registered first predictions (docs/planner.md, "First predictions (pre-registered)"): the figures
recorded in benchmarks/validation/runs.toml before the model changed for their sources are pinned, every
source with one carries its date and commit, and the loader still checks the whole file strictly."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fourd.errors import FourdError

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "benchmarks" / "validate_planner.py"
DATA = ROOT / "benchmarks" / "validation" / "runs.toml"
# mean |first_prediction_s / step_time_s_derived - 1| over every row with a first prediction: the 50 rows
# recorded on 2026-12-01 at 8afd7a1 (mean 0.08401218510289535), the 34 recorded on 2026-12-02 at 69b281a
# (the 84 together: 0.13889212928471428), the 45 recorded on 2026-12-05 at 9a0c182 (the 129 together:
# 0.11435077545891847), the 39 of the later DGX Cloud release recorded on 2026-12-05 at 7f045ba (the 168
# together: 0.10212824532942426), Lambda's 6 recorded on 2026-12-05 at 0cca9b9 (the 174 together:
# 0.1093041955894117), the Megatron-LM README's 2 strong-scaling rows recorded on 2026-12-06 at e4976d7
# (the 176 together: 0.1090401190090985), the DGX Cloud release's 34 FP8 rows recorded on 2026-12-06 at
# f050f51, planned in BF16 by a planner that had no FP8 (the 210 together: 0.1737869645933259), and the 25.05
# release's GB200 rows recorded on 2026-12-07 at 3096bde with a datasheet GB200 profile: 18 rows, 17 kept
# since the first became GB200's fit row (its first prediction stays in docs/planner.md; the 18: 0.1857; the
# 227 together: 0.17523057438418768), InternEvo's 46 rows recorded on 2026-12-07 at ed0ac15 with a stack
# profile read from its code (the 273 together: 0.16732048407329575), GLM-130B's and BloombergGPT's rows
# recorded on 2026-12-07 at 07899b6 (the 275 together: 0.16763129040877742), and the Megatron-LM README's
# GPT-3 example recorded on 2026-12-07 at b7ad466 (the 276 together: 0.1671280567508725), BLOOM-176B's 30
# topology benchmarks recorded on 2026-12-07 at 1896cb2 (the 306 together: 0.15995794932759685), and NeMo
# 24.07's 12 FP8 rows recorded on 2026-12-07 at a75047f (the 318 together: 0.15775507464511634), less
# BloombergGPT's row, excluded since (its first prediction kept; the 317: 0.15693867473499415), and NeMo's
# long-sequence table's 9 rows recorded on 2026-12-07 at 8d413eb (the 326 together: 0.1557255215827597),
# and its 8 rows on DGX B200 recorded on 2026-12-07 at c71dcce with a datasheet B200 profile (the 334
# together: 0.1526085006078516), and Megatron-Bridge's 40 rows of seven containers recorded on 2026-12-07
# at c2de471 (the 374 together: 0.14060633236151326), and NeMo AutoModel's row recorded on 2026-12-07 at
# 1f529af (the 375 together: 0.14048669078385786), and FlagPerf's 9 A800 and H800 rows recorded on
# 2026-12-07 at 9eeaeb7 with the export parts' own profiles (the 384 together: 0.1383185833395305), and its 3
# A800 fine-tuning rows recorded on 2026-12-07 at f01ef23 (the 387 together: 0.13736893565649472), and its 2
# H100 FP8 rows recorded on 2026-12-07 at 078d517 (the 389 together: 0.1370654543113021), and NeMo's
# performance summaries on B200 (25.02) and GB200 (25.04), 11 rows recorded on 2026-12-07 at 6d4c5fc (the
# 400 together: 0.13561917537333162), and llm-foundry's 56 H100 rows recorded on 2026-12-08 at 10686af (the
# 456 together: 0.12868137205943164), and its 132 A100 rows recorded on 2026-12-08 at e47804e (the 588
# together: 0.1127166518358006), and its 18 rows on 128 to 512 H100 recorded on 2026-12-08 at 83bfda6
FIRST_PREDICTION_MEAN = 0.11246055895388962
FIRST_PREDICTION_ROWS = 606
# the same over each batch of sources, by the source's first_prediction stamp
BATCHES = {
    "2026-12-01, commit 8afd7a1": (50, 0.08401218510289535),
    "2026-12-02, commit 69b281a": (34, 0.21959792955209503),
    "2026-12-05, commit 9a0c182": (45, 0.06854024831743295),
    "2026-12-05, commit 7f045ba": (39, 0.061699876439558765),
    "2026-12-05, commit 0cca9b9": (6, 0.31023080286906035),
    "2026-12-06, commit e4976d7": (2, 0.0860654565218501),
    "2026-12-06, commit f050f51": (34, 0.5089471064410911),
    "2026-12-07, commit 3096bde": (17, 0.19306340121248025),
    "2026-12-07, commit ed0ac15": (46, 0.12828590797389422),
    "2026-12-07, commit 07899b6": (2, 0.2100563552020281),
    "2026-12-07, commit b7ad466": (1, 0.028738800827015853),
    "2026-12-07, commit 1896cb2": (30, 0.09399296103346104),
    "2026-12-07, commit a75047f": (12, 0.10158177024186284),
    "2026-12-07, commit 8d413eb": (9, 0.11299557166516817),
    "2026-12-07, commit c71dcce": (8, 0.02558989588034688),
    "2026-12-07, commit c2de471": (40, 0.040388227504587995),
    "2026-12-07, commit 1f529af": (1, 0.09574074074074068),
    "2026-12-07, commit 9eeaeb7": (9, 0.04798077315922462),
    "2026-12-07, commit f01ef23": (3, 0.015814032227912556),
    "2026-12-07, commit 078d517": (2, 0.07834181401652801),
    "2026-12-07, commit 6d4c5fc": (11, 0.084473492930558),
    "2026-12-08, commit 10686af": (56, 0.07912563410300319),
    "2026-12-08, commit e47804e": (132, 0.0575658001541661),
    "2026-12-08, commit 83bfda6": (18, 0.10409485814479752),
}

pytestmark = pytest.mark.skipif(
    not DATA.is_file(), reason="benchmarks/validation/runs.toml is not in this checkout"
)


def _load(path: Path = DATA):
    """benchmarks/validation/runs.py's loader, imported as the harness imports it."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    from validation.runs import load

    return load(path)


def test_the_harness_reports_the_pinned_first_prediction_mean():
    out = subprocess.run(
        [sys.executable, str(HARNESS), "--json"], check=True, capture_output=True, timeout=300
    ).stdout
    d = json.loads(out)
    assert d["first_prediction_mean"] == pytest.approx(FIRST_PREDICTION_MEAN, abs=1e-12)
    assert d["first_prediction_rows"] == FIRST_PREDICTION_ROWS
    assert sum(d["first_prediction_source_rows"].values()) == FIRST_PREDICTION_ROWS
    assert len(d["first_prediction_per_source"]) >= 3
    assert set(d["first_prediction_rows_now"]) == set(d["first_prediction_per_source"])


def test_every_source_with_first_predictions_records_its_date_and_commit():
    sources, runs = _load()
    first = [r for r in runs if r.first_prediction_s and not r.excluded]
    assert len(first) == FIRST_PREDICTION_ROWS
    # a first prediction stays on a row excluded after it was made: BloombergGPT's (-41.7 %)
    kept = {r.id: r.first_prediction_s for r in runs if r.first_prediction_s and r.excluded}
    assert kept == {"bloomberggpt-50b-512": 18.962}
    errors = [abs(r.first_prediction_s / r.step_time_s_derived - 1) for r in first]
    assert sum(errors) / len(errors) == pytest.approx(FIRST_PREDICTION_MEAN, abs=1e-12)
    for src in {r.source for r in first}:
        assert re.fullmatch(
            r"\d{4}-\d{2}-\d{2}, commit [0-9a-f]{7,40}", sources[src].first_prediction
        ), src
    assert all(not r.fit and r.stack for r in first)


def test_each_batch_of_first_predictions_keeps_its_mean():
    """A later batch of pre-registered sources leaves the earlier batches' figures as they were recorded."""
    sources, runs = _load()
    for stamp, (rows, mean) in BATCHES.items():
        errors = [
            abs(r.first_prediction_s / r.step_time_s_derived - 1)
            for r in runs
            if r.first_prediction_s and sources[r.source].first_prediction == stamp
        ]
        assert len(errors) == rows, stamp
        assert sum(errors) / len(errors) == pytest.approx(mean, abs=1e-12), stamp
    # the batches as recorded, BloombergGPT's excluded row among them
    assert sum(rows for rows, _ in BATCHES.values()) == FIRST_PREDICTION_ROWS + 1


def test_the_loader_checks_the_whole_file_and_refuses_a_bad_first_prediction(tmp_path):
    sources, runs = _load()
    assert len(runs) >= 171 and len(sources) >= 24
    text = DATA.read_text()
    # A first prediction on a source without its date/commit record is refused, naming the row.
    stamp = 'first_prediction = "2026-12-01, commit 8afd7a1"\n'
    bad = tmp_path / "no_stamp.toml"
    bad.write_text(text.replace(stamp, "", 1))
    with pytest.raises(FourdError, match="first_prediction_s needs the source's"):
        _load(bad)
    # A stack outside the vocabulary is refused with the choices.
    bad.write_text(text.replace('stack = "paddle"', 'stack = "paddlepaddle"', 1))
    with pytest.raises(FourdError, match="stack = 'paddlepaddle': choose one of"):
        _load(bad)
    # A cluster that is not a preset is refused with the choices.
    bad.write_text(text.replace('cluster = "aws-p5"', 'cluster = "aws-p4"', 1))
    with pytest.raises(FourdError, match="cluster = 'aws-p4': choose one of .*'aws-p5'"):
        _load(bad)
    # The script form checks the file and prints its coverage.
    script = ROOT / "benchmarks" / "validation" / "runs.py"
    coverage = subprocess.run(
        [sys.executable, str(script)], check=True, capture_output=True, text=True, timeout=120
    ).stdout
    assert coverage.startswith("697 rows (671 usable, 26 excluded) from 54 sources")
