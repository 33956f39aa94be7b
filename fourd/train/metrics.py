"""Per-step metrics: MFU against the device's peak, memory, and where they go (metrics.jsonl,
TensorBoard, a progress bar or plain lines, and a closing summary)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path


class MetricsWriter:
    """Rank 0's outputs. metrics.jsonl is flushed every step so a crash loses nothing already
    logged."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.path, self.rows = run_dir / "metrics.jsonl", list[dict]()
        if self.path.exists():  # a resumed run rewrites the steps after its checkpoint
            kept = []
            for line in self.path.read_text().splitlines():
                with contextlib.suppress(ValueError):  # a line a crash cut short is dropped
                    kept += [line] if json.loads(line)["step"] <= start_step else []
            self.path.with_suffix(".tmp").write_text("".join(line + "\n" for line in kept))
            os.replace(self.path.with_suffix(".tmp"), self.path)
        self.file, self.tb = open(self.path, "a"), SummaryWriter(str(run_dir / "tensorboard"))
        self.bar = None
        if sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def log(self, row: dict, show: bool) -> None:
        self.rows.append(row)
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        for key, value in row.items():
            if key.startswith("val_"):  # held-out figures under val/, the rest under train/
                self.tb.add_scalar(f"val/{key[4:]}", value, row["step"])
            elif key != "step":
                self.tb.add_scalar(f"train/{key}", value, row["step"])
        text = (
            f"loss {row['loss']:.4f}  lr {row['lr']:.2e}  grad {row['grad_norm']:.3f}  "
            f"{row['tokens_per_s']:,.0f} tok/s  mfu {100 * row['mfu']:.1f}%"
        )
        if "val_loss" in row:
            text += f"  held-out {row['val_loss']:.4f}"
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        elif show:
            print(f"step {row['step']:>5}  {text}  {seconds(row['step_time_s'])}", flush=True)

    def close(self) -> None:
        for closing in (self.bar, self.tb, self.file):
            if closing is not None:
                closing.close()


def mfu_peak(peak_flops: float, ranks: int, device_type: str) -> float:
    """MFU's denominator, FLOP/s: every GPU's peak (`peak_flops` each); on a CPU the one peak of the
    cores all ranks share (`fourd calibrate` measures it with every core busy)."""
    if device_type == "cuda":
        return peak_flops * ranks
    return peak_flops


def seconds(duration_s: float) -> str:
    """A duration as people read it: seconds from 1 s, milliseconds below."""
    if duration_s >= 1:
        return f"{duration_s:.2f} s"
    return f"{duration_s * 1e3:.1f} ms"


def summary_table(
    rows: list[dict],
    extra: dict[str, str],
    predicted: dict | None = None,
    first_save: int | None = None,
) -> str:
    """The closing summary; `predicted` (fourd.train.auto.predict) puts the planner's figures beside
    the measured, each with its error (predicted - measured) / measured. The planner's peak memory
    is training's, so it is set beside the peak before `first_save`, the step after which a
    checkpoint was first saved (a save holds memory of its own: 0.19 GB a rank at `make run`)."""
    if not rows:
        return "no steps run"
    items = _measured_items(rows, predicted, first_save)
    if predicted and "note" in predicted:
        items.append(("planner", predicted["note"]))
    evaluated = [row for row in rows if "val_loss" in row]
    if evaluated:
        last = evaluated[-1]
        held_out = (
            f"{last['val_loss']:.4f}, perplexity {last['val_ppl']:.2f}, at step {last['step']}"
        )
        items.append(("held-out loss", held_out))
    if "bubble_fraction" in rows[-1]:
        bubble = _mean_after_warmup(rows, "bubble_fraction")
        items.append(("pipeline bubble", f"{100 * bubble:.1f} % (measured)"))
    items += list(extra.items())
    width = max(len(name) for name, _ in items)
    line = "-" * (width + 3 + max(len(value) for _, value in items))
    return "\n".join([line] + [f"{name:<{width}}   {value}" for name, value in items] + [line])


def _mean_after_warmup(rows: list[dict], key: str) -> float:
    """The mean of `key` over the steps after the first (it pays for warm-up), or of a lone step."""
    timed = rows[1:] or rows
    return sum(row[key] for row in timed) / len(timed)


def _measured_items(
    rows: list[dict], predicted: dict | None, first_save: int | None
) -> list[tuple[str, str]]:
    """The rows steps, loss, tokens/s, step time, MFU and peak memory, with the planner's beside."""
    got = {key: _mean_after_warmup(rows, key) for key in ("tokens_per_s", "step_time_s", "mfu")}
    peak_gb = max(row["peak_mem_gb"] for row in rows)
    training = [row for row in rows if first_save is None or row["step"] <= first_save]
    got["peak_mem_gb"] = max(row["peak_mem_gb"] for row in training)
    memory = f"{peak_gb:.2f} GB per rank"
    if got["peak_mem_gb"] < peak_gb:
        memory += f" ({got['peak_mem_gb']:.2f} GB before the first checkpoint save)"
    planned = predicted or {}
    losses = f"{rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}"
    lowest_loss = min(row["loss"] for row in rows)
    throughput = f"{got['tokens_per_s']:,.0f} (mean after the first step)"
    return [
        ("steps", f"{rows[0]['step']} .. {rows[-1]['step']}"),
        ("loss", f"{losses} (min {lowest_loss:.4f})"),
        ("tokens/s", throughput + _planner_beside(planned, got, "tokens_per_s", "{:,.0f}")),
        (
            "step time",
            seconds(got["step_time_s"]) + _planner_beside(planned, got, "step_time_s", "{:.3f} s"),
        ),
        ("MFU", f"{100 * got['mfu']:.2f} %" + _planner_beside(planned, got, "mfu", "{:.2%}")),
        ("peak memory", memory + _planner_beside(planned, got, "peak_mem_gb", "{:.2f} GB")),
    ]


def _planner_beside(planned: dict, got: dict[str, float], key: str, form: str) -> str:
    """The planner's figure for `key` and its error (predicted - measured) / measured, or ''."""
    planner_figure = planned.get(key)
    measured = got[key]
    if planner_figure is None:
        return ""
    error = (planner_figure - measured) / measured
    return f"; planner {form.format(planner_figure)} ({error:+.0%})"
