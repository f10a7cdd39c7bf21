"""The run skeleton both apps share (forge/run.py), on a fake trainer: its checkpoints, resume,
Ctrl-C, the last eval and export, and a service failure turned into RunStopped."""

import asyncio
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from forge import checkpoint
from forge.checkpoint import RunStopped
from forge.run import Run
from forge.service import ServiceError


class Endpoint:
    def __init__(self, fn):
        self.fn = fn

    async def route(self, *args):
        return self.fn(*args)

    fanout = route


class FakeTrainer:
    """A trainer whose state is its policy version, saved to and loaded from a checkpoint."""

    def __init__(self):
        self.version, self.exported, self.restore_point = 0, None, None
        self.policy_version = Endpoint(lambda: self.version)
        self.push_weights = Endpoint(self.push)
        self.save = Endpoint(lambda path: _write(path, {"version": self.version}))
        self.load = Endpoint(lambda path: setattr(self, "version", json.load(open(f"{path}/state.json"))["version"]))
        self.export_hf = Endpoint(lambda path: setattr(self, "exported", path))

    def push(self) -> int:
        return self.version

    def set_restore_point(self, point):
        self.restore_point = point


class FakeWeights:
    """The run's WeightSync: a push publishes the trainer's version."""

    def __init__(self, trainer):
        self.trainer, self.published = trainer, 0

    async def push(self):
        self.published = self.trainer.version
        return self.published

    def publish(self, version):
        self.published = version


def _write(path, state):
    os.makedirs(path, exist_ok=True)
    with open(f"{path}/state.json", "w") as f:
        json.dump(state, f)


class FakeEvals:
    def __init__(self):
        self.evaluated, self.accuracy = [], float("nan")

    async def run(self, step, version):
        self.evaluated.append((step, version))

    def start(self, step, version):
        self.evaluated.append((step, version))

    async def wait(self):
        pass

    async def cancel(self):
        pass


class Counter:
    """A data position: a checkpoint part."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


@dataclass
class EvalKeys:
    every: int = 0
    before_train: bool = False


@dataclass
class Config:
    """The keys every app's config has."""

    run_dir: Path
    steps: int = 5
    checkpoint_every: int = 2
    eval: EvalKeys = field(default_factory=EvalKeys)
    metrics: list = field(default_factory=lambda: ["jsonl"])


def config(tmp_path, **eval_keys):
    return Config(tmp_path / "run", eval=EvalKeys(**eval_keys))


async def train(cfg, stop_at=None, fail_at=None, resume_from=None):
    trainer, evals, data = FakeTrainer(), FakeEvals(), Counter()
    run = Run("test", cfg, resume_from)
    await run.start(trainer, FakeWeights(trainer), evals, data=data)
    async with run:
        while run.step < cfg.steps:
            if run.step == stop_at:
                raise KeyboardInterrupt
            if run.step == fail_at:
                raise ServiceError("no healthy replica of Trainer")
            data.n += 10
            trainer.version += 1
            await run.end_step(trainer.version)
        await run.finish()
    return run, trainer, evals, data


def test_checkpoints_resume_and_the_end_of_a_run(tmp_path):
    cfg = config(tmp_path, every=3, before_train=True)
    run, trainer, evals, data = asyncio.run(train(cfg))
    steps = sorted(p.name for p in (cfg.run_dir / "checkpoints").iterdir())
    assert steps == ["step_000004", "step_000005"]  # every 2 steps and the last; the newest 2 kept
    assert evals.evaluated == [(0, 0), (3, 3), (5, 5)]  # before training, every 3 steps and the last
    assert trainer.exported == str(cfg.run_dir / "model") and run.finished
    rows = [json.loads(line)["step"] for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows == [1, 2, 3, 4, 5]

    last = checkpoint.latest(cfg.run_dir)
    assert checkpoint.load_run_state(last) == {"step": 5, "version": 5, "data": {"n": 50}}
    cfg.steps = 7
    run, trainer, evals, data = asyncio.run(train(cfg, resume_from=checkpoint.step_dir(cfg.run_dir, 4)))
    assert data.n == 70 and trainer.version == 7 and evals.evaluated[0] == (6, 6)  # from step 4, not before it
    rows = [json.loads(line)["step"] for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows == [1, 2, 3, 4, 5, 6, 7]  # step 5's first row dropped, written again


def test_ctrl_c_saves_the_step_it_reached(tmp_path, capsys):
    cfg = config(tmp_path)
    run, trainer, _, data = asyncio.run(train(cfg, stop_at=3))
    assert "interrupted at step 3; saving a checkpoint" in capsys.readouterr().out
    assert checkpoint.load_run_state(checkpoint.latest(cfg.run_dir)) == {"step": 3, "version": 3, "data": {"n": 30}}
    assert trainer.exported is None and not run.finished


def test_a_service_that_cannot_go_on_stops_the_run_naming_its_checkpoint(tmp_path):
    cfg = config(tmp_path)
    with pytest.raises(
        RunStopped,
        match=r"stopped at step 3: no healthy replica of Trainer\. Resume it from its "
        r"checkpoint of step 2: forge run --resume",
    ):
        asyncio.run(train(cfg, fail_at=3))
