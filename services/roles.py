"""The roles of a GRPO run: the weight store, trainer, generators and the WeightSync between
them, rewards, the reference, and for agentic runs the gateway and the environment pool.

    roles = await Roles.start(cfg)    # cfg: apps/grpo.py's Config
    ...
    await roles.shutdown()
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from forge.job import Job
from forge.store import start_store, stop_store
from forge.weight_sync import WeightSync
from services.envs import EnvPool
from services.gateway import Gateway
from services.generator import Generator
from services.reference import Reference
from services.rewards import Rewards
from services.tiny_model import WarmStart
from services.trainer import Trainer, weight_store


@dataclass
class Roles:
    """What a GRPO run (apps/grpo.py) talks to, each role on its job host. Spawned once per
    run; a benchmark reuses them across runs."""

    store: Any
    trainer: Any
    gen: Any
    weights: WeightSync  # the policy version the generators serve
    rewards: Any
    ref: Any | None
    gateway: Gateway | None = None  # the OpenAI API over `gen`, for agents and environments
    envs: Any | None = None  # the environment pool
    eval_rewards: Any | None = None  # the eval's own rewards, when `eval.rewards` differs from the run's
    job: Job | None = None  # the Monarch job whose hosts run the roles

    @classmethod
    async def start(cls, cfg: Any, warm_start: WarmStart | None = None) -> Roles:
        """The roles `cfg` (the GRPO app's Config) asks for, on its model (built and
        warm-started by `warm_start` first, when the config says so)."""
        model = str(cfg.model.resolve(warm_start))
        job = Job(cfg.job)
        try:
            hosts = job.hosts
            store = await start_store(hosts("store"))
            weights = weight_store(cfg.trainer)  # the run's versions
            trainer = await Trainer.options(
                procs=cfg.trainer_procs, hosts=hosts("trainer"), max_restores=cfg.trainer_restores
            ).as_service(model, cfg.trainer, weights)
            gen = await Generator.options(
                replicas=cfg.generator_replicas, hosts=hosts("generator"), spread=True
            ).as_service(model, cfg.generator, weights, cfg.trainer.lora)
            sync = WeightSync(trainer, gen)
            await sync.start()
            rewards = await Rewards.options(hosts=hosts("rewards")).as_service(cfg.rewards)
            ref = (
                await Reference.options(hosts=hosts("reference")).as_service(model)
                if cfg.trainer.loss.kl_coef > 0 and not cfg.trainer.lora.enabled  # LoRA: the trainer's, adapters off
                else None
            )
            s = cls(store, trainer, gen, sync, rewards, ref, job=job)
            if cfg.eval.enabled and cfg.eval.rewards:
                s.eval_rewards = await Rewards.options().as_service(cfg.rewards.with_weights(cfg.eval.rewards))
            if cfg.agentic.enabled:
                s.gateway = await Gateway.start(gen, model, cfg.agentic.gateway, cfg.generator)
            if cfg.agentic.env:
                s.envs = await EnvPool.options(
                    replicas=cfg.agentic.env_replicas, hosts=hosts("envs"), spread=True
                ).as_service(cfg.agentic.env, cfg.agentic.envs_per_replica)
            return s
        except BaseException:
            job.stop()  # its hosts, and whatever already runs on them, go with it: no orphan workers
            raise

    async def shutdown(self) -> None:
        await self.weights.stop()
        if self.gateway is not None:
            await self.gateway.shutdown()
        roles = (self.envs, self.gen, self.trainer, self.rewards, self.ref, self.eval_rewards)
        await asyncio.gather(*(r.shutdown() for r in roles if r is not None), return_exceptions=True)
        await stop_store(self.store)
        if self.job is not None:
            self.job.stop()
