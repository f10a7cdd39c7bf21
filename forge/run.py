"""What every app's run shares, so an app's loop is its algorithm and little else.

    run = Run("sft", cfg, resume_from)                 # its directory, config.yaml, metrics writer
    await run.start(trainer, weights, evals, examples=examples)  # resumed from `resume_from`, if given
    async with run:                                    # Ctrl-C saves; the bar, writer and plots close
        while run.step < cfg.steps:
            ...                                        # the app's step: train (in run.training), record metrics
            await run.end_step()                       # a metrics row, the bar, checkpoints, evals
        await run.finish()                             # the last checkpoint and eval, the HF export
                                                       # leaving the block prints the run's summary

The config (`cfg`) is a RunConfig with an `eval` section (every, before_train). A checkpoint holds the trainer's state, the step and policy
version, and the `state_dict()` of each part the app names (its data position, its buffer).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from tqdm import tqdm

from forge import checkpoint
from forge.checkpoint import RunStopped
from forge.config import ConfigError, to_yaml, without_secrets
from forge.curves import plot_run
from forge.metrics import MetricWriter, discard_pending, read_rows
from forge.rollout import RolloutError, RolloutsStopped
from forge.service import ReplicaRestored, ServiceError
from forge.summary import failures, summary

T = TypeVar("T")
PLOT_EVERY_S = 10.0  # matplotlib costs ~0.2 s: not every step


class Part(Protocol):
    """Something a checkpoint holds (torch's Stateful); either method may be async."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


class ActorState:
    """An actor's `state_dict` and `load_state_dict` endpoints as a Part."""

    def __init__(self, actor: Any):
        self.actor = actor

    async def state_dict(self) -> Any:
        return await self.actor.state_dict.call_one()

    async def load_state_dict(self, state: Any) -> None:
        await self.actor.load_state_dict.call_one(state)


async def _result(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class Run:
    """One app run: its directory and config, the step and policy version, checkpoints (save,
    resume, rewind after a trainer restore), the metrics writer, evals beside the loop, the
    progress bar and plots.

    `show`: the bar's figures, label -> (metrics key, format). `plot_keys`: the curves of
    rewards.png (None: the app's defaults). `pushes_every_step`: the app publishes the weights
    it trains each step (GRPO), so an eval takes the current version; otherwise (SFT) an eval
    publishes them first. Weights are published through the run's WeightSync (`weights` at
    `start`; None when nothing generates). Other trained models (`models` at `start`: PPO's
    critic) are saved and restored beside the trainer."""

    def __init__(
        self,
        app: str,
        cfg: Any,
        resume_from: Path | None = None,
        show: dict[str, tuple[str, str]] | None = None,
        plot_keys: tuple[str, ...] | None = None,
        pushes_every_step: bool = True,
    ):
        self.app, self.cfg, self.dir, self.resume_from = app, cfg, Path(cfg.run_dir), resume_from
        self.show, self.plot_keys, self.pushes_every_step = show or {}, plot_keys, pushes_every_step
        self.dir.mkdir(parents=True, exist_ok=True)
        if resume_from is None and (earlier := checkpoint.set_aside(self.dir)) is not None:
            print(f"forge: {self.dir} held an earlier run's checkpoints; moved them to {earlier}", flush=True)
        # The config resolved: an API key read from the environment is in it as text.
        _write_private(self.dir / "config.yaml", to_yaml(cfg))
        self.step = checkpoint.load_run_state(resume_from)["step"] if resume_from else 0
        self.version = 0
        self.finished = False
        self.row: dict[str, float] = {}
        self.written = self.step  # the last step with a metrics row (a resume keeps its checkpoint's)
        self.writer = MetricWriter(
            self.dir, cfg.metrics, config=without_secrets(cfg), resume_step=self.step if resume_from else None
        )
        self.trainer: Any = None
        self.weights: Any = None
        self.evals: Any = None
        self.parts: dict[str, Part] = {}
        self.models: dict[str, Any] = {}
        self.bar: tqdm | None = None
        self.failed = 0  # failures this run has recovered from (episodes, rollouts, rewards, restores)
        self._plotted = time.monotonic()
        self._training: asyncio.Future | None = None  # this step's training calls, until end_step counts them
        self._restored: ReplicaRestored | None = None  # a trainer restore the run is not rewound to yet

    async def start(
        self, trainer: Any, weights: Any, evals: Any, models: dict[str, Any] | None = None, **parts: Part
    ) -> None:
        """Begin on running services: resume from the checkpoint given, else evaluate the
        starting policy (`eval.before_train`)."""
        self.trainer, self.weights, self.evals, self.parts = trainer, weights, evals, parts
        self.models = models or {}
        self.version = await trainer.policy_version.route()  # 0, unless these services already trained
        if self.resume_from is not None:
            await self.rewind(self.resume_from)
        await discard_pending()  # services reused from an earlier run may still hold its values
        self.writer.start_clock()
        if self.cfg.eval.before_train and self.resume_from is None:
            await self.evals.run(self.step, await self._eval_version())
        elif self.resume_from is not None and self.step and self._due(self.cfg.eval.every):
            if self._evaluated(self.step) is False:  # its eval was cut short by the stop: these are its weights
                self.evals.start(self.step, await self._eval_version())
        self.bar = tqdm(total=self.cfg.steps, initial=self.step, desc=self.app, unit="step")

    async def rewind(self, ckpt: Path, trainer_restored: bool = False) -> dict[str, Any]:
        """Continue from checkpoint `ckpt`: its step and parts, and the trainer's state (loaded
        here; a restored trainer replica loaded it itself and published it as a version past the
        dead one's). Returns what the checkpoint held."""
        saved = checkpoint.load_run_state(ckpt)
        self._training = None  # a step begun before the rewind is not this checkpoint's to count
        if trainer_restored:
            await self.evals.cancel()  # its step's rows are about to be dropped
        else:
            await self.trainer.load.route(str(ckpt / "trainer"))
        for name, part in self.parts.items():
            if name not in saved:
                raise ConfigError(
                    f"checkpoint {ckpt} holds no '{name}' of a {self.app} run (saved: {', '.join(saved)})"
                )
            await _result(part.load_state_dict(saved[name]))
        for name, model in self.models.items():
            await model.load.route(str(ckpt / name))
            model.set_restore_point(str(ckpt / name))
        if self.pushes_every_step and not trainer_restored and self.weights is not None:
            await self.weights.push()  # generators resume on the trained policy
        self.step = saved["step"]
        self.version = await self.trainer.policy_version.route()
        if trainer_restored:
            self.weights.publish(self.version)  # the restored replica published it itself
        self.trainer.set_restore_point(str(ckpt / "trainer"))
        if trainer_restored:
            self.writer.rewind(self.step)
            self.written = self.step
            self._restored = None
        return saved

    async def save(self) -> None:
        """A checkpoint of this step, complete or not at all."""
        partial = checkpoint.partial_dir(self.dir, self.step)
        await self.trainer.save.fanout(str(partial / "trainer"))
        for name, model in self.models.items():
            await model.save.fanout(str(partial / name))
        state = {"step": self.step, "version": self.version, "app": self.app}
        for name, part in self.parts.items():
            state[name] = await _result(part.state_dict())
        path = checkpoint.save_run_state(partial, state)
        self.trainer.set_restore_point(str(path / "trainer"))
        for name, model in self.models.items():
            model.set_restore_point(str(path / name))

    async def training(self, calls: Awaitable[T]) -> T:
        """This step's training calls (`calls`), carried through a Ctrl-C: a trainer finishes a
        step it has begun whatever its caller does, so the checkpoint the interrupt saves counts
        this step (rather than the trainer's step k + 1 saved as step k)."""
        self._training = asyncio.ensure_future(calls)
        try:
            return await asyncio.shield(self._training)
        except ReplicaRestored as e:
            self._restored = e  # until the app rewinds the run to the trainer's restore point
            raise

    async def _count_training(self) -> ReplicaRestored | None:
        """Before an interrupt's checkpoint: the step under way finished and counted (if it fails,
        it did not happen). Returns the restore of a trainer that died under it or an earlier
        step, which the app has not rewound the run to: the run's state is ahead of the trainer's."""
        training, self._training = self._training, None
        if training is None:  # none begun since the last end_step counted one
            return self._restored
        try:
            await training
        except ReplicaRestored as e:
            self._restored = e
        except Exception:
            pass
        else:
            self.step += 1
            self.version = await self.trainer.policy_version.route()
        return self._restored

    async def _write_counted(self) -> None:
        """Before an interrupt's checkpoint: the row of the step it saves, if that step has none
        (counted by `_count_training`, or its flush interrupted). The resumed run goes on after
        the checkpoint's step, so a row not written now never is."""
        if self.written < self.step:
            self.row = await self.writer.flush(self.step)
            self.written = self.step

    async def end_step(self, version: int | None = None) -> dict[str, float]:
        """The step is done (training policy `version`, when the app publishes each step): its
        metrics row, the bar, and the checkpoint and eval due. Returns the row."""
        self.step, self._training = self.step + 1, None
        self.version = self.version if version is None else version
        self.row = await self.writer.flush(self.step)
        self.written = self.step
        if time.monotonic() - self._plotted > PLOT_EVERY_S:
            self._plot()
        self.bar.n = self.step
        postfix = {label: f"{self.row.get(key, float('nan')):{fmt}}" for label, (key, fmt) in self.show.items()}
        if self.cfg.eval.every:
            postfix["eval_acc"] = f"{self.evals.accuracy:.2f}"
        self.failed += int(sum(failures(self.row).values()))
        if self.failed:
            postfix["failed"] = str(self.failed)
        self.bar.set_postfix(postfix)
        if self._due(self.cfg.checkpoint_every):
            await self.save()
        if self._due(self.cfg.eval.every):
            self.evals.start(self.step, await self._eval_version())
        return self.row

    async def finish(self) -> None:
        """The end of training: the last checkpoint and eval (unless the last step made them),
        and the trained policy exported in HF format to run_dir/model."""
        if self.cfg.checkpoint_every and not self._due(self.cfg.checkpoint_every):
            await self.save()
        await self.evals.wait()
        if self.cfg.eval.every and not self._due(self.cfg.eval.every) and not self._evaluated(self.step):
            await self.evals.run(self.step, await self._eval_version())  # the final policy, always
        await self.trainer.export_hf.route(str(self.dir / "model"))
        self.finished = True

    async def __aenter__(self) -> Run:
        return self

    async def __aexit__(self, kind: Any, error: BaseException | None, tb: Any) -> bool:
        """Ctrl-C saves a checkpoint; a service or the rollouts that cannot go on stop the run
        with where to resume from; the bar, the writer and the plots close either way, and a
        finished run prints its summary."""
        try:
            if isinstance(error, (KeyboardInterrupt, asyncio.CancelledError)):
                if (restored := await asyncio.shield(self._count_training())) is not None:
                    where = Path(str(restored.restore_point)).parent
                    print(f"\n{self.app}: interrupted as {restored}; nothing saved: resume from {where}", flush=True)
                    return True
                await asyncio.shield(self._write_counted())
                print(f"\n{self.app}: interrupted at step {self.step}; saving a checkpoint", flush=True)
                await asyncio.shield(self.save())
                return True
            if isinstance(error, (ServiceError, RolloutError, RolloutsStopped)):
                raise RunStopped(self.dir, self.step, str(error)) from error
            return False
        finally:
            await asyncio.gather(self.evals.cancel(), return_exceptions=True)
            if self.bar is not None:
                self.bar.close()
            self.writer.close()
            self._plot()
            if self.finished and "jsonl" in self.cfg.metrics:  # the summary reads metrics.jsonl (not a warm start's)
                print(summary(self.dir, tuple(key for key, _ in self.show.values())), flush=True)

    def _evaluated(self, step: int) -> bool | None:
        """Whether metrics.jsonl holds an eval row of `step` (a resumed run's checkpoint step may
        have one); None: no metrics.jsonl is written to tell."""
        if "jsonl" not in self.cfg.metrics:
            return None
        return any(row["step"] == step and any(k.startswith("eval/") for k in row) for row in read_rows(self.dir))

    def _due(self, every: int) -> bool:
        return bool(every) and self.step % every == 0

    async def _eval_version(self) -> int:
        if self.pushes_every_step or self.weights is None:  # nothing to publish: the evals ask the trainer
            return self.version
        return await self.weights.push()

    def _plot(self) -> None:
        if (self.dir / "metrics.jsonl").exists():
            plot_run(self.dir, **({"keys": self.plot_keys} if self.plot_keys else {}))
        self._plotted = time.monotonic()


def _write_private(path: Path, text: str) -> None:
    """`text` in `path`, which its owner alone may read (an earlier file of that name too)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)
        f.write(text)
