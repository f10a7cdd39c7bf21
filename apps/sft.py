"""Supervised fine-tuning through the torchtitan Trainer service GRPO uses (FSDP2, DCP
checkpoints, resume, HF export): a local dataset file of chat `messages` rows (loss on the
assistant turns only) or prompt/completion rows, or a toy task, optionally packed several to a
row (`data.pack_to`); held-out evals beside the loop.

    forge run configs/sft_tiny.yaml [key=value ...]
    forge run --resume runs/sft_tiny                 # continue from the last checkpoint
"""

from __future__ import annotations

import asyncio
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from apps.schema import SFTConfig as Config
from forge.data import SFTExamples
from forge.metrics import record_metric
from forge.run import Run
from forge.schema import LossConfig, SFTDataConfig
from forge.store import WeightStore, start_store, stop_store
from forge.types import Episode, collate
from forge.weight_sync import WeightSync
from services.evals import BackgroundEvals, held_out
from services.generator import Generator
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
    store = await start_store()
    weights = WeightStore(cfg.trainer.weights, transport=cfg.trainer.transport)
    roles: list[Any] = []
    gen = rewards = sync = None
    try:
        trainer = await Trainer.options(procs=cfg.trainer_procs).as_service(str(model), cfg.trainer, weights)
        roles.append(trainer)
        if cfg.eval.enabled:
            gen = await Generator.options().as_service(str(model), cfg.generator, weights, cfg.trainer.lora)
            roles.append(gen)
            sync = WeightSync(trainer, gen)
            await sync.start()
            rewards = await Rewards.options().as_service(cfg.rewards.with_weights(cfg.eval.rewards))
            roles.append(rewards)
        return await train(cfg, examples, tokenizer.pad_token_id or 0, trainer, gen, sync, rewards, last)
    finally:
        if sync is not None:
            await sync.stop()
        await asyncio.shield(asyncio.gather(*(r.shutdown() for r in roles), return_exceptions=True))
        await stop_store(store)


async def train(
    cfg: Config,
    examples: SFTExamples,
    pad_id: int,
    trainer: Any,
    gen: Any,
    weights: WeightSync | None,
    rewards: Any,
    resume_from: Path | None,
) -> dict[str, float]:
    """The SFT loop on running services (`gen`, `weights` and `rewards` for evals, else None);
    returns the last metrics row."""
    run = Run("sft", cfg, resume_from, show={"loss": ("loss", ".3f")}, plot_keys=EVAL_PLOT, pushes_every_step=False)
    examples.reset()
    evals = BackgroundEvals(
        cfg.eval, held_out(cfg.eval, cfg.task) if cfg.eval.enabled else [], gen, rewards, weights, run.writer, "sft"
    )
    await run.start(trainer, weights, evals, examples=examples)
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
            _, metrics = await trainer.train_step.route(batch)
            for key in ("loss", "entropy", "grad_norm", "lr", "trained_tokens"):
                record_metric(key, metrics[key])
            record_metric("tokens_per_s", metrics["trained_tokens"] / (time.perf_counter() - start))
            await run.end_step()
        await run.finish()
    return run.row


def warm_start(model_dir: Path, spec: TinyModelSpec) -> float:
    """The supervised warm start of `model_dir`, in place: a run of the SFT app (the Trainer
    service) on fresh samples of the spec's task, answers `sft_noise`-corrupted. Returns the
    final loss. It runs on its own event loop in a thread, as model resolution may happen
    inside an app's running loop."""
    cfg = Config(
        run_name=model_dir.name + ".sft",
        runs_dir=str(model_dir.parent),
        seed=spec.seed,
        task=spec.task,
        data=SFTDataConfig(noise=spec.sft_noise, system=spec.sft_system),
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
