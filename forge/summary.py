"""The end-of-run summary: what a run did and what it left, read from its directory.

print(summary(run_dir, ("reward_mean", "accuracy")))
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from forge import checkpoint
from forge.metrics import read_rows
from forge.schema import ADAPTER_CONFIG

# Counted over the run (each row holds its step's count): what went wrong and was recovered from.
FAILURES = (
    "trainer_restores",
    "service/respawns",
    "reward_failures",
    "rollout_errors",
    "groups_masked",
    "groups_dropped",
    "groups_nonfinite",
    "service/respawn_failures",
)


def _duration(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes}m{s:02d}s" if minutes else f"{s}s"


def _trend(rows: list[dict[str, float]], key: str) -> str | None:
    """`key` over the first and the last steps (a tenth of the run each, 1-10 steps)."""
    values = [r[key] for r in rows if key in r and math.isfinite(r[key])]
    if not values:
        return None
    n = min(10, max(1, len(values) // 10))
    first, last = sum(values[:n]) / n, sum(values[-n:]) / n
    return f"{key} {first:.3f} -> {last:.3f} (mean of the first and last {n} steps)"


def _evals(rows: list[dict[str, float]]) -> str | None:
    evals = [(r["eval/accuracy"], r["step"]) for r in rows if "eval/accuracy" in r]
    if not evals:
        return None
    best = max(evals, key=lambda e: (e[0], -e[1]))
    return f"eval/accuracy best {best[0]:.3f} (step {best[1]}), last {evals[-1][0]:.3f} (step {evals[-1][1]})"


def failures(row: dict[str, float]) -> dict[str, float]:
    """The failures a metrics row counts (its step's), by key."""
    return {k: v for k, v in row.items() if (k in FAILURES or k.endswith("_errors")) and v}


def _failures(rows: list[dict[str, float]]) -> str:
    counted = sum((Counter(failures(r)) for r in rows), Counter())
    order = sorted(counted, key=lambda k: (FAILURES.index(k) if k in FAILURES else len(FAILURES), k))
    return "failures: " + (", ".join(f"{k} {counted[k]:g}" for k in order) if counted else "none")


def summary(run_dir: str | Path, keys: tuple[str, ...]) -> str:
    """What the run in `run_dir` did (steps, wall time, `keys` first -> last, evals, failures) and
    where its checkpoint, model and plots are, with the commands that serve and evaluate it."""
    run_dir = Path(run_dir)
    rows = [r for r in read_rows(run_dir) if "step" in r]
    # The last row may be an earlier step's (an eval beside the loop ends after later steps).
    steps, wall = (max(r["step"] for r in rows), max(r["wall_s"] for r in rows)) if rows else (0, 0.0)
    lines = [f"{run_dir.name}: {steps:g} steps in {_duration(wall)}"]
    lines += [line for line in (*(_trend(rows, k) for k in keys), _evals(rows)) if line]
    lines.append(_failures(rows))
    last = checkpoint.latest(run_dir)
    model = run_dir / "model"
    kind = "a LoRA adapter, PEFT format" if (model / ADAPTER_CONFIG).exists() else "HF format"
    where = [
        ("checkpoint", str(last) if last else "none"),
        ("model", f"{model} ({kind})" if model.exists() else "none"),
        ("plots", f"{run_dir / 'reward.png'}; tensorboard --logdir {run_dir / 'tb'}"),
        ("serve", f"forge serve {run_dir}"),
        ("evaluate", f"forge eval {run_dir / 'config.yaml'} --model {run_dir}"),
    ]
    return "\n".join([lines[0], *(f"  {line}" for line in lines[1:]), *(f"  {k:<10} {v}" for k, v in where)])
