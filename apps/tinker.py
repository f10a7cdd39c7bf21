"""`forge tinker`: the Tinker API (the `tinker` SDK, the tinker-cookbook's recipes) on this
machine's model, trainer and generators, until Ctrl-C.

    forge tinker configs/tinker_tiny.yaml [key=value ...]
    # then, in any process: tinker.ServiceClient(base_url="http://127.0.0.1:8000", api_key="tml-...")
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
from pathlib import Path

from apps.schema import TinkerAppConfig as Config
from apps.sft import warm_start
from forge.schema import ALL_LINEAR, LoRAConfig
from services import models
from services.generator import Generator
from services.tinker import TinkerFront
from services.tiny_model import resolve_model
from services.trainer import Trainer


def adapters(cfg: Config) -> LoRAConfig:
    """The adapters the model carries: the largest rank a client may ask for, on every linear and
    the head (a client's rank and modules are a part of them: services/tenants.py)."""
    return LoRAConfig(rank=cfg.tinker.max_lora_rank, alpha=cfg.tinker.lora_alpha, targets=[*ALL_LINEAR, "lm_head"])


async def serve(cfg: Config, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    """Start the roles and the server; serve until `stop` is set (by default: SIGINT or SIGTERM)."""
    model = resolve_model(cfg.model, warm_start)
    hf = models.hf_config(model)
    lora = adapters(cfg)
    trainer_cfg = dataclasses.replace(cfg.trainer, lora=lora)
    max_len = cfg.generator.max_model_len or hf.get("max_position_embeddings", 2048)
    roles = []
    try:
        trainer = await Trainer.options(procs=cfg.trainer_procs).as_service(str(model), trainer_cfg)
        roles.append(trainer)
        gen = await Generator.options(replicas=cfg.generator_replicas).as_service(str(model), cfg.generator, None, lora)
        roles.append(gen)
        front = TinkerFront(
            trainer, gen, model, cfg.tinker, cfg.run_dir, hf["vocab_size"], max_len, cfg.generator.sampling.max_tokens
        )
        await front.serve()
        if stop is None:
            stop = asyncio.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        keys = "an API key (tinker.api_keys)" if cfg.tinker.api_keys else "any key starting with tml-"
        print(f"forge tinker: base model {front.base_model!r} on {front.base_url} ({keys}); Ctrl-C stops", flush=True)
        if ready is not None:
            ready.set()
        await stop.wait()
        await front.shutdown()
    finally:
        await asyncio.gather(*(r.shutdown() for r in roles), return_exceptions=True)


def main(cfg: Config) -> None:
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    asyncio.run(serve(cfg))
