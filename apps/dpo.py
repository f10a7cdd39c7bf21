"""Preference training (DPO, or IPO with `trainer.loss.name=ipo`) through the torchtitan Trainer
service: pairs of a chosen and a rejected completion of one prompt (a local file's rows, plain
text or TRL's conversational format, or the toy task's pairs), the reference the frozen
starting policy (a Reference service; with LoRA, the trainer's own model with its adapters off:
no second copy); held-out evals beside the loop, as SFT's.

    forge run configs/dpo_tiny.yaml [key=value ...]
    forge make-dataset --out pairs.jsonl --task reverse --preferences   # toy pairs as a file
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from apps.schema import DPOConfig as Config
from apps.sft import EVAL_PLOT, SupervisedRoles, evals, supervised_roles, warm_start
from forge.data import PreferencePairs
from forge.metrics import record_metric
from forge.run import Run
from forge.types import Batch, Episode, collate
from services.tiny_model import resolve_model

METRICS = ("loss", "grad_norm", "lr", "rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy")


async def run(cfg: Config) -> dict[str, float]:
    last = cfg.resume_point()
    from transformers import AutoTokenizer

    model = resolve_model(cfg.model, warm_start)
    tokenizer = AutoTokenizer.from_pretrained(model)
    pairs = PreferencePairs(cfg.data, tokenizer, cfg.task, cfg.seed)  # a bad file stops here, before any spawn
    async with supervised_roles(cfg, str(model), reference=not cfg.trainer.lora.enabled) as roles:
        return await train(cfg, pairs, tokenizer.pad_token_id or 0, roles, last)


def pair_batch(pairs: list, pad_id: int, rows_multiple_of: int, share_prefix: bool = False) -> Batch:
    """Pair k as episodes 2k (chosen) and 2k+1 (rejected), packed into one row (their prompt
    once, with `share_prefix`)."""
    episodes = [Episode(ids, mask, [0.0] * len(ids)) for pair in pairs for ids, mask in pair]
    return collate(
        episodes, pad_id=pad_id, rows_multiple_of=rows_multiple_of, keep_together=2, share_prefix=share_prefix
    )


async def train(
    cfg: Config, pairs: PreferencePairs, pad_id: int, roles: SupervisedRoles, resume_from: Path | None
) -> dict[str, float]:
    """The DPO loop on running roles; returns the last metrics row."""
    show = {"loss": ("loss", ".3f"), "acc": ("rewards/accuracy", ".2f"), "margin": ("rewards/margin", ".2f")}
    run = Run("dpo", cfg, resume_from, show=show, plot_keys=EVAL_PLOT, pushes_every_step=False)
    pairs.reset()
    await run.start(roles.trainer, roles.weights, evals(cfg, roles, run), examples=pairs)
    async with run:
        while run.step < cfg.steps:
            start = time.perf_counter()
            rows = cfg.trainer_procs * cfg.trainer.grad_accum
            batch = pair_batch([next(pairs) for _ in range(cfg.batch_size)], pad_id, rows, cfg.trainer.share_prefix)
            if roles.ref is not None:
                batch.ref_logprobs = await roles.ref.logprobs.route(batch)
            _, metrics = await run.training(roles.trainer.train_step.route(batch))
            for key in METRICS:
                record_metric(key, metrics[key])
            record_metric("tokens_per_s", metrics["trained_tokens"] / (time.perf_counter() - start))
            await run.end_step()
        await run.finish()
    return run.row


def main(cfg: Config) -> dict[str, float]:
    return asyncio.run(run(cfg))


if __name__ == "__main__":
    from forge.cli import run_app

    run_app("dpo")
