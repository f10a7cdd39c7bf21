"""`forge eval`: an app config's eval (its `eval` section, rewards and generator settings) of a
model: prints a table, writes JSON.

    forge eval CONFIG [key=value ...] --model MODEL [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from forge import logs
from forge.cli import app_config, fail
from forge.config import ConfigError
from forge.lora import read_adapter
from forge.schema import ADAPTER_CONFIG
from services.evals import evaluate, held_out
from services.gateway import base_of, model_dir
from services.generator import Generator
from services.rewards import Rewards


async def evaluate_model(app_cfg: Any, model: str) -> dict[str, float]:
    """The eval of `model` (an HF directory, a LoRA adapter's PEFT directory, or a run directory
    with its exported model/ of either kind)."""
    samples = held_out(app_cfg.eval, app_cfg.task)
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


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(prog="forge eval", description=__doc__.splitlines()[0])
    p.add_argument("config", help="an app's YAML config: its `eval` section, rewards and generator settings")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. eval.n=8 'eval.k=[1,8]'")
    p.add_argument("--model", required=True, help="an HF model directory, or a run directory (its exported model/)")
    p.add_argument("--out", help="the JSON file (default: eval.json in the model directory)")
    a, extra = p.parse_known_args(argv)
    if not all("=" in x and not x.startswith("-") for x in extra):
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    overrides = a.overrides + extra  # key=value overrides after --model
    try:
        _, cfg = app_config(a.config, overrides)
        if not hasattr(cfg, "eval"):
            raise ConfigError(f"config key 'app': the {cfg.app} app has no eval section")
        path = model_dir(a.model)
    except (ConfigError, FileNotFoundError) as e:
        fail(str(e))
    logs.capture(Path("runs") / "eval" / "logs")
    result = asyncio.run(evaluate_model(cfg, str(path)))
    print(f"{'metric':<24}{'value':>10}")
    for key, value in result.items():
        print(f"{key:<24}{value:>10.4g}")
    target = Path(a.out) if a.out else path / "eval.json"
    target.write_text(json.dumps({"model": str(path), "config": a.config, **result}, indent=2) + "\n")
    print(f"forge eval: {len(result)} metrics of {path} -> {target}")
    return result


if __name__ == "__main__":
    main()
