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
from forge.metrics import Reduce, record_metric
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


def test_a_finished_run_prints_its_summary(tmp_path, capsys):
    """Steps and wall time, the bar's figures first -> last, the best and last eval, failures
    counted, where the checkpoint, model and plots are, and how to serve and evaluate it."""
    cfg = config(tmp_path)
    cfg.steps = 20

    async def main():
        trainer = FakeTrainer()
        run = Run("test", cfg, show={"reward": ("reward_mean", ".3f")})
        await run.start(trainer, FakeWeights(trainer), FakeEvals())
        async with run:
            while run.step < cfg.steps:
                record_metric("reward_mean", run.step / 20)
                if run.step in (3, 7):
                    record_metric("rollout_errors", 1, Reduce.SUM)
                trainer.version += 1
                await run.end_step(trainer.version)
                if run.step % 10 == 0:
                    run.writer.write(run.step, {"eval/accuracy": 0.3 if run.step == 10 else 0.2})
            await run.finish()
        return run

    run = asyncio.run(main())
    lines = capsys.readouterr().out.splitlines()
    at = lines.index(next(line for line in lines if line.startswith("run: 20 steps in ")))
    d = cfg.run_dir
    assert lines[at + 1 :] == [
        "  reward_mean 0.025 -> 0.925 (mean of the first and last 2 steps)",
        "  eval/accuracy best 0.300 (step 10), last 0.200 (step 20)",
        "  failures: rollout_errors 2",
        f"  checkpoint {d}/checkpoints/step_000020",
        "  model      none",
        f"  plots      {d}/reward.png; tensorboard --logdir {d}/tb",
        f"  serve      forge serve {d}",
        f"  evaluate   forge eval {d}/config.yaml --model {d}",
    ]
    assert run.finished


def test_ctrl_c_saves_the_step_it_reached(tmp_path, capsys):
    cfg = config(tmp_path)
    run, trainer, _, data = asyncio.run(train(cfg, stop_at=3))
    out = capsys.readouterr().out
    assert "interrupted at step 3; saving a checkpoint" in out and "steps in" not in out  # no summary: unfinished
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


def test_a_new_run_sets_an_earlier_runs_checkpoints_aside(tmp_path, capsys):
    """A new run under an earlier run's name kept its checkpoints beside its own: pruning (newest
    step names first) deleted the new run's and crash recovery then found none (a run of 300
    steps, then a new one, lost its step 200 this way). They now move aside, kept."""
    cfg = config(tmp_path)
    asyncio.run(train(cfg))
    cfg.steps = 3
    asyncio.run(train(cfg))
    assert sorted(p.name for p in (cfg.run_dir / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    assert sorted(p.name for p in (cfg.run_dir / "checkpoints-earlier-1").iterdir()) == ["step_000004", "step_000005"]
    assert "moved them to" in capsys.readouterr().out
    asyncio.run(train(cfg, resume_from=checkpoint.step_dir(cfg.run_dir, 2)))  # a resumed run sets nothing aside
    assert not (cfg.run_dir / "checkpoints-earlier-2").exists()
