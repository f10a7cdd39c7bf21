"""The roles of a GRPO run: the weight store, trainer, generators and the WeightSync between
them, rewards, the reference, the teachers (on-policy distillation), the critic (PPO), and for
agentic runs the gateway and the agent or environment pool.

    roles = await Roles.start(cfg)    # cfg: apps/grpo.py's Config
    ...
    await roles.shutdown()

Several LoRA runs can share the weight store and one generator service (`Shared`): each
run's requests then name its adapter.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forge.actor import SpawnOptions
from forge.config import ConfigError, require_file
from forge.job import Job
from forge.store import start_store, stop_store
from forge.weight_sync import WeightSync
from services.agentic import AgentPool
from services.envs import EnvPool
from services.gateway import Gateway
from services.generator import Generator, RunGenerator
from services.reference import Reference
from services.rewards import Rewards
from services.tiny_model import WarmStart, resolve_model
from services.trainer import Trainer, weight_store


@dataclass
class Roles:
    """What a GRPO run (apps/grpo.py) talks to, each role on its job host. Spawned once per
    run; a benchmark reuses them across runs."""

    store: Any
    trainer: Any
    gen: Any
    weights: WeightSync  # the policy version the generators serve
    rewards: Any | None  # None: no reward in the run (algorithm `distill`)
    ref: Any | None
    gateway: Gateway | None = None  # the OpenAI API over `gen`, for agents and environments
    pool: Any | None = None  # an agentic run's: the agent pool, or the environment pool
    eval_rewards: Any | None = None  # the eval's own rewards, when `eval.rewards` differs from the run's
    job: Job | None = None  # the Monarch job whose hosts run the roles
    shared: Shared | None = None  # the store and generator this run shares with others
    teachers: list[Any] = field(default_factory=list)  # cfg.distill.teachers' services, in order
    critic: Any | None = None  # PPO's value model: a Trainer with a score head

    @classmethod
    async def start(cls, cfg: Any, warm_start: WarmStart | None = None, shared: Shared | None = None) -> Roles:
        """The roles `cfg` (the GRPO app's Config) asks for, on its model (built and
        warm-started by `warm_start` first, when the config says so); with `shared`, on the
        store and generator of several runs."""
        model = shared.model if shared is not None else str(resolve_model(cfg.model, warm_start))
        for i, teacher in enumerate(cfg.distill.teachers):  # before anything spawns
            check_tokenizer(model, teacher.path, f"distill.teachers[{i}].path")
        if cfg.algorithm == "ppo" and cfg.ppo.critic_path:
            check_tokenizer(model, cfg.ppo.critic_path, "ppo.critic_path")
        job = shared.job if shared is not None else Job(cfg.job)
        stack = contextlib.AsyncExitStack()  # what has started, stopped in reverse if a later role fails
        try:
            hosts = job.hosts
            store = (
                shared.store if shared is not None else started(stack, await start_store(hosts("store")), stop_store)
            )
            weights = weight_store(cfg.trainer)  # the run's versions
            trainer = started(
                stack,
                await Trainer.options(
                    procs=cfg.trainer_procs, hosts=hosts("trainer"), max_restores=cfg.trainer_restores
                ).as_service(model, cfg.trainer, weights),
            )
            gen = (
                RunGenerator(shared.gen, cfg.run_name)
                if shared is not None
                else started(
                    stack,
                    await generator_options(cfg, hosts("generator")).as_service(
                        model, cfg.generator, weights, cfg.trainer.lora
                    ),
                )
            )
            sync = WeightSync(trainer, gen)
            await sync.start()
            stack.push_async_callback(sync.stop)
            rewards = (
                started(
                    stack,
                    await Rewards.options(
                        replicas=cfg.rewards.replicas, hosts=hosts("rewards"), spread=True
                    ).as_service(cfg.rewards),
                )
                if cfg.algorithm != "distill"
                else None
            )
            ref = (
                started(stack, await Reference.options(hosts=hosts("reference")).as_service(model))
                if cfg.trainer.loss.kl_coef > 0 and not cfg.trainer.lora.enabled  # LoRA: the trainer's, adapters off
                else None
            )
            s = cls(store, trainer, gen, sync, rewards, ref, job=job, shared=shared)
            for teacher in cfg.distill.teachers:
                s.teachers.append(
                    started(stack, await Reference.options(hosts=hosts("teacher")).as_service(teacher.path))
                )
            if cfg.algorithm == "ppo":
                s.critic = started(stack, await spawn_critic(cfg, model, hosts("critic")))
            if cfg.eval.enabled and (cfg.eval.rewards or rewards is None):
                s.eval_rewards = started(
                    stack, await Rewards.options().as_service(cfg.rewards.with_weights(cfg.eval.rewards))
                )
            if cfg.agentic.enabled:
                s.gateway = started(stack, await Gateway.start(gen, model, cfg.agentic.gateway, cfg.generator))
            if cfg.agentic.env:
                s.pool = started(
                    stack,
                    await EnvPool.options(
                        replicas=cfg.agentic.env_replicas, hosts=hosts("envs"), spread=True
                    ).as_service(cfg.agentic.env, cfg.agentic.envs_per_replica),
                )
            if cfg.agentic.agent:
                s.pool = started(
                    stack,
                    await AgentPool.options(
                        replicas=cfg.agentic.agent_replicas, hosts=hosts("envs"), spread=True
                    ).as_service(s.gateway.base_url),
                )
            return s
        except BaseException:
            # A local job's stop() stops nothing: what started goes first (a cluster job's hosts
            # then go with it, and whatever still runs on them: no orphan workers).
            await stop_started(stack)
            if shared is None:
                job.stop()
            raise

    async def shutdown(self) -> None:
        """Stop this run's roles; what it shares with other runs stays (`Shared.shutdown`)."""
        await self.weights.stop()
        if self.pool is not None:  # first: its agents still call the gateway
            await self.pool.shutdown()
        if self.gateway is not None:
            await self.gateway.shutdown()
        own = (self.trainer, self.critic, self.rewards, self.ref, self.eval_rewards, *self.teachers)
        roles = own if self.shared is not None else (*own, self.gen)
        await asyncio.gather(*(r.shutdown() for r in roles if r is not None), return_exceptions=True)
        if self.shared is None:
            await stop_store(self.store)
            if self.job is not None:
                self.job.stop()


@dataclass
class OwnGPUs(SpawnOptions):
    """Replicas spread over a job mesh, each on GPUs of its own: the k-th replica on a host takes
    its GPUs k x gpus to (k + 1) x gpus - 1 (as the host's worker numbers them), where vLLM would
    otherwise put every one on the host's first."""

    gpus: int = 1

    def for_replica(self, index: int) -> SpawnOptions:
        placed = super().for_replica(index)
        if placed is self:  # this host: its replicas share its GPUs
            return placed
        (_, n), *_ = self.hosts.sizes.items()
        first = index // n * self.gpus
        visible = ",".join(str(gpu) for gpu in range(first, first + self.gpus))
        return dataclasses.replace(placed, env={**placed.env, "CUDA_VISIBLE_DEVICES": visible})


def generator_options(cfg: Any, hosts: Any) -> SpawnOptions:
    """The generator service's replicas (`cfg`: the GRPO app's Config), spread over `hosts`."""
    return OwnGPUs(Generator, replicas=cfg.generator_replicas, hosts=hosts, spread=True, gpus=cfg.generator_gpus())


async def spawn_critic(cfg: Any, model: str, hosts: Any) -> Any:
    """PPO's critic: a Trainer of its own (a copy of the model, not the policy's weights: the
    two train apart, and sharing a base would tie the policy's memory to the critic's), a score
    head on the policy's checkpoint or `ppo.critic_path`. It is not restored in place when it
    dies (max_restores 0): the run stops, and `--resume` restores it with the policy."""
    path = cfg.ppo.critic_path or model
    critic_cfg = dataclasses.replace(cfg.ppo.critic, weights=f"{cfg.trainer.weights}.critic")  # never pushed
    return await Trainer.options(procs=cfg.ppo.critic_procs, hosts=hosts, max_restores=0).as_service(
        path, critic_cfg, weight_store(critic_cfg)
    )


def started(stack: contextlib.AsyncExitStack, role: Any, stop: Any = None) -> Any:
    """`role`, just started, pushed on `stack`: `stop_started(stack)` stops it with `stop(role)`
    (by default its `shutdown()`)."""
    stack.push_async_callback(stop or (lambda r: r.shutdown()), role)
    return role


async def stop_started(stack: contextlib.AsyncExitStack) -> None:
    """Stop what `stack` holds, newest first, after a role failed to start: the failure that
    is being raised says why; a role that will not stop must not hide it."""
    with contextlib.suppress(Exception):
        await stack.aclose()


def check_tokenizer(model: str, other: str, key: str) -> None:
    """A teacher or a critic scores the policy's tokens: it must read them as the policy does
    (the same vocabulary and special tokens, as transformers loads them, whatever files hold
    them), else its numbers are of other strings. Tokenizers that do not load cannot be
    compared: refused too."""
    require_file(key, Path(other) / "config.json")
    if _tokenizer(model, key, other) != _tokenizer(other, key, other):
        raise ConfigError(
            f"config key '{key}': {other} does not have the policy's tokenizer ({model}); "
            "it scores the policy's own tokens"
        )


def _tokenizer(path: str, key: str, other: str) -> tuple[dict[str, int], list[str]]:
    """What says which string each of `path`'s token ids is: its vocabulary and special tokens."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # any of the ways a directory can fail to be a tokenizer
        raise ConfigError(
            f"config key '{key}': cannot tell whether {other} has the policy's tokenizer: {path}'s does "
            f"not load ({type(e).__name__}: {e})"
        ) from None
    return tokenizer.get_vocab(), sorted(tokenizer.all_special_tokens)


@dataclass
class Shared:
    """What several GRPO runs at once share (apps/grpo.py `run_together`): the weight store's
    processes, and one generator service that serves their base model and each run's LoRA adapter;
    each run's requests name it (Generator `tenants`). Each run keeps its own trainer, rewards,
    buffer, checkpoints and metrics."""

    model: str  # the base model's directory
    store: Any
    gen: Any
    job: Job

    @classmethod
    async def start(cls, cfgs: list[Any], warm_start: WarmStart | None = None) -> Shared:
        """For the runs of `cfgs` (the GRPO app's Configs): each trains a LoRA adapter of the same
        base model. Their versions are published under their run names."""
        check_shareable(cfgs)
        model = str(resolve_model(cfgs[0].model, warm_start))  # every run's (checked): built, if need be, once
        for cfg in cfgs:
            cfg.trainer.weights = cfg.run_name  # each run's versions under its own name in the one store
        job = Job(cfgs[0].job)
        stack = contextlib.AsyncExitStack()
        try:
            store = started(stack, await start_store(job.hosts("store")), stop_store)
            tenants = {cfg.run_name: (weight_store(cfg.trainer), cfg.trainer.lora) for cfg in cfgs}
            gen = await generator_options(cfgs[0], job.hosts("generator")).as_service(
                model, cfgs[0].generator, tenants=tenants
            )
            return cls(model, store, gen, job)
        except BaseException:
            await stop_started(stack)  # the store, when the generator fails
            job.stop()
            raise

    async def shutdown(self) -> None:
        await self.gen.shutdown()
        await stop_store(self.store)
        self.job.stop()


def check_shareable(cfgs: list[Any]) -> None:
    """Runs can share a generator when each has a name of its own, trains a LoRA adapter and
    samples without the gateway, and they agree on the generator."""
    names = [cfg.run_name for cfg in cfgs]
    if len(cfgs) < 2 or len(set(names)) < len(names):
        raise ConfigError(f"config key 'run_name': runs sharing a generator need names of their own, got {names}")
    for cfg in cfgs:
        if not cfg.trainer.lora.enabled:
            raise ConfigError(
                f"run {cfg.run_name!r}, config key 'trainer.lora.rank': runs sharing a generator each train "
                "a LoRA adapter (the base weights are everyone's); set a rank > 0"
            )
        if cfg.agentic.enabled:
            raise ConfigError(
                f"run {cfg.run_name!r}, config key 'agentic': runs sharing a generator sample through it "
                "directly; the gateway serves one run"
            )
        if cfg.model.path != cfgs[0].model.path:
            raise ConfigError(
                f"run {cfg.run_name!r}, config key 'model.path': runs sharing a generator share its base model, "
                f"{cfgs[0].model.path!r} (run {cfgs[0].run_name!r}), got {cfg.model.path!r}"
            )
        shared = ("generator", "generator_replicas", "job")
        if [getattr(cfg, key) for key in shared] != [getattr(cfgs[0], key) for key in shared]:
            raise ConfigError(
                f"run {cfg.run_name!r}, config keys {', '.join(shared)}: runs sharing a generator agree on "
                f"them; they differ from run {cfgs[0].run_name!r}'s"
            )
