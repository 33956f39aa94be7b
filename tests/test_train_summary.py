"""The closing summary of `fourd train` (fourd.train.metrics.summary_table) on rows worked out by hand: the mean
of each rate after the first step (which pays for warm-up), durations in seconds from 1 s and milliseconds below,
the planner's figure beside each with its error (predicted − measured) / measured, the peak memory of training
before the first checkpoint save, the last held-out loss and the measured bubble."""

from __future__ import annotations

from fourd.train.metrics import mfu_peak, seconds, summary_table


def _row(step, loss, tokens_per_s, step_time_s, mfu, peak, **extra):
    return dict(
        step=step,
        loss=loss,
        tokens_per_s=tokens_per_s,
        step_time_s=step_time_s,
        mfu=mfu,
        peak_mem_gb=peak,
        **extra,
    )


ROWS = [
    # the first step pays for warm-up: its rates are left out of every mean
    _row(1, 5.5, 100.0, 2.0, 0.01, 1.00, bubble_fraction=0.9),
    _row(2, 5.0, 1000.0, 0.2, 0.10, 1.25, bubble_fraction=0.25, val_loss=4.9, val_ppl=134.29),
    _row(3, 4.5, 3000.0, 0.6, 0.30, 1.50, bubble_fraction=0.3),
    _row(4, 4.75, 2000.0, 0.4, 0.20, 2.00, bubble_fraction=0.35, val_loss=4.25, val_ppl=70.11),
]


def test_durations_read_in_seconds_from_one_second_and_in_milliseconds_below():
    assert [seconds(value) for value in (2.345, 1.0, 0.9996, 0.0125)] == [
        "2.35 s",
        "1.00 s",
        "999.6 ms",
        "12.5 ms",
    ]


def test_the_summary_is_the_mean_after_the_first_step_with_the_planners_figures_beside():
    predicted = {"tokens_per_s": 2200.0, "step_time_s": 0.3, "mfu": 0.15, "peak_mem_gb": 1.5}
    text = summary_table(ROWS, {"run dir": "runs/x"}, predicted, first_save=3)
    assert text.splitlines()[1:-1] == [
        "steps             1 .. 4",
        "loss              5.5000 -> 4.7500 (min 4.5000)",
        "tokens/s          2,000 (mean after the first step); planner 2,200 (+10%)",
        "step time         400.0 ms; planner 0.300 s (-25%)",
        "MFU               20.00 %; planner 15.00% (-25%)",
        "peak memory       2.00 GB per rank (1.50 GB before the first checkpoint save); planner 1.50 GB (+0%)",
        "held-out loss     4.2500, perplexity 70.11, at step 4",
        "pipeline bubble   30.0 % (measured)",
        "run dir           runs/x",
    ]
    first, last = text.splitlines()[0], text.splitlines()[-1]
    assert (
        first
        == last
        == "-"
        * len(
            "peak memory       2.00 GB per rank (1.50 GB before the first checkpoint save); planner 1.50 GB (+0%)"
        )
    )


def test_a_lone_step_is_its_own_mean_and_no_planner_leaves_the_figures_alone():
    text = summary_table([_row(1, 5.5, 100.0, 2.0, 0.01, 1.0)], {})
    assert text.splitlines()[3:5] == [
        "tokens/s      100 (mean after the first step)",
        "step time     2.00 s",
    ]
    assert "planner" not in text and "held-out" not in text and "bubble" not in text
    assert summary_table([], {}) == "no steps run"


def test_mfus_peak_is_every_gpus_or_the_one_the_cpu_ranks_share():
    """The contract's MFU line: against the device's dense BF16 peak, every GPU's; on a CPU the measured
    peak of all its cores, which its ranks share."""
    assert mfu_peak(989e12, 8, "cuda") == 8 * 989e12
    assert mfu_peak(2e11, 4, "cpu") == 2e11
    assert mfu_peak(2e11, 1, "cpu") == 2e11
