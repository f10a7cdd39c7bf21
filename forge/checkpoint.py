"""Run checkpoints: the trainer's DCP state plus everything else a resumed run needs
(step, policy version, data position, replay buffer), under runs/<name>/checkpoints/."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from typing import Any

from forge.config import ConfigError


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def latest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint (one with its run_state.pt written last)."""
    done = by_step(p.parent for p in (Path(run_dir) / "checkpoints").glob("step_*/run_state.pt"))
    return done[-1] if done else None


def by_step(dirs: Any) -> list[Path]:
    """Checkpoint directories, oldest step first (by number: step_1000000 is after step_999999)."""
    # isdecimal, not isdigit: "²" is a digit that int() refuses
    return sorted(dirs, key=lambda d: int(d.name.removeprefix("step_")) if d.name[5:].isdecimal() else -1)


def set_aside(run_dir: str | Path) -> Path | None:
    """Before a new run in `run_dir`: an earlier run's checkpoints there move to
    checkpoints-earlier-N, kept, where neither this run's pruning (newest step names first) nor
    its crash recovery can take them for its own. Returns where they went."""
    found = Path(run_dir) / "checkpoints"
    if not any(found.glob("step_*")):
        return None
    # Past the highest N, not the count: a user may have deleted an earlier one, and a rename
    # onto a taken name fails (or replaces it, if empty).
    taken = [p.name.removeprefix("checkpoints-earlier-") for p in Path(run_dir).glob("checkpoints-earlier-*")]
    target = Path(run_dir) / f"checkpoints-earlier-{1 + max((int(n) for n in taken if n.isdecimal()), default=0)}"
    found.rename(target)
    return target


def partial_dir(run_dir: str | Path, step: int) -> Path:
    """Where checkpoint `step` is written until it is complete (`save_run_state` renames it):
    a crash or a second Ctrl-C meanwhile leaves no `step_*` directory behind."""
    path = Path(run_dir) / "checkpoints" / f".step_{step:06d}.partial"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def save_run_state(path: Path, state: dict[str, Any], keep: int = 2) -> Path:
    """Complete the checkpoint being written in `path` (a `partial_dir`, after the trainer's
    DCP files): write run_state.pt, rename the directory to its step's, and delete all but the
    newest `keep` checkpoints and any partial ones. Returns the checkpoint's directory."""
    import torch  # here, not at the top: the CLI imports this module, and `forge --help` stays fast

    try:
        torch.save(state, path / "run_state.pt")
    except Exception as e:  # a full disk: torch's message names no file
        shutil.rmtree(path, ignore_errors=True)  # the room it took, back; the checkpoints before stay
        raise OSError(f"checkpoint {path}: writing run_state.pt failed ({type(e).__name__}: {e})") from e
    final = step_dir(path.parent.parent, state["step"])
    if path != final:
        replaced = _unname(final)  # the same step saved again (a rewind, a Ctrl-C just after it)
        path.rename(final)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
    for old in by_step(final.parent.glob("step_*"))[:-keep]:
        shutil.rmtree(_unname(old) or old, ignore_errors=True)
    for old in final.parent.glob(".step_*.partial"):
        shutil.rmtree(old, ignore_errors=True)
    return final


def _unname(ckpt: Path) -> Path | None:
    """Move checkpoint `ckpt` to a partial name before it is deleted: a crash while deleting
    it leaves no `step_*` directory that holds its run_state.pt but not all of the rest.
    Returns where it went (None: there was none)."""
    if not ckpt.is_dir() or ckpt.is_symlink():
        return None
    hidden = ckpt.parent / f".{ckpt.name}.old.partial"
    if hidden.exists():  # left by an earlier crash
        shutil.rmtree(hidden, ignore_errors=True)
    ckpt.rename(hidden)
    return hidden


def load_run_state(path: Path) -> dict[str, Any]:
    """The run state of checkpoint `path`; a ConfigError naming it if it is not one (cut short
    by a crash or a full disk, crafted, or not a plain file)."""
    import torch  # on first use (see save_run_state)

    check_owned(path)
    file = Path(path) / "run_state.pt"
    if not stat.S_ISREG(file.lstat().st_mode):  # a pipe would block the open forever
        raise ConfigError(f"checkpoint {path}: {file} is not a regular file")
    try:
        # A pickle (the parts' states are Python objects): loading one runs what it says, hence check_owned.
        state = torch.load(file, weights_only=False)
    except Exception as e:
        raise ConfigError(f"checkpoint {path}: {file} cannot be read ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict) or type(state.get("step")) is not int or state["step"] < 0:
        raise ConfigError(f"checkpoint {path}: {file} is not a run state (a dict with an int 'step' >= 0)")
    return state


def check_owned(path: Path) -> None:
    """A checkpoint is loaded only if this user wrote it: every file and directory in it (and
    the directory it is in) owned by this user, none a link, none writable by every user (its
    run state and the trainer's DCP metadata are pickles: whoever can write one runs code as
    whoever loads it). Group-writable is allowed: a user's private group often is."""
    uid = os.geteuid()
    for entry in [Path(path).parent, Path(path), *Path(path).rglob("*")]:
        st = entry.lstat()
        link = stat.S_ISLNK(st.st_mode)
        if st.st_uid != uid or st.st_mode & stat.S_IWOTH or link:
            what = "a link" if link else f"owned by uid {st.st_uid}, mode {stat.filemode(st.st_mode)}"
            raise ConfigError(
                f"checkpoint {path}: {entry} is {what}; a checkpoint runs code when it loads, so forge "
                "loads only one this user wrote, in files not every user may change"
            )


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
