"""`forge make-tiny-model`: build the offline tiny model and its tokenizer (HF format),
optionally warm-started by a short run of the SFT app on a toy task.

    forge make-tiny-model --out DIR [--family qwen3|llama3|qwen3_moe|hf] [--task add] [--sft-steps N] [--sft-noise F] [--seed S] [--force]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from apps.sft import warm_start
from forge import tasks
from forge.cli import fail
from services import models
from services.schema import TinyModelSpec
from services.tiny_model import BUILD_FILE, make_tiny_model


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(prog="forge make-tiny-model", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output directory (HF format)")
    p.add_argument("--task", default="add", help="toy task for the warm start")
    p.add_argument(
        "--sft-steps", type=int, default=0, help="warm-start steps of the SFT app on the task (0: random init)"
    )
    p.add_argument("--sft-noise", type=float, default=0.0, help="fraction of warm-start answer characters made random")
    p.add_argument("--family", default="qwen3", help=f"model family ({', '.join(models.NAMES)})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    a = p.parse_args(argv)
    if a.task not in tasks.TASKS:
        fail(f"--task: unknown task {a.task!r}; known: {', '.join(sorted(tasks.TASKS))}")
    if a.family not in models.NAMES:
        fail(f"--family: unknown model family {a.family!r}; known: {', '.join(models.NAMES)}")
    if a.sft_steps < 0:
        fail(f"--sft-steps: must be >= 0, got {a.sft_steps}")
    if not 0 <= a.sft_noise <= 1:
        fail(f"--sft-noise: must be in [0, 1], got {a.sft_noise}")
    spec = TinyModelSpec(family=a.family, task=a.task, sft_steps=a.sft_steps, sft_noise=a.sft_noise, seed=a.seed)
    out = make_tiny_model(a.out, spec, force=a.force, warm_start=warm_start, where="--out")
    info = json.loads((out / BUILD_FILE).read_text())
    print(f"tiny model in {out}: {info['parameters']:,} parameters, built in {info['build_seconds']} s")
    return out


if __name__ == "__main__":
    main()
