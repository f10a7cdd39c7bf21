"""Learning curves: runs' metrics.jsonl as series, saved side by side in one file, plotted, and
summed up in a table.

    forge curves runs/ppo_tiny_s1 runs/grpo_tiny200_s1 --out cmp.png           # a plot
    forge curves runs/ppo_tiny_s1 runs/grpo_tiny200_s1 --out docs/curves/x.json # the data
    forge curves runs/a runs/b --out x.json --table eval/accuracy 1   # its table: of evals, unsmoothed

A curves file is what the manual's figures are drawn from when the site is built (docs/hooks.py):
the series of each run, its title and command, and the date and machine that produced it.
"""

from __future__ import annotations

import datetime
import itertools
import json
import math
import os
import statistics
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch

from forge.metrics import read_rows

KEYS = ("reward_mean", "accuracy", "eval/accuracy")
THRESHOLDS = (0.8, 0.9)  # the table's "20-step mean first >= T" columns
WINDOW = 20  # steps in the mean the thresholds are checked on
LAST = 25  # steps in the table's "last steps" mean

Series = dict[str, list[float | None]]


def machine() -> str:
    """What a result was measured on: its cores, memory and accelerator (the manual shows it)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", no GPU"
    return f"{os.cpu_count()} CPU cores, {memory:.0f} GiB{gpu}"


def series(run_dir: str | Path, keys: Sequence[str] = KEYS) -> Series:
    """A run's curve: `step`, `wall_s` and each of `keys` its rows have (None on a row without it)."""
    rows = [r for r in read_rows(run_dir) if "step" in r]
    out: Series = {"step": [r["step"] for r in rows], "wall_s": _wall_s(rows, run_dir)}
    for key in keys:
        # A NaN or inf (a diverged step) is no point: it would spread through a curve's means.
        values = [r[key] if key in r and math.isfinite(r[key]) else None for r in rows]
        if any(v is not None for v in values):
            out[key] = [None if v is None else round(v, 4) for v in values]
    return out


def _wall_s(rows: Sequence[Mapping[str, Any]], run_dir: str | Path) -> list[float]:
    """Seconds since the start at each row: forge's `wall_s`, or the running sum of the
    tinker-cookbook's per-step `time/total` (its metrics.jsonl has no clock), so the cookbook's
    recipes run against `forge tinker` are drawn by the same code."""
    if all("wall_s" in r for r in rows):
        return [round(r["wall_s"], 2) for r in rows]
    if all("time/total" in r for r in rows):
        return [round(t, 2) for t in itertools.accumulate(r["time/total"] for r in rows)]
    raise ValueError(
        f"{run_dir}/metrics.jsonl: a row with neither wall_s (forge's) nor time/total (the tinker-cookbook's)"
    )


def load(run_dirs: Sequence[str | Path], keys: Sequence[str] = KEYS) -> dict[str, Series]:
    """The curves of `run_dirs`, named by their directories; ValueError names those without metrics."""
    runs = {Path(d).name: series(d, keys) for d in run_dirs}
    empty = [str(d) for d, s in zip(run_dirs, runs.values()) if not s["step"]]
    if empty:
        raise ValueError(f"no metrics in {', '.join(empty)}: a run directory holds metrics.jsonl")
    return runs


def save(out: str | Path, run_dirs: Sequence[str | Path], keys: Sequence[str] = KEYS, **about: Any) -> dict:
    """The curves of `run_dirs` as JSON at `out`, with `about` (title, command, the table's key
    and window) and when and where they were produced."""
    runs = load(run_dirs, keys)
    last = max((Path(d) / "metrics.jsonl").stat().st_mtime for d in run_dirs)  # when the runs ended
    produced = {"date": datetime.date.fromtimestamp(last).isoformat(), "machine": machine()}
    data = {**about, "keys": list(keys), "produced": produced, "runs": runs}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(data) + "\n")
    return data


def _moving_mean(values: Sequence[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def _points(s: Series, x: str, key: str) -> tuple[list[float], list[float]]:
    pts = [(a, b) for a, b in zip(s[x], s.get(key, ())) if b is not None]
    return ([a for a, _ in pts], [b for _, b in pts]) if pts else ([], [])


def plot(runs: Mapping[str, Series], out: str | Path | BinaryIO, title: str = "", keys: Sequence[str] = KEYS) -> None:
    """`keys` of every run vs step and vs wall time, each with its moving mean, as a PNG to `out`."""
    import matplotlib  # only where a plot is drawn: it costs ~0.5 s to import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    lines = [
        (name, key, n if len(runs) > 1 else k)
        for n, (name, s) in enumerate(runs.items())
        for k, key in enumerate(keys)
        if key in s
    ]
    for ax, x in zip(axes, ("step", "wall_s")):
        for name, key, color in lines:  # a colour per run (per key for one run), a line style per key
            xs, ys = _points(runs[name], x, key)
            if not ys:
                continue
            ax.plot(xs, ys, alpha=0.25, linewidth=0.8, color=f"C{color}")
            w = max(1, len(ys) // 15)  # shows the trend through per-batch noise
            label = key if len(runs) == 1 else f"{name}: {key}" if len(keys) > 1 else name
            style = ("-", "--", ":")[keys.index(key) % 3]
            ax.plot(xs, _moving_mean(ys, w), style, color=f"C{color}", label=f"{label} (mean of {w})")
        ax.set_xlabel("step" if x == "step" else "wall time (s)")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower right", fontsize="small")
    fig.suptitle(textwrap.fill(title, 100))  # one line holds ~100 characters at this width
    fig.tight_layout()
    fig.savefig(out, dpi=100, format="png")
    plt.close(fig)


def plot_run(run_dir: str | Path, keys: Sequence[str] = KEYS) -> Path:
    """runs/<name>/reward.png: the run's `keys` vs step and vs wall time."""
    run_dir = Path(run_dir)
    plot({run_dir.name: series(run_dir, keys)}, run_dir / "reward.png", run_dir.name, keys)
    return run_dir / "reward.png"


def summary(s: Series, key: str = "reward_mean", window: int = WINDOW) -> dict[str, Any]:
    """One run's row of a figure's table: its steps, `key` over its first 3 values, the step
    (and seconds of training) at which the mean of `window` values first reaches each threshold,
    `key` over its last values (LAST steps, or the later half of a key logged now and then, as
    evals are) and the median seconds per step."""
    steps, ys = _points(s, "step", key)
    walls, _ = _points(s, "wall_s", key)  # each point's own row's: an eval's is written after its step's
    # per step when logged at (nearly) every step: an eval's rows (one per eval, at step 0 too) lack it
    unit = "step" if len(set(steps)) >= len(set(s["step"]) - {0}) - 1 else "eval"
    means = _moving_mean(ys, window)
    row: dict[str, Any] = {"steps": int(max(s["step"])), f"first 3 {unit}s": statistics.fmean(ys[:3])}
    for t in THRESHOLDS:
        at = next((i for i, m in enumerate(means) if i + 1 >= window and m >= t), None)
        name = f"{window}-{unit} mean >= {t}" if window > 1 else f"first {unit} >= {t}"
        row[name] = "not reached" if at is None else f"step {int(steps[at])} ({walls[at]:.0f} s)"
    last = LAST if unit == "step" else max(1, len(ys) // 2)
    row[f"last {last} {unit}s"] = statistics.fmean(ys[-last:])
    started: dict[float, float] = {}  # each step's first row: its training row, not an eval of it written later
    for step, wall in zip(s["step"], s["wall_s"]):
        started.setdefault(step, wall)
    firsts = list(started.values())
    gaps = [b - a for a, b in zip(firsts, firsts[1:])]
    row["median s / step"] = statistics.median(gaps) if gaps else float("nan")
    return row


def table(runs: Mapping[str, Series], key: str = "reward_mean", window: int = WINDOW) -> list[str]:
    """The runs' summaries (`summary`) as a Markdown table, a row per run."""
    rows = {name: summary(s, key, window) for name, s in runs.items() if key in s}
    if not rows:
        return []
    columns = list(next(iter(rows.values())))
    out = [f"| run ({key}) | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, row in rows.items():
        cells = [f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()]
        out.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return out
