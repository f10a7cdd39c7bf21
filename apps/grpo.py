"""GRPO: generate groups, score them, train, push weights, as concurrent loops.

    forge run configs/grpo_tiny.yaml [key=value ...]       # or: make run
    forge run --resume runs/grpo_tiny                       # continue from the last checkpoint

`max_staleness` picks the mode: 0 = on-policy (rollouts wait for the newest weights),
1 = one-step off-policy, k = fully async. Change the loss with `trainer.loss.name`, the
rewards with `rewards`, the rollout (multi-turn, tools) with `rollout`.

`run_together([cfg_a, cfg_b])`: several LoRA runs at once on one generator service.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from apps.sft import warm_start
from forge.buffer import ReplayBuffer
from forge.config import ConfigError, import_object
from forge.data import DatasetConfig, FilePrompts, TaskPrompts
from forge.job import JobConfig
from forge.metrics import Reduce, metrics_scope, record_metric
from forge.rollout import REWARD_UNAVAILABLE, RolloutLoops, Rollouts, SingleTurn
from forge.run import ActorState, Run, RunConfig
from forge.service import ReplicaRestored
from forge.tasks import get_task
from forge.types import collate
from services.agentic import AgenticConfig, AgenticRollouts
from services.evals import BackgroundEvals, EvalConfig, held_out
from services.generator import GeneratorConfig
from services.rewards import RewardsConfig
from services.roles import Roles, Shared
from services.tiny_model import ModelConfig
from services.trainer import TrainerConfig


@dataclass
class Config(RunConfig):
    app: str = "grpo"
    run_name: str = "grpo"
    task: str = "reverse"  # a generated toy task (forge/tasks.py), unless `dataset` names a file
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    group_size: int = 8
    groups_per_step: int = 8  # batch = group_size x groups_per_step episodes
    max_staleness: int = 1
    rollout_tasks: int = 4  # concurrent rollout loops
    rollout: str = "forge.rollout:generate_and_score"  # one prompt -> (completions, scores)
    agentic: AgenticConfig = field(default_factory=AgenticConfig)  # multi-turn agents or environments
    max_rollout_failures: int = 20  # rollouts failing in a row before the run stops
    sample_timeout_s: float = 600.0  # the longest wait for a batch before the run stops
    dynamic_sampling: bool = False  # drop zero-variance groups and refill (DAPO)
    max_episode_tokens: int = 0  # drop longer episodes (0: keep all)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)  # what scores a sample (services/rewards/)
    # A group with a reward whose infrastructure failed (RewardUnavailable): dropped, or trained
    # with that reward at 0.
    reward_unavailable: str = "mask"
    job: JobConfig = field(default_factory=JobConfig)  # where the roles run (forge/job.py); default: this host
    generator_replicas: int = 1  # spread over the hosts of the generator's job mesh
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    trainer_procs: int = 1
    trainer_restores: int = 3  # trainer deaths recovered from the last checkpoint before the run stops
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)  # held-out evals during training

    @property
    def batch_size(self) -> int:
        return self.group_size * self.groups_per_step

    def validate(self) -> None:
        """The app's own keys and how sections fit together (each section validates itself)."""
        super().validate()
        if self.group_size < 2:
            raise ConfigError(
                f"config key 'group_size' must be >= 2 (GRPO compares samples of a group), got {self.group_size}"
            )
        if self.max_staleness < 0:
            raise ConfigError(f"config key 'max_staleness' must be >= 0, got {self.max_staleness}")
        for key in ("max_rollout_failures", "sample_timeout_s", "rollout_tasks"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"config key '{key}' must be > 0, got {getattr(self, key)}")
        shards = self.trainer_procs * self.trainer.grad_accum
        if self.batch_size % shards:
            raise ConfigError(
                f"batch of {self.batch_size} (group_size x groups_per_step) does not split over "
                f"trainer_procs x trainer.grad_accum = {shards}"
            )
        if self.reward_unavailable not in REWARD_UNAVAILABLE:
            raise ConfigError(
                f"config key 'reward_unavailable': {self.reward_unavailable!r} is not one of "
                f"{', '.join(REWARD_UNAVAILABLE)}"
            )
        if self.trainer.total_steps is None:
            self.trainer.total_steps = self.steps
        import_object("rollout", self.rollout)
        if self.agentic.enabled and self.rollout != Config.rollout:
            raise ConfigError(
                "config keys 'rollout' and 'agentic': an agent or environment makes the rollouts; set one of them"
            )
        if not self.dataset.path:
            try:
                get_task(self.task)
            except ValueError as e:
                raise ConfigError(f"config key 'task': {e} (or give a file in 'dataset.path')") from None
        self._validate_rewards()
        self._validate_eval()

    def _validate_rewards(self) -> None:
        if "task" in self.rewards.weights and self.dataset.path:
            raise ConfigError(
                "config key 'rewards.weights': the 'task' reward scores toy tasks, not a dataset file's rows"
            )
        if self.eval.rewards:
            self.rewards.check_weights(self.eval.rewards, "eval.rewards")
        if "judge" in self.rewards.weights and not self.dataset.path:  # a dataset file's columns: checked once read
            self.rewards.check_judge(columns=())

    def _validate_eval(self) -> None:
        if self.eval.enabled and self.dataset.path and not self.eval.dataset.path:
            raise ConfigError(
                "config key 'eval.dataset.path': a run on a dataset file evaluates on a file too (its held-out rows)"
            )
        held = self.eval.dataset
        if held.path and not held.messages_key and not held.chat and held.template == DatasetConfig.template:
            # the run's prompt format, unless the eval's file has its own
            held.template, held.messages_key, held.chat, held.tools_key = (
                self.dataset.template,
                self.dataset.messages_key,
                self.dataset.chat,
                self.dataset.tools_key,
            )
            held.answer_key = self.dataset.answer_key


async def run(cfg: Config, shared: Shared | None = None) -> dict[str, float]:
    last = cfg.resume_point()
    roles = await Roles.start(cfg, warm_start, shared)
    try:
        return await train(cfg, roles, resume_from=last)
    finally:
        await asyncio.shield(roles.shutdown())


async def run_together(cfgs: list[Config]) -> list[dict[str, float]]:
    """Several GRPO runs at once, each training its own LoRA adapter (on its own task, rewards,
    data), on one generator service: one copy of the base model, each request tagged with its
    run's adapter and version. Each run has its own trainer, checkpoints and metrics (runs/NAME);
    one that fails stops alone. Returns each run's last metrics row; raises the first failure."""
    shared = await Shared.start(cfgs, warm_start)

    async def one(cfg: Config) -> dict[str, float]:
        with metrics_scope():
            return await run(cfg, shared)

    try:
        rows = await asyncio.gather(*(one(cfg) for cfg in cfgs), return_exceptions=True)
    finally:
        await asyncio.shield(shared.shutdown())
    for row in rows:
        if isinstance(row, BaseException):
            raise row
    return rows


BAR = {"reward": ("reward_mean", ".3f"), "acc": ("accuracy", ".2f"), "tok_s": ("tokens_per_s", ".0f")}


async def train(cfg: Config, s: Roles, resume_from: Path | None = None) -> dict[str, float]:
    """The GRPO loop on running roles; returns the last metrics row. Raises RunStopped when
    the run cannot go on (the trainer could not be restored, rollouts keep failing, no batch
    comes), naming the checkpoint to resume from."""
    run = Run("grpo", cfg, resume_from, show=BAR)
    prompts = FilePrompts(cfg.dataset, cfg.seed) if cfg.dataset.path else TaskPrompts(cfg.task, cfg.seed)
    if "judge" in cfg.rewards.weights and cfg.dataset.path:  # the rubric's fields, now that the columns are known
        cfg.rewards.check_judge(prompts.rows.column_names)
    prompts.reset()
    buffer = await ReplayBuffer.options().as_actor(
        capacity=cfg.groups_per_step * (cfg.max_staleness + 1),
        max_staleness=cfg.max_staleness,
        max_tokens=cfg.max_episode_tokens,
        dynamic_sampling=cfg.dynamic_sampling,
    )
    held_out_samples = held_out(cfg.eval, cfg.task) if cfg.eval.enabled else []
    evals = BackgroundEvals(
        cfg.eval, held_out_samples, s.gen, s.eval_rewards or s.rewards, s.weights, run.writer, "grpo"
    )
    loops = RolloutLoops(rollouts(cfg, s), prompts, buffer, s.weights, cfg)
    restored: ReplicaRestored | None = None
    try:
        await run.start(s.trainer, s.weights, evals, prompts=prompts, buffer=ActorState(buffer))
        async with run, loops.running(run.version):
            while not run.finished:
                try:
                    if restored is not None:  # inside the try: the trainer may die again meanwhile
                        restored = await recover(restored, run, loops, buffer)
                    while run.step < cfg.steps:
                        await step(cfg, s, run, loops, buffer)
                    await run.finish()
                except ReplicaRestored as e:
                    restored = e
    finally:
        await asyncio.shield(buffer.shutdown())
    return run.row


def rollouts(cfg: Config, s: Roles) -> Rollouts:
    """Groups of multi-turn episodes through the gateway (`agentic`), else of the `rollout` function."""
    if cfg.agentic.enabled:
        return AgenticRollouts(cfg.agentic, s.gateway, s.envs, cfg.group_size, cfg.trainer.loss.normalize_std)
    return SingleTurn(import_object("rollout", cfg.rollout), cfg.rollout, s.gen, s.rewards, cfg)


async def step(cfg: Config, s: Roles, run: Run, loops: RolloutLoops, buffer: Any) -> None:
    """One GRPO step: a batch of scored groups (generated beside the loop), train, push weights."""
    t0 = time.perf_counter()
    episodes = await loops.batch(run.version)
    t1 = time.perf_counter()
    batch = collate(episodes, pad_id=0, rows_multiple_of=cfg.trainer_procs * cfg.trainer.grad_accum)
    if s.ref is not None:
        batch.ref_logprobs = await s.ref.logprobs.route(batch)
    t2 = time.perf_counter()
    version, metrics = await s.trainer.train_step.route(batch)
    t3 = time.perf_counter()
    await s.weights.push()  # returns once published; the generators load it while they generate
    await buffer.notify_version.call_one(version)
    record_batch(episodes, run.version, metrics)
    wall = time.perf_counter() - t0
    record_metric("tokens_per_s", sum(e.num_response_tokens for e in episodes) / wall)
    for name, seconds in (("wait_s", t1 - t0), ("ref_s", t2 - t1), ("train_s", t3 - t2), ("push_s", wall - (t3 - t0))):
        record_metric(f"time/{name}", seconds)
    await run.end_step(version)


def record_batch(episodes: list, trained_on: int, metrics: dict[str, float]) -> None:
    for key, value in metrics.items():
        record_metric(key, value)
    for e in episodes:
        record_metric("reward_mean", e.reward)
        record_metric("reward_std", e.reward, Reduce.STD)
        if e.score.correct is not None:
            record_metric("accuracy", e.score.correct)
        record_metric("staleness_mean", trained_on - e.policy_version)
        record_metric("staleness_max", trained_on - e.policy_version, Reduce.MAX)


async def recover(e: ReplicaRestored, run: Run, loops: RolloutLoops, buffer: Any) -> None:
    """The trainer died and a new replica restored its last checkpoint: go on from there."""
    died_at = run.step
    await loops.stop()  # their prompts are replayed from the checkpoint's position
    saved = await run.rewind(Path(e.restore_point).parent, trainer_restored=True)
    await buffer.lose.call_one((saved["version"], run.version - 1))  # the dead trainer's later versions
    await loops.start(run.version)
    record_metric("trainer_restores", 1, Reduce.SUM)
    tqdm.write(
        f"grpo: {e}. It died at step {died_at}; the run continues from step {run.step} "
        f"(policy version {run.version}); the metrics rows after step {run.step} are dropped"
    )


def main(cfg: Config) -> dict[str, float]:
    return asyncio.run(run(cfg))


if __name__ == "__main__":
    from forge.cli import run_app

    run_app("grpo")
