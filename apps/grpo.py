"""GRPO: generate groups, score them, train, push weights, as concurrent loops.

    forge run configs/grpo_tiny.yaml [key=value ...]       # or: make run
    forge run --resume runs/grpo_tiny                       # continue from the last checkpoint

`max_staleness` picks the mode: 0 = on-policy (rollouts wait for the newest weights),
1 = one-step off-policy, k = fully async. Change the loss with `trainer.loss.name`, the
rewards with `rewards`, the rollout (multi-turn, tools) with `rollout`, what the advantages
come from with `algorithm` (grpo: the group's rewards; ppo: a critic's values; distill: teachers).

`run_together([cfg_a, cfg_b])`: several LoRA runs at once on one generator service.
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from apps.schema import GRPOConfig as Config
from apps.sft import warm_start
from forge.buffer import ReplayBuffer
from forge.config import ConfigError, import_object
from forge.console import report
from forge.losses.advantages import explained_variance, finite_episodes, gae, teacher_advantages, whiten
from forge.metrics import Reduce, metrics_scope, record_metric
from forge.mixture import Mixture, build_prompts, register
from forge.rollout import RolloutLoops, Rollouts, SingleTurn
from forge.run import ActorState, Run
from forge.service import ReplicaRestored
from forge.types import Batch, collate, continued
from services.agentic import AgenticRollouts
from services.evals import BackgroundEvals, held_out
from services.roles import Roles, Shared


async def run(cfg: Config, shared: Shared | None = None) -> dict[str, float]:
    last = cfg.resume_point()
    check_resume(cfg, last)
    roles = await Roles.start(cfg, warm_start, shared)
    try:
        return await train(cfg, roles, resume_from=last)
    finally:
        await asyncio.shield(roles.shutdown())


def check_resume(cfg: Config, last: Path | None) -> None:
    """Before any role starts: a PPO run resumes its critic beside its policy, so the checkpoint
    `last` must hold one (another algorithm's has none: the critic's load would fail only once
    every service runs)."""
    if last is not None and cfg.algorithm == "ppo" and not (last / "critic").is_dir():
        raise ConfigError(
            f"config key 'algorithm': ppo resumes its critic from the checkpoint, and {last} holds none "
            "(a run of another algorithm); resume it with its own, or start a ppo run from its model (model.path)"
        )


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
RKL = {"rkl": ("distill/reverse_kl", ".3f")}  # how far the student is from its teachers
# Distillation alone has no reward: its bar and curves show the teachers' distance (and, as every
# run's, the last eval's accuracy).
DISTILL_BAR = {**RKL, "tok_s": BAR["tok_s"]}
EV = {"ev": ("critic/explained_variance", ".2f")}  # how well PPO's critic predicts the returns


def progress(cfg: Config) -> dict[str, tuple[str, str]]:
    """The bar's figures for the run's algorithm."""
    if cfg.algorithm == "distill":
        return DISTILL_BAR
    return {**BAR, **(RKL if cfg.distill.enabled else {}), **(EV if cfg.algorithm == "ppo" else {})}


async def train(cfg: Config, s: Roles, resume_from: Path | None = None) -> dict[str, float]:
    """The GRPO loop on running roles; returns the last metrics row. Raises RunStopped when
    the run cannot go on (the trainer could not be restored, rollouts keep failing, no batch
    comes), naming the checkpoint to resume from."""
    plots = ("distill/reverse_kl", "eval/accuracy") if cfg.algorithm == "distill" else None
    run = Run("grpo", cfg, resume_from, show=progress(cfg), plot_keys=plots)
    prompts = build_prompts(cfg.dataset, cfg.task, cfg.seed)  # a Mixture with `dataset.mix`
    if "judge" in cfg.rewards.weights and cfg.dataset.enabled:  # one source's rubric fields, now its columns are known
        cfg.rewards.check_judge(prompts.columns)
    prompts.reset()
    buffer = await ReplayBuffer.options().as_actor(
        capacity=cfg.groups_per_step * (cfg.max_staleness + 1),
        max_staleness=cfg.max_staleness,
        max_tokens=cfg.max_episode_tokens,
        dynamic_sampling=cfg.dynamic_sampling,
    )
    held_out_samples = held_out(cfg.eval, cfg.task, cfg.dataset.mix) if cfg.eval.enabled else []
    evals = BackgroundEvals(
        cfg.eval, held_out_samples, s.gen, s.eval_rewards or s.rewards, s.weights, run.writer, "grpo"
    )
    loops = RolloutLoops(rollouts(cfg, s), prompts, buffer, s.weights, cfg)
    restored: ReplicaRestored | None = None
    unregister = register(cfg.run_name, prompts)  # the REPL's handle: forge.mixture.running(run_name)
    try:
        critic = {"critic": s.critic} if s.critic is not None else {}
        await run.start(s.trainer, s.weights, evals, critic, prompts=loops.prompts, buffer=ActorState(buffer))
        async with run, loops.running(run.version):
            while not run.finished:
                try:
                    if restored is not None:  # inside the try: the trainer may die again meanwhile
                        restored = await recover(restored, run, loops, buffer)
                    while run.step < cfg.steps:
                        if isinstance(prompts, Mixture):
                            prompts.between_steps()  # new weights from dataset.mix_file; mix/weight/NAME
                        await step(cfg, s, run, loops, buffer)
                    await run.finish()
                except ReplicaRestored as e:
                    restored = e
    finally:
        unregister()
        await asyncio.shield(buffer.shutdown())
    return run.row


def rollouts(cfg: Config, s: Roles) -> Rollouts:
    """Groups of multi-turn episodes through the gateway (`agentic`), else of the `rollout` function."""
    if cfg.agentic.enabled:
        return AgenticRollouts(
            cfg.agentic,
            s.gateway,
            s.pool,
            cfg.group_size,
            cfg.trainer.loss.normalize_std,
            relative=cfg.algorithm == "grpo",
        )
    return SingleTurn(import_object("rollout", cfg.rollout), cfg.rollout, s.gen, s.rewards, cfg)


def batch_rows(cfg: Config) -> int:
    """What a step's batch's rows are a multiple of: each trainer it goes to (the policy's, and
    PPO's critic) splits it over its ranks and micro-batches."""
    rows = cfg.trainer_ranks() * cfg.trainer.grad_accum
    if cfg.algorithm == "ppo":
        rows = math.lcm(rows, cfg.ppo.critic_procs * cfg.job.hosts("critic") * cfg.ppo.critic.grad_accum)
    return rows


async def step(cfg: Config, s: Roles, run: Run, loops: RolloutLoops, buffer: Any) -> None:
    """One step: a batch of scored groups (generated beside the loop), train, push weights."""
    t0 = time.perf_counter()
    moves = s.critic is None or run.step >= cfg.ppo.critic_warmup  # PPO's critic warms up alone first
    episodes = await loops.batch(run.version, policy_steps=moves)
    t1 = time.perf_counter()
    batch = collate(episodes, pad_id=0, rows_multiple_of=batch_rows(cfg), share_prefix=cfg.trainer.share_prefix)
    if s.ref is not None:
        # A NaN there would make the KL term's gradient NaN in every weight: its group goes instead.
        batch.ref_logprobs = drop_nonfinite(batch, episodes, await s.ref.logprobs.route(batch), "reference logprobs")
    if s.critic is not None:
        await critic_advantages(cfg, s, batch, episodes)
    if s.teachers:
        await distill(cfg, s, batch, episodes)
    t2 = time.perf_counter()
    policy = s.trainer.train_step.route(batch) if moves else unchanged(run.version)
    (version, metrics), _ = await run.training(asyncio.gather(policy, train_critic(cfg, s, batch)))
    t3 = time.perf_counter()
    if moves:
        await s.weights.push()  # returns once published; the generators load it while they generate
    await buffer.notify_version.call_one(version)
    record_batch(episodes, run.version, metrics, per_source=bool(cfg.dataset.mix))
    wall = time.perf_counter() - t0
    record_metric("tokens_per_s", sum(e.num_response_tokens for e in episodes) / wall)
    for name, seconds in (("wait_s", t1 - t0), ("ref_s", t2 - t1), ("train_s", t3 - t2), ("push_s", wall - (t3 - t0))):
        record_metric(f"time/{name}", seconds)
    await run.end_step(version)


async def unchanged(version: int) -> tuple[int, dict[str, float]]:
    return version, {}


async def critic_advantages(cfg: Config, s: Roles, batch: Batch, episodes: list) -> None:
    """PPO: the critic's values of the batch's tokens, read now (at train time: right whatever
    the samples' staleness), and GAE over each episode's own tokens with its reward at its last
    (a multi-turn episode recorded as several samples: over all of them), whitened over the
    batch. The values and returns stay in the batch for the critic's step; a group with a value
    that is not finite leaves it (`drop_nonfinite`)."""
    t0 = time.perf_counter()
    values = await s.critic.values.route(batch)
    rewards = torch.tensor([e.reward for e in episodes], dtype=values.dtype)
    advantages, returns = gae(batch, values, rewards, cfg.ppo.gamma, cfg.ppo.lam, continues=continued(episodes))
    advantages = drop_nonfinite(batch, episodes, advantages, "critic values")
    own = (batch.loss_mask > 0) & (batch.doc_ids >= 0)
    # 0 off the tokens the critic learns: what it read there (a prompt's, a dropped group's) never counts.
    batch.values, batch.returns = torch.where(own, values, 0.0), torch.where(own, returns, 0.0)
    batch.advantages = whiten(advantages, own)
    record_metric("critic/explained_variance", explained_variance(batch.values, batch.returns, own))
    record_metric("time/critic_values_s", time.perf_counter() - t0)


def drop_nonfinite(batch: Batch, episodes: list, advantages: torch.Tensor, what: str) -> torch.Tensor:
    """`advantages` without the groups of the episodes where they are not finite (the `what`,
    a critic's, a teacher's or the reference's, NaN or inf on one of their loss tokens): those
    groups leave the batch (loss mask 0, advantage 0), counted (`groups_nonfinite`) and reported,
    as a rollout's group whose advantages are not finite; the rest of the batch trains."""
    finite = finite_episodes(batch, advantages)
    if bool(finite.all()):
        return advantages
    group = torch.tensor([e.group if e.group >= 0 else len(episodes) + i for i, e in enumerate(episodes)])
    dropped = torch.isin(group, group[~finite])
    off = dropped[batch.doc_ids.clamp(min=0)] & (batch.doc_ids >= 0)
    batch.loss_mask = torch.where(off, 0.0, batch.loss_mask)
    record_metric("groups_nonfinite", int(group[dropped].unique().numel()), Reduce.SUM)
    report(
        "groups not trained on",
        f"the {what} of {int((~finite).sum())} episode(s) are not finite: their groups "
        f"({int(dropped.sum())} episodes) are not trained on",
    )
    return torch.where(off, 0.0, advantages)


async def train_critic(cfg: Config, s: Roles, batch: Batch) -> None:
    """The critic's `ppo.critic_updates` steps toward the batch's returns (none without one),
    beside the policy's step: they share nothing but the batch."""
    if s.critic is None:
        return
    t0 = time.perf_counter()
    for _ in range(cfg.ppo.critic_updates):
        _, metrics = await s.critic.train_step.route(batch)
    for key in ("loss", "value_mean", "value_clip_frac", "grad_norm"):
        record_metric(f"critic/{key}", metrics[key])
    record_metric("time/critic_train_s", time.perf_counter() - t0)


async def distill(cfg: Config, s: Roles, batch: Batch, episodes: list) -> None:
    """The teachers' per-token advantages, instead of the rewards' (algorithm `distill`) or added
    to them. Scored here, at train time, on the tokens as sampled, whatever their staleness;
    each teacher weighs in on the episodes of the data sources it names."""
    teacher_logprobs = await asyncio.gather(*(t.logprobs.route(batch) for t in s.teachers))
    on_token, own = batch.doc_ids.clamp(min=0), batch.doc_ids >= 0
    # float64: a teacher's weight, however small, stays above 0
    per_episode = [
        torch.tensor([t.weight if t.scores(e.task) else 0.0 for e in episodes], dtype=torch.float64)
        for t in cfg.distill.teachers
    ]
    weights = [torch.where(own, w[on_token], 0.0) for w in per_episode]
    advantages, reverse_kl = teacher_advantages(batch, list(teacher_logprobs), weights, cfg.distill.coef)
    advantages = drop_nonfinite(batch, episodes, advantages, "teacher logprobs")
    # The mean over the tokens a teacher scores: another source's have no reverse KL (not 0 of one).
    scored = (batch.loss_mask > 0) & (sum(weights) > 0)
    reverse_kl = torch.where(scored, reverse_kl, 0.0)
    batch.advantages = advantages if cfg.algorithm == "distill" else batch.advantages + advantages
    if bool(scored.any()):
        record_metric("distill/reverse_kl", float(reverse_kl.sum() / scored.sum()))


def record_batch(episodes: list, trained_on: int, metrics: dict[str, float], per_source: bool = False) -> None:
    """A step's metrics: the trainer's, and the episodes' (with `per_source`, also each data
    source's reward and accuracy: reward/NAME, accuracy/NAME). An episode recorded as several
    samples (`Episode.part`) has one reward, counted once; staleness is each sample's."""
    for key, value in metrics.items():
        record_metric(key, value)
    for e in episodes:
        record_metric("staleness_mean", trained_on - e.policy_version)
        record_metric("staleness_max", trained_on - e.policy_version, Reduce.MAX)
        if e.part is not None and e.part[1] > 0:  # its episode's reward is its first sample's
            continue
        record_metric("reward_mean", e.reward)
        record_metric("reward_std", e.reward, Reduce.STD)
        if per_source:
            record_metric(f"reward/{e.task}", e.reward)
        if e.score.correct is not None:
            record_metric("accuracy", e.score.correct)
            if per_source:
                record_metric(f"accuracy/{e.task}", e.score.correct)


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
