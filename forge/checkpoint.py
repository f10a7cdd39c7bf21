"""Run checkpoints: the trainer's DCP state plus everything else a resumed run needs
(step, policy version, data position, replay buffer), under runs/<name>/checkpoints/."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def latest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint (one with its run_state.pt written last)."""
    done = sorted((Path(run_dir) / "checkpoints").glob("step_*/run_state.pt"))
    return done[-1].parent if done else None


def save_run_state(path: Path, state: dict[str, Any], keep: int = 2) -> None:
    """Write run_state.pt (after the trainer's DCP files: it marks the checkpoint complete)
    and delete all but the newest `keep` checkpoints."""
    tmp = path / "run_state.pt.tmp"
    torch.save(state, tmp)
    tmp.rename(path / "run_state.pt")
    for old in sorted(path.parent.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def load_run_state(path: Path) -> dict[str, Any]:
    return torch.load(path / "run_state.pt", weights_only=False)


class RunStopped(RuntimeError):
    """The run cannot go on. The message says why, and how to resume if a checkpoint exists."""

    def __init__(self, run_dir: str | Path, step: int, why: str):
        last = latest(run_dir)
        hint = (
            f"Resume it from its checkpoint of step {load_run_state(last)['step']}: forge run --resume {run_dir}"
            if last is not None
            else "It saved no checkpoint to resume from (config key 'checkpoint_every')."
        )
        super().__init__(f"the run stopped at step {step}: {why}. {hint}")
