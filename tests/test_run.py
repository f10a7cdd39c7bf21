"""The run skeleton both apps share (forge/run.py), on a fake trainer: its checkpoints, resume,
Ctrl-C, the last eval and export, and a service failure turned into RunStopped."""

import asyncio
import importlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from forge import checkpoint, cli
from forge.checkpoint import RunStopped
from forge.config import ConfigError
from forge.metrics import Reduce, read_rows, record_metric
from forge.run import Run
from forge.schema import RunConfig
from forge.service import ReplicaRestored, ServiceError

ROOT = Path(__file__).resolve().parent.parent


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


class RowEvals(FakeEvals):
    """Evals that write their row at the step they evaluated, as services/evals.py does; those
    of the steps in `cut` never end (the run stops before they do)."""

    def __init__(self, writer, cut=()):
        super().__init__()
        self.writer, self.cut = writer, cut

    async def run(self, step, version):
        await super().run(step, version)
        if step not in self.cut:
            self.writer.write(step, {"eval/accuracy": 0.5})

    def start(self, step, version):
        self.evaluated.append((step, version))
        if step not in self.cut:
            self.writer.write(step, {"eval/accuracy": 0.5})


async def train(cfg, stop_at=None, fail_at=None, resume_from=None, cut=None):
    trainer, evals, data = FakeTrainer(), FakeEvals(), Counter()
    run = Run("test", cfg, resume_from)
    if cut is not None:
        evals = RowEvals(run.writer, cut)
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
    assert checkpoint.load_run_state(last) == {"step": 5, "version": 5, "data": {"n": 50}, "app": "test"}
    cfg.steps = 7
    run, trainer, evals, data = asyncio.run(train(cfg, resume_from=checkpoint.step_dir(cfg.run_dir, 4)))
    assert data.n == 70 and trainer.version == 7 and evals.evaluated[0] == (6, 6)  # from step 4, not before it
    rows = [json.loads(line)["step"] for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows == [1, 2, 3, 4, 5, 6, 7]  # step 5's first row dropped, written again


def _eval_rows(run_dir):
    return [r["step"] for r in read_rows(run_dir) if "eval/accuracy" in r]


def test_resuming_a_finished_run_evaluates_its_last_step_once(tmp_path):
    cfg = config(tmp_path, every=3)
    asyncio.run(train(cfg, cut=()))
    assert _eval_rows(cfg.run_dir) == [3, 5]
    _, _, evals, _ = asyncio.run(train(cfg, resume_from=checkpoint.latest(cfg.run_dir), cut=()))
    assert evals.evaluated == [] and _eval_rows(cfg.run_dir) == [3, 5]


def test_an_eval_the_stop_cut_short_runs_when_its_checkpoint_resumes(tmp_path):
    """Step 2's checkpoint saved, its eval begun beside the loop; the run stops before the eval
    ends. Resumed from step 2 (the same weights), the eval of step 2 runs: else it never does."""
    cfg = config(tmp_path, every=2)
    cfg.steps = 4
    with pytest.raises(RunStopped):
        asyncio.run(train(cfg, fail_at=3, cut=(2,)))
    assert _eval_rows(cfg.run_dir) == []
    asyncio.run(train(cfg, resume_from=checkpoint.latest(cfg.run_dir), cut=()))
    assert _eval_rows(cfg.run_dir) == [2, 4]


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
    saved = checkpoint.load_run_state(checkpoint.latest(cfg.run_dir))
    assert saved == {"step": 3, "version": 3, "data": {"n": 30}, "app": "test"}
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


def test_setting_aside_takes_a_free_name_when_an_earlier_one_was_deleted(tmp_path):
    """A user who deleted checkpoints-earlier-1 to free disk, keeping -2: the next new run under
    that name moves the checkpoints to a name not taken, and -2 stays as it was."""
    run_dir = tmp_path / "run"
    for n in (1, 2, 3):
        checkpoint.save_run_state(checkpoint.partial_dir(run_dir, n), {"step": n})
        checkpoint.set_aside(run_dir)
    shutil.rmtree(run_dir / "checkpoints-earlier-1")
    checkpoint.save_run_state(checkpoint.partial_dir(run_dir, 4), {"step": 4})
    moved = checkpoint.set_aside(run_dir)
    assert moved.name == "checkpoints-earlier-4" and [p.name for p in moved.iterdir()] == ["step_000004"]
    assert [p.name for p in (run_dir / "checkpoints-earlier-2").iterdir()] == ["step_000002"]


class ActorTrainer(FakeTrainer):
    """A trainer in another process: a step it was sent runs to its end whatever the caller
    does, and its calls are served in order (a save waits for the step before it)."""

    def __init__(self):
        super().__init__()
        self.steps_taken, self.lock = 0, asyncio.Lock()
        self.train_step = self._served(self._train)
        self.save = self._served(self._save)

    def _served(self, fn):
        lock = self.lock

        class Served:
            async def route(self, *args):
                async def call():
                    async with lock:
                        return await fn(*args)

                return await asyncio.shield(asyncio.ensure_future(call()))

            fanout = route

        return Served()

    async def _train(self, batch):
        await asyncio.sleep(0.3)  # forward, backward, the optimizer's step
        self.version, self.steps_taken = self.version + 1, self.steps_taken + 1
        return self.version, {}

    async def _save(self, path):
        _write(path, {"version": self.version, "steps_taken": self.steps_taken})


async def sft_like(cfg, trainer, resume_from=None, interrupt_at=None):
    run, data = Run("test", cfg, resume_from, pushes_every_step=False), Counter()
    await run.start(trainer, FakeWeights(trainer), FakeEvals(), data=data)
    async with run:
        while run.step < cfg.steps:
            data.n += 10
            if run.step == interrupt_at:  # Ctrl-C while the trainer takes this step, where a run spends its time
                asyncio.get_running_loop().call_later(0.1, asyncio.current_task().cancel)
            await run.training(trainer.train_step.route("batch"))
            await run.end_step()
        await run.finish()
    return run


def test_ctrl_c_while_the_trainer_takes_a_step_counts_that_step(tmp_path, capsys):
    """The trainer finishes the step it was sent; the checkpoint the interrupt saves names it
    (not the trainer's step 4 as step 3), and the resumed run takes exactly `steps` in all."""
    cfg = Config(tmp_path / "run", steps=6, checkpoint_every=0)
    first = ActorTrainer()
    asyncio.run(sft_like(cfg, first, interrupt_at=3))
    assert "interrupted at step 4; saving a checkpoint" in capsys.readouterr().out
    last = checkpoint.latest(cfg.run_dir)
    saved, held = checkpoint.load_run_state(last), json.load(open(last / "trainer" / "state.json"))
    assert saved["step"] == held["steps_taken"] == 4 and saved["data"] == {"n": 40}
    second = ActorTrainer()
    run = asyncio.run(sft_like(cfg, second, resume_from=last))
    assert run.step == 6 and second.steps_taken == 2  # 4 + 2: the 6 steps asked for


def test_ctrl_c_while_the_trainer_takes_a_step_writes_that_steps_metrics_row(tmp_path):
    """The step the interrupt counts and saves has its metrics row: the resumed run goes on
    after it, so a row not written then is never written."""
    cfg = Config(tmp_path / "run", steps=6, checkpoint_every=0)
    asyncio.run(sft_like(cfg, ActorTrainer(), interrupt_at=3))
    assert [r["step"] for r in read_rows(cfg.run_dir)] == [1, 2, 3, 4]
    asyncio.run(sft_like(cfg, ActorTrainer(), resume_from=checkpoint.latest(cfg.run_dir)))
    assert [r["step"] for r in read_rows(cfg.run_dir)] == [1, 2, 3, 4, 5, 6]


def test_the_newest_checkpoint_is_the_highest_step_not_the_last_name(tmp_path):
    for step in (999_999, 1_000_000):
        path = checkpoint.partial_dir(tmp_path, step)
        checkpoint.save_run_state(path, {"step": step}, keep=1)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_1000000"]
    assert checkpoint.latest(tmp_path).name == "step_1000000"


def test_a_step_saved_again_and_cut_short_leaves_a_complete_checkpoint(tmp_path, monkeypatch):
    """Step 4 saved again (a Ctrl-C just after its checkpoint, a rewind) replaces the one there.
    A crash while the old one is deleted (a second Ctrl-C, a kill) must not leave a directory
    named as complete whose trainer state is half gone: the newest complete checkpoint is whole."""
    for step in (2, 4):
        path = checkpoint.partial_dir(tmp_path, step)
        _write(path / "trainer", {"version": step})
        checkpoint.save_run_state(path, {"step": step})
    path = checkpoint.partial_dir(tmp_path, 4)
    _write(path / "trainer", {"version": 40})
    real = shutil.rmtree

    def cut_short(victim, *args, **kwargs):  # deletes the trainer's state first, then the crash
        real(Path(victim) / "trainer", ignore_errors=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", cut_short)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_run_state(path, {"step": 4})
    monkeypatch.setattr(shutil, "rmtree", real)
    last = checkpoint.latest(tmp_path)
    assert (last / "trainer" / "state.json").exists(), f"{last} is named complete but its trainer state is gone"
    assert json.load(open(last / "trainer" / "state.json")) == {"version": 40}  # the new one, whole


def test_a_disk_that_fills_during_a_save_keeps_the_checkpoint_before_and_names_the_one_cut(tmp_path, monkeypatch):
    checkpoint.save_run_state(checkpoint.partial_dir(tmp_path, 2), {"step": 2})
    path = checkpoint.partial_dir(tmp_path, 4)

    def full(state, f):  # torch's own words for a full disk name no file
        Path(f).write_bytes(b"PK\x03\x04")
        raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError, match=rf"checkpoint {path}: .*run_state.pt.*unexpected pos"):
        checkpoint.save_run_state(path, {"step": 4})
    assert checkpoint.latest(tmp_path).name == "step_000002" and not path.exists()  # its room given back
    assert checkpoint.load_run_state(checkpoint.latest(tmp_path)) == {"step": 2}


def test_a_stray_step_name_that_is_no_number_is_no_checkpoint(tmp_path):
    """`step_²` is a digit to str.isdigit but no int: it must not stop `latest` or the pruning."""
    (tmp_path / "checkpoints" / "step_²").mkdir(parents=True)
    checkpoint.save_run_state(checkpoint.partial_dir(tmp_path, 3), {"step": 3}, keep=2)
    assert checkpoint.latest(tmp_path).name == "step_000003"


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_checkpoint_another_user_could_write_is_not_loaded(tmp_path):
    """Its run state is a pickle: loading it runs what it says. So is the trainer's DCP metadata."""
    cfg = config(tmp_path)
    asyncio.run(train(cfg))
    last = checkpoint.latest(cfg.run_dir)
    os.chown(last / "trainer" / "state.json", 4242, 4242)
    with pytest.raises(ConfigError, match=r"state.json is owned by uid 4242.*runs code when it loads"):
        checkpoint.load_run_state(last)
    os.chown(last / "trainer" / "state.json", 0, 0)
    os.chmod(last / "run_state.pt", 0o666)
    with pytest.raises(ConfigError, match=r"run_state.pt is owned by uid 0, mode -rw-rw-rw-"):
        checkpoint.load_run_state(last)
    os.chmod(last / "run_state.pt", 0o664)  # group-writable (a user's private group): loaded
    assert checkpoint.load_run_state(last)["step"] == 5


def _spoil(run_state: Path, how: str) -> None:
    if how == "truncated":
        run_state.write_bytes(run_state.read_bytes()[:40])
    elif how == "empty":
        run_state.write_bytes(b"")
    elif how == "not a run state":
        torch.save([1, 2], run_state)
    elif how == "a step that is no number":
        torch.save({"step": "5", "app": "test"}, run_state)
    elif how == "a directory":
        run_state.unlink()
        run_state.mkdir()
    else:  # a pipe: reading it would wait for a writer forever
        run_state.unlink()
        os.mkfifo(run_state)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "how", ["truncated", "empty", "not a run state", "a step that is no number", "a directory", "a pipe"]
)
def test_a_spoiled_run_state_is_an_error_naming_it(tmp_path, how):
    """A run_state.pt cut short (a crash, a full disk), crafted or not a file: resuming from it
    stops with an error that names it, never an error without a path, a wrong step, or a hang."""
    cfg = config(tmp_path)
    asyncio.run(train(cfg))
    last = checkpoint.latest(cfg.run_dir)
    _spoil(last / "run_state.pt", how)
    with pytest.raises(ConfigError, match=rf"checkpoint {last}: .*run_state.pt"):
        Run("test", cfg, last)


def test_resuming_takes_its_own_directory_and_refuses_another_apps_or_runs_checkpoint(tmp_path, monkeypatch):
    """`forge run --resume DIR` goes on in DIR from wherever it runs (its config's runs_dir may be
    relative); a resume into a directory holding another run's checkpoints (its pruning would
    delete them) or from another app's checkpoint is a config error before anything starts."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    run_dir = work / "runs" / "sft_tiny"
    asyncio.run(train(Config(run_dir)))
    (run_dir / "config.yaml").write_text((ROOT / "configs" / "sft_tiny.yaml").read_text())
    asyncio.run(train(Config(work / "runs" / "other" / "x")))
    monkeypatch.chdir(tmp_path)
    seen = []
    monkeypatch.setattr(importlib.import_module("apps.sft"), "main", lambda cfg: seen.append(cfg))
    cli.run(None, [], resume=str(run_dir))
    assert seen[0].run_dir.resolve() == run_dir and seen[0].resume == str(run_dir)
    with pytest.raises(
        ConfigError, match=r"sft_tiny/checkpoints/step_000005 is a checkpoint of a test run, not of sft"
    ):
        seen[0].resume_point()
    fork = RunConfig(app="test", runs_dir=str(work / "runs" / "other"), run_name="x", resume=str(run_dir))
    with pytest.raises(ConfigError, match=r"would go on in .*runs/other/x .* holds another run's checkpoints"):
        fork.resume_point()
    fork.run_name = "y"  # an empty directory: the run goes on there
    assert fork.resume_point() == checkpoint.latest(run_dir)


def test_a_metrics_file_cut_mid_row_resumes(tmp_path):
    """A disk that filled while a row was written leaves a line cut short: not a row, not an error."""
    cfg = config(tmp_path)
    asyncio.run(train(cfg))
    with open(cfg.run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "wall_s": 0.1, "lo')
    cfg.steps = 7
    run, *_ = asyncio.run(train(cfg, resume_from=checkpoint.latest(cfg.run_dir)))
    assert run.step == 7 and [r["step"] for r in read_rows(cfg.run_dir)] == list(range(1, 8))


@pytest.mark.parametrize("spelling", [".", "a link"])
def test_resuming_goes_on_in_the_directory_however_it_is_named(tmp_path, monkeypatch, spelling):
    run_dir = tmp_path / "work" / "runs" / "sft_tiny"
    asyncio.run(train(Config(run_dir)))
    (run_dir / "config.yaml").write_text((ROOT / "configs" / "sft_tiny.yaml").read_text())
    if spelling == ".":
        monkeypatch.chdir(run_dir)
    else:
        (tmp_path / "latest").symlink_to(run_dir)
        monkeypatch.chdir(tmp_path)
    seen = []
    monkeypatch.setattr(importlib.import_module("apps.sft"), "main", lambda cfg: seen.append(cfg))
    cli.run(None, [], resume="." if spelling == "." else "latest")
    assert seen[0].run_dir.resolve() == run_dir.resolve()


async def restored_after_its_step(cfg, trainer):
    """A trainer that dies after a step trained (in the weights' push), restored from step 2's
    checkpoint; a Ctrl-C while the rewound run waits for its next batch."""
    run, data, restored = Run("test", cfg, None), Counter(), False
    await run.start(trainer, FakeWeights(trainer), FakeEvals(), data=data)
    async with run:
        while run.step < cfg.steps:
            if restored:
                trainer.version = trainer.steps_taken = 2  # the new replica, from the checkpoint
                await run.rewind(checkpoint.latest(cfg.run_dir), trainer_restored=True)
                asyncio.get_running_loop().call_soon(asyncio.current_task().cancel)
                await asyncio.sleep(1)
            data.n += 10
            await run.training(trainer.train_step.route("batch"))
            if run.step == 2:
                restored = True
                continue
            await run.end_step(trainer.version)
    return run


def test_ctrl_c_after_a_rewind_counts_no_step_from_before_it(tmp_path):
    cfg = Config(tmp_path / "run", steps=6, checkpoint_every=2)
    asyncio.run(restored_after_its_step(cfg, ActorTrainer()))
    last = checkpoint.latest(cfg.run_dir)
    saved, held = checkpoint.load_run_state(last), json.load(open(last / "trainer" / "state.json"))
    assert saved["step"] == held["steps_taken"] == 2


def test_the_saved_config_is_readable_by_its_owner_alone(tmp_path):
    """config.yaml is the config resolved: a judge's or the gateway's API key read from the
    environment is in it as text, so other users of the machine must not read it."""
    old = os.umask(0o022)
    try:
        Run("test", config(tmp_path))
    finally:
        os.umask(old)
    assert (tmp_path / "run" / "config.yaml").stat().st_mode & 0o077 == 0


class RestoringTrainer(ActorTrainer):
    """Dies during its 4th step; a new replica restores the checkpoint of step 2."""

    async def _train(self, batch):
        if self.steps_taken == 3:
            await asyncio.sleep(0.3)  # dies mid-step; the restore takes the rest
            self.steps_taken = self.version = 2
            raise ReplicaRestored("Trainer", "step_000002/trainer", "killed", 0.1)
        return await super()._train(batch)


def test_ctrl_c_while_the_trainer_is_restored_saves_no_step_it_lost(tmp_path, capsys):
    """A Ctrl-C while the trainer is restored under the step under way: the restored trainer
    holds step 2's state, so a checkpoint of step 3 (its data past step 2's) would lose steps 3
    and 4 on resume. The run's last checkpoint (step 2) stands, and the console says so."""
    cfg = Config(tmp_path / "run", steps=6, checkpoint_every=2)
    asyncio.run(sft_like(cfg, RestoringTrainer(), interrupt_at=3))
    last = checkpoint.latest(cfg.run_dir)
    saved, held = checkpoint.load_run_state(last), json.load(open(last / "trainer" / "state.json"))
    assert saved["step"] == held["steps_taken"] == 2 and saved["data"] == {"n": 20}
    assert "resume from" in capsys.readouterr().out
