"""GRPO: generate groups, score them, train, push weights, as concurrent loops.

    forge run configs/grpo_tiny.yaml [key=value ...]       # or: make run
    forge run --resume runs/grpo_tiny                       # continue from the last checkpoint

`max_staleness` picks the mode: 0 = on-policy (rollouts wait for the newest weights),
1 = one-step off-policy, k = fully async. Change the loss with `trainer.loss.name`, the
rewards with `rewards`, the rollout (multi-turn, tools) with `rollout`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from forge import checkpoint
from forge.buffer import ReplayBuffer
from forge.config import ConfigError, import_object, to_yaml
from forge.data import DatasetConfig, FilePrompts, TaskPrompts
from forge.metrics import DEFAULT_BACKENDS, MetricWriter, Reduce, discard_pending, plot_rewards, record_metric
from forge.rollout import make_group
from forge.store import start_store, stop_store
from forge.tasks import get_task
from forge.tiny_model import ModelConfig
from forge.types import collate
from services.generator import Generator, GeneratorConfig
from services.reference import Reference
from services.rewards import Rewards, check_rewards
from services.trainer import Trainer, TrainerConfig


@dataclass
class Config:
    app: str = "grpo"
    run_name: str = "grpo"
    runs_dir: str = "runs"
    seed: int = 0
    task: str = "reverse"  # a generated toy task (forge/tasks.py), unless `dataset` names a file
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    steps: int = 100
    group_size: int = 8
    groups_per_step: int = 8  # batch = group_size x groups_per_step episodes
    max_staleness: int = 1
    rollout_tasks: int = 4  # concurrent rollout loops
    rollout: str = "forge.rollout:generate_and_score"  # one prompt -> (completions, scores)
    dynamic_sampling: bool = False  # drop zero-variance groups and refill (DAPO)
    max_episode_tokens: int = 0  # drop longer episodes (0: keep all)
    # name: weight (services/rewards.py). Empty here so a config's dict replaces it instead of
    # merging into it (OmegaConf merges dicts); empty after loading means {"exact": 1.0}.
    rewards: dict[str, float] = field(default_factory=dict)
    generator_replicas: int = 1
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    trainer_procs: int = 1
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint_every: int = 25
    resume: str | None = None  # a run directory to continue
    metrics: list[str] = field(default_factory=lambda: list(DEFAULT_BACKENDS))

    @property
    def batch_size(self) -> int:
        return self.group_size * self.groups_per_step

    def validate(self) -> None:
        if self.group_size < 2:
            raise ConfigError(f"config key 'group_size' must be >= 2 (GRPO compares samples of a group), got {self.group_size}")
        if self.max_staleness < 0:
            raise ConfigError(f"config key 'max_staleness' must be >= 0, got {self.max_staleness}")
        shards = self.trainer_procs * self.trainer.grad_accum
        if self.batch_size % shards:
            raise ConfigError(f"batch of {self.batch_size} (group_size x groups_per_step) does not split over "
                              f"trainer_procs x trainer.grad_accum = {shards}")
        if not self.rewards:
            self.rewards = {"exact": 1.0}
        import_object("rollout", self.rollout)
        if not self.dataset.path:
            try:
                get_task(self.task)
            except ValueError as e:
                raise ConfigError(f"config key 'task': {e} (or give a file in 'dataset.path')") from None
        try:
            check_rewards(self.task, self.rewards)
            self.trainer.loss.validate()
        except ValueError as e:
            raise ConfigError(str(e)) from None


def options(section) -> dict:
    return {k: v for k, v in dataclasses.asdict(section).items() if k != "model"}


@dataclass
class Services:
    """What a GRPO run talks to. Spawned once per run; a benchmark reuses them across runs."""

    store: Any
    trainer: Any
    gen: Any
    rewards: Any
    ref: Any | None

    @classmethod
    async def start(cls, cfg: Config) -> Services:
        model = str(cfg.model.resolve())
        store = await start_store()
        trainer = await Trainer.options(procs=cfg.trainer_procs).as_service(model, **options(cfg.trainer))
        gen = await Generator.options(replicas=cfg.generator_replicas).as_service(
            model, **{**options(cfg.generator), "weights_from": cfg.trainer.weights})
        rewards = await Rewards.options().as_service(cfg.task, dict(cfg.rewards))
        ref = await Reference.options().as_service(model) if cfg.trainer.loss.kl_coef > 0 else None
        return cls(store, trainer, gen, rewards, ref)

    async def shutdown(self) -> None:
        await asyncio.gather(self.gen.shutdown(), self.trainer.shutdown(), self.rewards.shutdown(),
                             *([self.ref.shutdown()] if self.ref else []), return_exceptions=True)
        await stop_store(self.store)


async def run(cfg: Config) -> dict[str, float]:
    last = checkpoint.latest(cfg.resume) if cfg.resume else None
    if cfg.resume and last is None:
        raise ConfigError(f"config key 'resume': no checkpoint in {cfg.resume}/checkpoints")
    services = await Services.start(cfg)
    try:
        return await train(cfg, services, resume_from=last)
    finally:
        await asyncio.shield(services.shutdown())


async def train(cfg: Config, s: Services, resume_from: Path | None = None) -> dict[str, float]:
    """The GRPO loop on running services; returns the last metrics row."""
    run_dir = Path(cfg.runs_dir) / cfg.run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    rollout = import_object("rollout", cfg.rollout)
    trainer, gen, rewards, ref = s.trainer, s.gen, s.rewards, s.ref
    buffer = await ReplayBuffer.options().as_actor(capacity=cfg.batch_size * (cfg.max_staleness + 1),
                                                   max_staleness=cfg.max_staleness, max_tokens=cfg.max_episode_tokens,
                                                   dynamic_sampling=cfg.dynamic_sampling)
    prompts = FilePrompts(cfg.dataset, cfg.seed) if cfg.dataset.path else TaskPrompts(cfg.task, cfg.seed)
    prompts.reset()
    version = await trainer.policy_version.route()  # 0, unless these services already trained
    state = {"step": 0, "version": version, "on_policy": version}
    if resume_from is not None:
        await trainer.load.fanout(str(resume_from / "trainer"))
        saved = checkpoint.load_run_state(resume_from)
        state = {"step": saved["step"], "version": saved["version"], "on_policy": saved["version"]}
        prompts.reset(saved["prompts"])
        await buffer.load_state_dict.call_one(saved["buffer"])
        await trainer.push_weights.route(state["version"])  # generators resume on the trained policy
    writer = MetricWriter(run_dir, cfg.metrics, resume_step=state["step"] if resume_from else None)
    await discard_pending()  # services reused from an earlier run may still hold its values

    async def rollout_loop() -> None:
        while True:
            try:
                await rollout_once()
            except Exception as e:  # one bad rollout (prompt, reward, replica) never ends the run
                record_metric("rollout_errors", 1, Reduce.SUM)
                tqdm.write(f"grpo: rollout failed: {type(e).__name__}: {e}")

    async def rollout_once() -> None:
        if cfg.max_staleness == 0:  # on-policy: start only on the weights the next batch trains
            while await gen.policy_version.route() < state["on_policy"]:
                await asyncio.sleep(0.02)
        start = time.perf_counter()
        group, scores = await rollout(next(prompts), gen, rewards, cfg)
        record_metric("time/rollout_s", time.perf_counter() - start)  # one group: generation + scoring
        episodes = make_group(group, scores, std_normalize=cfg.trainer.loss.name != "dr_grpo")
        record_metric("generated_tokens", sum(len(c.token_ids) for c in group), Reduce.SUM)
        for s in scores:
            record_metric("rollout_reward", s["reward"])
            record_metric("reward_failures", s["reward_failed"], Reduce.SUM)
        await buffer.add.call_one(episodes)

    async def save() -> None:
        path = checkpoint.step_dir(run_dir, state["step"])
        await trainer.save.fanout(str(path / "trainer"))
        checkpoint.save_run_state(path, {**state, "prompts": prompts.state_dict(),
                                         "buffer": await buffer.state_dict.call_one()})

    rollouts = [asyncio.create_task(rollout_loop()) for _ in range(cfg.rollout_tasks)]
    bar = tqdm(total=cfg.steps, initial=state["step"], desc="grpo", unit="step")
    row: dict[str, float] = {}
    plotted = time.monotonic()
    try:
        while state["step"] < cfg.steps:
            t0 = time.perf_counter()
            episodes = await buffer.sample.call_one(cfg.batch_size, state["version"])
            state["on_policy"] = state["version"] + 1  # rollouts from here on are for the next batch
            t1 = time.perf_counter()
            batch = collate(episodes, pad_id=0)
            if ref is not None:
                batch.ref_logprobs = await ref.logprobs.route(batch)
            t2 = time.perf_counter()
            for key, value in (await trainer.train_step.route(batch)).items():
                record_metric(key, value)
            t3 = time.perf_counter()
            state["version"] += 1
            await trainer.push_weights.route(state["version"])  # returns once published
            await buffer.notify_version.call_one(state["version"])
            state["step"] += 1
            for e in episodes:
                record_metric("reward_mean", e.reward)
                record_metric("reward_std", e.reward, Reduce.STD)
                record_metric("accuracy", e.rewards["correct"])
                record_metric("staleness_mean", state["version"] - 1 - e.policy_version)
                record_metric("staleness_max", state["version"] - 1 - e.policy_version, Reduce.MAX)
            wall = time.perf_counter() - t0
            record_metric("tokens_per_s", sum(e.num_response_tokens for e in episodes) / wall)
            for name, seconds in (("wait_s", t1 - t0), ("ref_s", t2 - t1), ("train_s", t3 - t2), ("push_s", wall - (t3 - t0))):
                record_metric(f"time/{name}", seconds)
            row = await writer.flush(state["step"])
            if time.monotonic() - plotted > 10:  # matplotlib costs ~0.2 s: not every step
                plot_rewards(run_dir)
                plotted = time.monotonic()
            bar.update()
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", acc=f"{row['accuracy']:.2f}",
                            tok_s=f"{row['tokens_per_s']:.0f}")
            if cfg.checkpoint_every and state["step"] % cfg.checkpoint_every == 0:
                await save()
        if cfg.checkpoint_every and state["step"] % cfg.checkpoint_every:
            await save()  # the final state, unless the loop just saved it
        await trainer.export_hf.route(str(run_dir / "model"))  # the trained policy, HF format
    except (KeyboardInterrupt, asyncio.CancelledError):
        print(f"\ngrpo: interrupted at step {state['step']}; saving a checkpoint", flush=True)
        await asyncio.shield(save())
    finally:
        for t in rollouts:
            t.cancel()
        await asyncio.gather(*rollouts, return_exceptions=True)
        bar.close()
        writer.close()
        if (run_dir / "metrics.jsonl").exists():
            plot_rewards(run_dir)
        await asyncio.shield(buffer.shutdown())
    return row


def main(cfg: Config) -> dict[str, float]:
    return asyncio.run(run(cfg))


if __name__ == "__main__":
    from forge.cli import run_app

    run_app("grpo")
