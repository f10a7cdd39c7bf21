"""`forge serve`: a model behind the OpenAI API, through a gateway over generator replicas.

forge serve MODEL [--port 8000] [--replicas 1] [--api-key KEY] [--lora NAME=DIR ...] ...
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from forge import logs
from forge.cli import fail
from forge.schema import ADAPTER_CONFIG
from services import gateway
from services.schema import GeneratorConfig


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="forge serve", description=__doc__.splitlines()[0])
    p.add_argument("model", help="an HF model directory, or a run directory (its exported model/)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1", help="set it to listen beyond this machine")
    p.add_argument("--replicas", type=int, default=1, help="generator replicas (vLLM engines)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("FORGE_API_KEY"),
        help="the key clients must send (default: $FORGE_API_KEY; none needed on 127.0.0.1, required beyond)",
    )
    p.add_argument("--max-model-len", type=int, help="default: the model's own context length")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--chat-template", help="a Jinja file or string (default: the tokenizer's)")
    p.add_argument("--tool-parser", help="a vLLM tool parser, e.g. hermes")
    p.add_argument("--reasoning-parser", help="a vLLM reasoning parser, e.g. qwen3")
    p.add_argument(
        "--prompt-logprobs",
        action="store_true",
        help="take `echo` and `prompt_logprobs` (a distribution per prompt token: for trusted clients)",
    )
    p.add_argument(
        "--lora",
        nargs="+",
        default=[],
        metavar="NAME=DIR",
        help="LoRA adapters (PEFT directories, e.g. a LoRA run's model/) served beside MODEL; the OpenAI "
        "`model` field picks one by NAME, or the base model",
    )
    return p


def adapters(specs: list[str]) -> dict[str, str]:
    """`--lora NAME=DIR ...` as {NAME: DIR}."""
    out = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not (sep and name and path):
            raise ValueError(f"--lora {spec!r}: expected NAME=DIR")
        if not (Path(path) / ADAPTER_CONFIG).is_file():
            raise ValueError(f"--lora {spec!r}: {path} is not a PEFT adapter directory (no {ADAPTER_CONFIG})")
        out[name] = path
    return out


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    cfg = gateway.GatewayConfig(
        host=a.host,
        port=a.port,
        sessions=False,
        api_key=a.api_key,
        chat_template=a.chat_template,
        tool_parser=a.tool_parser,
        reasoning_parser=a.reasoning_parser,
        prompt_logprobs=a.prompt_logprobs,
    )
    try:
        generator = GeneratorConfig(max_model_len=a.max_model_len, dtype=a.dtype, adapters=adapters(a.lora))
        logs.capture(Path("runs") / "serve" / "logs")
        asyncio.run(gateway.serve(a.model, cfg, generator, a.replicas))
    except (FileNotFoundError, ValueError) as e:
        fail(str(e))


if __name__ == "__main__":
    main()
