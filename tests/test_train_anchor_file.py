"""The anchor.json `fourd train` leaves (fourd.train.anchor_file.anchor_record) on rows worked out by hand: the
median step time after the first three steps (at least one step kept), the fullest step's memory in GB of 10^9
bytes (metrics.jsonl's are GiB), and the settings in the form `fourd plan --anchor` reads."""

from __future__ import annotations

from fourd.config import Config, set_value
from fourd.train.anchor_file import anchor_record


def _cfg() -> Config:
    cfg = Config()
    for key, value in {
        "model.preset": "debug",
        "parallel.layout": "tp=2,pp=2,dp=2",
        "parallel.schedule": "interleaved",
        "parallel.virtual_stages": 2,
        "parallel.microbatches": 4,
        "parallel.recompute": "selective",
        "parallel.zero": 1,
        "data.seq_len": 128,
        "train.global_batch": 8,
    }.items():
        set_value(cfg, key, value)
    return cfg


def _rows(times, peaks):
    return [
        {"step": step, "step_time_s": seconds, "peak_mem_gb": peak}
        for step, (seconds, peak) in enumerate(zip(times, peaks), start=1)
    ]


def test_the_anchor_is_the_median_step_after_warm_up_and_the_fullest_steps_memory():
    rows = _rows([9.0, 5.0, 4.0, 2.0, 3.0, 2.5, 7.0], [1.0, 1.5, 2.0, 2.0, 1.75, 2.0, 2.0])
    anchor = anchor_record(_cfg(), rows, "cpu")
    assert anchor["step_time_s"] == 2.75  # the median of steps 4 to 7: 2.0, 3.0, 2.5, 7.0
    assert anchor["steps_timed"] == 4
    assert anchor["peak_memory_gb"] == 2.0 * 2**30 / 1e9  # 2 GiB
    assert {
        key: anchor[key] for key in anchor if key not in ("model", "step_time_s", "peak_memory_gb")
    } == {
        "cluster": "local",
        "gpus": 8,
        "layout": "tp=2,cp=1,pp=2,dp=2",
        "schedule": "interleaved",
        "virtual_stages": 2,
        "microbatches": 4,
        "seq": 128,
        "global_batch_tokens": 8 * 128,
        "recompute": "selective",
        "zero": 1,
        "sequence_parallel": False,
        "hsdp_replicas": 1,
        "dtype": "fp32",
        "compiled": False,
        "stack": "fourd",
        "steps_timed": 4,
    }
    assert anchor["model"]["layers"] == 4 and anchor["model"]["dim"] == 64


def test_a_short_run_keeps_its_last_step():
    for times, kept in (([9.0], 9.0), ([9.0, 4.0], 4.0), ([9.0, 5.0, 4.0, 3.0], 3.0)):
        anchor = anchor_record(_cfg(), _rows(times, [1.0] * len(times)), "cpu")
        assert (anchor["step_time_s"], anchor["steps_timed"]) == (kept, 1), times
