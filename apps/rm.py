"""Reward model training: the model with a score head (`trainer.head: score`, one scalar per
token; a sequence's score is its last token's), trained on preference pairs with the
Bradley-Terry loss through the Trainer service (checkpoints, resume); held-out pairwise accuracy
beside the loop; exported as a Hugging Face sequence-classification checkpoint (runs/NAME/model:
`AutoModelForSequenceClassification`), which the `reward_model` reward serves.

    forge run configs/rm_tiny.yaml [key=value ...]
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from apps.dpo import pair_batch
from apps.schema import RMConfig as Config
from apps.sft import warm_start
from forge.data import PreferencePairs
from forge.metrics import record_metric
from forge.run import Run
from forge.store import WeightStore, start_store, stop_store
from services.evals import PairwiseEvals, first
from services.tiny_model import resolve_model
from services.trainer import Trainer

METRICS = ("loss", "grad_norm", "lr", "rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy")


async def run(cfg: Config) -> dict[str, float]:
    last = cfg.resume_point()
    from transformers import AutoTokenizer

    model = resolve_model(cfg.model, warm_start)
    tokenizer = AutoTokenizer.from_pretrained(model)
    pad = tokenizer.pad_token_id or 0
    pairs = PreferencePairs(cfg.data, tokenizer, cfg.task, cfg.seed)  # a bad file stops here, before any spawn
    held_batch = None
    if cfg.eval.enabled:  # a held-out file's rows each once, at most eval.prompts of them, as other evals
        held = PreferencePairs(cfg.held_out, tokenizer, cfg.task, cfg.eval.seed, "eval.dataset")
        held_batch = pair_batch(first(held, cfg.eval.prompts), pad, 1)
    store = await start_store()
    trainer = await Trainer.options(procs=cfg.trainer_procs).as_service(
        str(model), cfg.trainer, WeightStore(cfg.trainer.weights, transport=cfg.trainer.transport)
    )
    try:
        return await train(cfg, pairs, pad, trainer, held_batch, last)
    finally:
        await asyncio.shield(trainer.shutdown())
        await stop_store(store)


async def train(
    cfg: Config, pairs: PreferencePairs, pad_id: int, trainer: Any, held: Any, resume_from: Path | None
) -> dict[str, float]:
    """The reward model's loop on a running trainer; returns the last metrics row."""
    show = {"loss": ("loss", ".3f"), "acc": ("rewards/accuracy", ".2f")}
    run = Run("rm", cfg, resume_from, show=show, plot_keys=("rewards/accuracy", "eval/accuracy"))
    pairs.reset()
    evals = PairwiseEvals(cfg.eval, held, trainer, run.writer, "rm")
    await run.start(trainer, None, evals, examples=pairs)
    async with run:
        while run.step < cfg.steps:
            start = time.perf_counter()
            rows = cfg.trainer_procs * cfg.trainer.grad_accum
            batch = pair_batch([next(pairs) for _ in range(cfg.batch_size)], pad_id, rows, cfg.trainer.share_prefix)
            version, metrics = await run.training(trainer.train_step.route(batch))
            for key in METRICS:
                record_metric(key, metrics[key])
            record_metric("tokens_per_s", metrics["trained_tokens"] / (time.perf_counter() - start))
            await run.end_step(version)
        await run.finish()
    return run.row


def main(cfg: Config) -> dict[str, float]:
    return asyncio.run(run(cfg))


if __name__ == "__main__":
    from forge.cli import run_app

    run_app("rm")
