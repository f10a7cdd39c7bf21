"""`forge eval`: an app config's eval (its `eval` section, rewards and generator settings) of a
model: prints a table, writes JSON.

    forge eval CONFIG [key=value ...] --model MODEL [--out FILE]

forge/cli.py parses the command and checks the config before this module (and torch) loads.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from forge import logs
from forge.cli import fail
from forge.lora import read_adapter
from forge.schema import ADAPTER_CONFIG
from services.evals import evaluate, held_out
from services.gateway import base_of, model_dir
from services.generator import Generator
from services.rewards import Rewards


async def evaluate_model(app_cfg: Any, model: str) -> dict[str, float]:
    """The eval of `model` (an HF directory, a LoRA adapter's PEFT directory, or a run directory
    with its exported model/ of either kind)."""
    dataset = getattr(app_cfg, "dataset", None)  # a mixture's: each source's eval set (the SFT app has `data`)
    samples = held_out(app_cfg.eval, app_cfg.task, dataset.mix if dataset else None)
    model = model_dir(model)
    lora, tensors = read_adapter(model) if (model / ADAPTER_CONFIG).is_file() else (None, {})
    gen = await Generator.options(replicas=getattr(app_cfg, "generator_replicas", 1)).as_service(
        str(base_of(model) if lora else model), app_cfg.generator, lora=lora
    )
    try:
        if lora:  # the adapter is the policy's version 1, on its base model
            await gen.load_weights.fanout(tensors, version=1)
        rewards = await Rewards.options().as_service(app_cfg.rewards.with_weights(app_cfg.eval.rewards))
        try:
            return await evaluate(app_cfg.eval, samples, gen, rewards)
        finally:
            await rewards.shutdown()
    finally:
        await gen.shutdown()


def main(cfg: Any, config: str, model: str, out: str | None = None) -> dict[str, float]:
    """`forge eval` (forge/cli.py parses its options and loads the config `cfg`, from file `config`)."""
    try:
        path = model_dir(model)
    except FileNotFoundError as e:
        fail(str(e))
    target = Path(out) if out else path / "eval.json"
    try:  # before the eval, not after it: a result with nowhere to go is lost
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fail(f"--out {target}: cannot make its directory ({e})")
    if not os.access(target if target.exists() else target.parent, os.W_OK):
        fail(f"--out {target}: not writable (name another file with --out)")
    logs.capture(Path("runs") / "eval" / "logs")
    result = asyncio.run(evaluate_model(cfg, str(path)))
    print(f"{'metric':<24}{'value':>10}")
    for key, value in result.items():
        print(f"{key:<24}{value:>10.4g}")
    text = json.dumps({"model": str(path), "config": config, **result}, indent=2) + "\n"
    try:
        target.write_text(text)
    except OSError as e:
        print(text, end="")  # the result, not lost
        fail(f"--out {target}: {e}; the result is above")
    print(f"forge eval: {len(result)} metrics of {path} -> {target}")
    return result
