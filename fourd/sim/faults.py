"""Monte-Carlo of a long training run on N GPUs: interruptions (Llama 3 Table 5's rates, unexpected
ones scaled with the GPUs), checkpoints, restarts and lost work, vectorised over runs
(docs/simulators.md)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fourd.errors import FourdError

# Llama 3 Table 5 (Dubey et al. 2024 §3.3.4): unexpected interruptions in 54 days on 16,384 GPUs per
# component, and whether it is hardware (the paper's "~78 % hardware").
TABLE5 = {
    "faulty GPU": (148, True),
    "GPU HBM3 memory": (72, True),
    "software bug": (54, False),
    "network switch/cable": (35, True),
    "host maintenance": (32, False),
    "GPU SRAM memory": (19, True),
    "GPU system processor": (17, True),
    "NIC": (7, True),
    "NCCL watchdog timeouts": (7, False),
    "silent data corruption": (6, True),
    "GPU thermal interface + sensor": (6, True),
    "SSD": (3, True),
    "power supply": (3, True),
    "server chassis": (2, True),
    "IO expansion board": (2, True),
    "dependency": (2, False),
    "CPU": (2, True),
    "system memory": (2, True),
}
TABLE5_GPUS = 16_384  # GPUs of the 54-day snapshot (Llama 3 §3.3.4)
TABLE5_DAYS = 54
TABLE5_PLANNED = 47  # planned interruptions in those 54 days (Llama 3 §3.3.4)

# assumed save and restart times in seconds (docs/simulators.md: Llama 3 §3.3.1)
CHECKPOINT_S = 10.0
RESTART_S = 300.0
# peak NumPy memory of `simulate` per run and slot: 111 B measured (tracemalloc), and a margin
BYTES_PER_SLOT = 160
MEMINFO = Path("/proc/meminfo")  # the kernel's memory counters (Linux)
DAY_S = 86_400.0


def unexpected_per_day(gpus: int) -> dict[str, float]:
    """Expected unexpected interruptions per day on `gpus` GPUs, per component: its count in Table
    5 / 54 days × gpus / 16,384 (Llama 3 §3.3.4; the rates scale with the GPUs)."""
    return {
        component: count / TABLE5_DAYS * gpus / TABLE5_GPUS
        for component, (count, _) in TABLE5.items()
    }


def planned_per_day() -> float:
    return TABLE5_PLANNED / TABLE5_DAYS


def mtbf_s(gpus: int) -> float:
    """Mean time between unexpected interruptions of the job in seconds, one day / the expected
    interruptions per day (16,384 GPUs: 3.1 h)."""
    return DAY_S / sum(unexpected_per_day(gpus).values())


def young_interval(checkpoint_s: float, mtbf: float) -> float:
    """τ = √(2δM) (Young 1974)."""
    return math.sqrt(2 * checkpoint_s * mtbf)


def daly_interval(checkpoint_s: float, mtbf: float) -> float:
    """τ = √(2δM)·[1 + ⅓√(δ/2M) + (δ/2M)/9] − δ for δ < 2M, else M (Daly 2006, eq. 37); δ the
    checkpoint save time, M the MTBF, both in seconds."""
    if checkpoint_s >= 2 * mtbf:
        return mtbf
    x = checkpoint_s / (2 * mtbf)
    return math.sqrt(2 * checkpoint_s * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - checkpoint_s


@dataclass(frozen=True, kw_only=True)
class FaultResult:
    gpus: int
    days: float
    runs: int
    interval_s: float
    checkpoint_s: float
    restart_s: float
    unexpected: np.ndarray  # per run
    planned: np.ndarray
    by_component: dict[str, float]  # mean per run
    useful_s: np.ndarray  # training time kept, per run
    lost_s: np.ndarray  # work redone after unexpected interruptions
    restart_total_s: np.ndarray
    checkpoint_total_s: np.ndarray

    @property
    def effective(self) -> np.ndarray:
        return self.useful_s / (self.days * DAY_S)


def _check_size(runs: int, slots: int, meminfo: Path = MEMINFO) -> None:
    """Refuse a simulation whose arrays would not fit in half the memory this machine can give
    now: MemAvailable of `meminfo`, or all of its physical memory where that file does not say."""
    try:
        lines = meminfo.read_text().splitlines()
        free = next(
            int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:")
        )
    except (OSError, StopIteration):
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    need = runs * slots * BYTES_PER_SLOT
    limit = free // 2
    if need > limit:
        raise FourdError(
            f"{runs:,} runs of {slots:,} interruption slots each need about {need / 2**30:,.1f} "
            f"GiB, more than the {limit / 2**30:,.1f} GiB this machine can give: use "
            "fewer runs or fewer days"
        )


def _check_inputs(
    gpus: int,
    days: float,
    runs: int,
    interval_s: float | None,
    checkpoint_s: float,
    restart_s: float,
) -> None:
    """Refuse (one line) a count or time that is not finite, or not positive (checkpoint and
    restart times may be 0)."""
    positive = [gpus, runs, days]
    if interval_s is not None:
        positive.append(interval_s)
    finite = math.isfinite(sum(positive) + checkpoint_s + restart_s)
    if not (finite and min(positive) > 0 and min(checkpoint_s, restart_s) >= 0):
        raise FourdError(
            f"{gpus} GPUs, {days} days, {runs} runs, checkpoint interval {interval_s} s, "
            f"checkpoint {checkpoint_s} s, restart {restart_s} s: each must be finite, and "
            "positive (the last two may be 0)"
        )


def _by_component(rng, rates: dict[str, float], total_unexpected: int, runs: int) -> dict:
    """The mean unexpected interruptions per run by component: all runs' interruptions drawn
    into components in proportion to their rates (one multinomial draw)."""
    names = list(rates)
    probs = np.array([rates[name] for name in names]) / sum(rates.values())
    counts = np.zeros(len(names), dtype=int)
    if total_unexpected:
        counts = rng.multinomial(total_unexpected, probs)
    return {name: counts[i] / runs for i, name in enumerate(names)}


def simulate(
    gpus: int,
    days: float,
    runs: int = 1000,
    seed: int = 0,
    interval_s: float | None = None,
    checkpoint_s: float = CHECKPOINT_S,
    restart_s: float = RESTART_S,
) -> FaultResult:
    """`runs` independent runs of `days` days; the checkpoint interval defaults to Daly's
    optimum."""
    _check_inputs(gpus, days, runs, interval_s, checkpoint_s, restart_s)
    tau = interval_s
    if tau is None:
        tau = daly_interval(checkpoint_s, mtbf_s(gpus))
    rates = unexpected_per_day(gpus)
    lam_p = planned_per_day() / DAY_S  # planned interruptions per second
    horizon = days * DAY_S
    lam = sum(rates.values()) / DAY_S + lam_p  # all interruptions per second
    # enough arrival slots that running out has probability ~1e-15 (mean + 8 sigma)
    mean = lam * horizon
    slots = int(mean + 8 * math.sqrt(mean) + 16)
    _check_size(runs, slots)
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / lam, size=(runs, slots)), axis=1)
    happened = arrivals < horizon
    planned = (rng.random((runs, slots)) < lam_p / lam) & happened
    unexpected = happened & ~planned
    useful, lost, downtime, ckpt, live = _spans(
        arrivals, happened, planned, horizon, (tau, checkpoint_s, restart_s)
    )
    n_unexpected = unexpected.sum(axis=1)

    def per_run(x):
        return np.where(live, x, 0.0).sum(axis=1)

    return FaultResult(
        gpus=gpus,
        days=days,
        runs=runs,
        interval_s=tau,
        checkpoint_s=checkpoint_s,
        restart_s=restart_s,
        unexpected=n_unexpected,
        planned=planned.sum(axis=1),
        by_component=_by_component(rng, rates, int(n_unexpected.sum()), runs),
        useful_s=per_run(useful),
        lost_s=per_run(lost),
        restart_total_s=per_run(downtime),
        checkpoint_total_s=per_run(ckpt),
    )


def _spans(arrivals, happened, planned, horizon: float, times: tuple[float, float, float]):
    """(useful, lost, downtime, checkpointing, live) per gap between interruptions; each gap runs
    from one restart to the next interruption (the last one to the horizon)."""
    tau, checkpoint_s, restart_s = times
    starts = np.concatenate([np.zeros((arrivals.shape[0], 1)), arrivals[:, :-1]], axis=1)
    live = starts < horizon
    span = np.where(live, np.where(happened, arrivals, horizon) - starts, 0.0)
    # What the previous interruption costs before training resumes: nothing at the start; a planned
    # stop saves first. An interruption during a restart starts it over.
    pause = np.full(arrivals.shape, restart_s)
    pause[:, 0] = 0.0
    pause[:, 1:] += np.where(planned[:, :-1], checkpoint_s, 0.0)
    downtime = np.minimum(span, pause)
    cycles = np.floor((span - downtime) / (tau + checkpoint_s))
    rest = span - downtime - cycles * (tau + checkpoint_s)
    # Interrupted by a planned stop or by the end of the horizon: the partial interval is saved.
    useful = cycles * tau + np.where(planned | ~happened, np.minimum(rest, tau), 0.0)
    lost = np.where(happened & ~planned, np.minimum(rest, tau), 0.0)
    return useful, lost, downtime, cycles * checkpoint_s + np.maximum(rest - tau, 0.0), live


def summary(result: FaultResult) -> dict:
    """The `fourd sim faults --json` object: means over runs (the headline keys first)."""
    mtbf = mtbf_s(result.gpus)
    eff = result.effective
    comp = result.by_component
    hardware = sum(count for name, count in comp.items() if TABLE5[name][1])
    total = sum(comp.values())
    hardware_share = 0.0
    if total:
        hardware_share = hardware / total
    return {
        "unexpected_interruptions": float(result.unexpected.mean()),
        "planned_interruptions": float(result.planned.mean()),
        "effective_training_fraction": float(eff.mean()),
        "checkpoint_interval_min": result.interval_s / 60,
        "optimal_checkpoint_interval_min": daly_interval(result.checkpoint_s, mtbf) / 60,
        "young_interval_min": young_interval(result.checkpoint_s, mtbf) / 60,
        "mtbf_h": mtbf / 3600,
        **{
            f"effective_training_fraction_p{percent}": float(np.percentile(eff, percent))
            for percent in (5, 95)
        },
        "gpus": result.gpus,
        "days": result.days,
        "runs": result.runs,
        "checkpoint_save_s": result.checkpoint_s,
        "restart_s": result.restart_s,
        "lost_work_h": float(result.lost_s.mean()) / 3600,
        "restart_h": float(result.restart_total_s.mean()) / 3600,
        "checkpointing_h": float(result.checkpoint_total_s.mean()) / 3600,
        "hardware_share": hardware_share,
        "components": comp,
    }
