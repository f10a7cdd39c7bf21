"""Supervised fine-tuning through the torchtitan Trainer service GRPO uses (FSDP2, DCP
checkpoints, resume, HF export): a local dataset file of chat `messages` rows (loss on the
assistant turns only) or prompt/completion rows, or a toy task, optionally packed several to a
row (`data.pack_to`); held-out evals beside the loop.

    forge run configs/sft_tiny.yaml [key=value ...]
    forge run --resume runs/sft_tiny                 # continue from the last checkpoint
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from apps.schema import SFTConfig as Config
from apps.schema import SupervisedConfig
from forge.data import SFTExamples
from forge.metrics import record_metric
from forge.run import Run
from forge.schema import LossConfig, SFTDataConfig
from forge.store import WeightStore, start_store, stop_store
from forge.types import Episode, collate
from forge.weight_sync import WeightSync
from services.evals import BackgroundEvals, held_out
from services.generator import Generator
from services.reference import Reference
from services.rewards import Rewards
from services.schema import EvalConfig, ModelConfig, TinyModelSpec, TrainerConfig
from services.tiny_model import resolve_model
from services.trainer import Trainer

EVAL_PLOT = ("eval/accuracy", "eval/reward_mean")  # SFT's curves: it has no rewards of its own


async def run(cfg: Config) -> dict[str, float]:
    last = cfg.resume_point()
    from transformers import AutoTokenizer

    model = resolve_model(cfg.model, warm_start)
    tokenizer = AutoTokenizer.from_pretrained(model)
    # A bad file stops here, before any spawn.
    examples = SFTExamples(cfg.data, tokenizer, cfg.task, cfg.seed)
    async with supervised_roles(cfg, str(model)) as roles:
        return await train(cfg, examples, tokenizer.pad_token_id or 0, roles, last)


@dataclass
class SupervisedRoles:
    """What a supervised app (SFT, DPO) talks to: its trainer; for evals, a generator, the
    WeightSync from the trainer to it and the eval's rewards; the frozen reference, if asked for."""

    trainer: Any
    gen: Any = None
    weights: WeightSync | None = None
    rewards: Any = None
    ref: Any = None


@contextlib.asynccontextmanager
async def supervised_roles(
    cfg: SupervisedConfig, model: str, reference: bool = False
) -> AsyncIterator[SupervisedRoles]:
    """The roles `cfg` asks for (a generator and rewards when it evaluates; a Reference of
    `model` with `reference`), stopped on the way out."""
    store = await start_store()
    weights = WeightStore(cfg.trainer.weights, transport=cfg.trainer.transport)
    spawned: list[Any] = []
    roles: SupervisedRoles | None = None
    try:
        roles = SupervisedRoles(await Trainer.options(procs=cfg.trainer_procs).as_service(model, cfg.trainer, weights))
        spawned.append(roles.trainer)
        if reference:
            roles.ref = await Reference.options().as_service(model)
            spawned.append(roles.ref)
        if cfg.eval.enabled:
            roles.gen = await Generator.options().as_service(model, cfg.generator, weights, cfg.trainer.lora)
            spawned.append(roles.gen)
            roles.weights = WeightSync(roles.trainer, roles.gen)
            await roles.weights.start()
            roles.rewards = await Rewards.options().as_service(cfg.rewards.with_weights(cfg.eval.rewards))
            spawned.append(roles.rewards)
        yield roles
    finally:
        if roles is not None and roles.weights is not None:
            await roles.weights.stop()
        await asyncio.shield(asyncio.gather(*(r.shutdown() for r in spawned), return_exceptions=True))
        await stop_store(store)


async def train(
    cfg: Config, examples: SFTExamples, pad_id: int, roles: SupervisedRoles, resume_from: Path | None
) -> dict[str, float]:
    """The SFT loop on running roles; returns the last metrics row."""
    run = Run("sft", cfg, resume_from, show={"loss": ("loss", ".3f")}, plot_keys=EVAL_PLOT, pushes_every_step=False)
    examples.reset()
    await run.start(roles.trainer, roles.weights, evals(cfg, roles, run), examples=examples)
    async with run:
        while run.step < cfg.steps:
            start = time.perf_counter()
            rows = [next(examples) for _ in range(cfg.batch_size)]
            batch = collate(
                [Episode(ids, mask, [0.0] * len(ids), advantage=1.0) for ids, mask in rows],
                pad_id=pad_id,
                pack_to=cfg.data.pack_to,
                rows_multiple_of=cfg.trainer_procs * cfg.trainer.grad_accum,
            )
            _, metrics = await run.training(roles.trainer.train_step.route(batch))
            for key in ("loss", "entropy", "grad_norm", "lr", "trained_tokens"):
                record_metric(key, metrics[key])
            record_metric("tokens_per_s", metrics["trained_tokens"] / (time.perf_counter() - start))
            await run.end_step()
        await run.finish()
    return run.row


def evals(cfg: SupervisedConfig, roles: SupervisedRoles, run: Run) -> BackgroundEvals:
    """Held-out evals of the trained policy beside the loop (none when `cfg.eval` is off)."""
    samples = held_out(cfg.eval, cfg.task) if cfg.eval.enabled else []
    return BackgroundEvals(cfg.eval, samples, roles.gen, roles.rewards, roles.weights, run.writer, cfg.app)


def warm_start(model_dir: Path, spec: TinyModelSpec) -> float:
    """The supervised warm start of `model_dir`, in place: a run of the SFT app (the Trainer
    service) on fresh samples of the spec's task (or its reasoning-gym generator), answers
    `sft_noise`-corrupted. Returns the
    final loss. It runs on its own event loop in a thread, as model resolution may happen
    inside an app's running loop."""
    cfg = Config(
        run_name=model_dir.name + ".sft",
        runs_dir=str(model_dir.parent),
        seed=spec.seed,
        task=spec.task,
        data=SFTDataConfig(noise=spec.sft_noise, system=spec.sft_system, reasoning_gym=spec.sft_reasoning_gym),
        model=ModelConfig(path=str(model_dir)),
        steps=spec.sft_steps,
        batch_size=spec.sft_batch_size,
        # Decaying the LR to 0 averages out the demonstrations' noise, so greedy answers follow the
        # majority: at a constant 3e-3, 300 steps left the reverse toy's greedy accuracy at 0.49,
        # 0.14 or 0.59 depending on the seed; with cosine decay 1.0, 0.64, 0.95.
        trainer=TrainerConfig(
            lr=spec.sft_lr, lr_decay="cosine", warmup_steps=min(10, spec.sft_steps // 10), loss=LossConfig(name="sft")
        ),
        checkpoint_every=0,
        eval=EvalConfig(every=0),
        metrics=[],
    )
    cfg.validate()
    try:
        with ThreadPoolExecutor(1) as pool:
            row = pool.submit(asyncio.run, run(cfg)).result()
        shutil.copy(cfg.run_dir / "model" / "model.safetensors", model_dir / "model.safetensors")
    finally:
        shutil.rmtree(cfg.run_dir, ignore_errors=True)
    return row["loss"]


def main(cfg: Config) -> dict[str, float]:
    return asyncio.run(run(cfg))


if __name__ == "__main__":
    from forge.cli import run_app

    run_app("sft")
