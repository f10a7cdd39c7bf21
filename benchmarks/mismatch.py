"""Train/inference mismatch per model family, and what routing replay does to a MoE's.

    python -m benchmarks.mismatch [--quick]

For each family's tiny model (warm-started on the reverse task as `make run`'s; --quick: untrained),
the generator samples in bfloat16, as a GPU run serves, and the trainer scores the same tokens in
fp32, on the same weights: only numerics differ. Over the sampled tokens: the mean k3 KL(generator
|| trainer), the mean and max |delta logprob| and the fraction of token ratios outside [1/2, 2]
(`forge.losses.mismatch_sums`, the trainer's `mismatch/*` metrics). The MoE is scored twice: with
its own router, and replaying the experts the generator routed each token to (R3). Writes
benchmarks/results/mismatch.json: `moe_kl_without_replay`, `moe_kl_with_replay`, and each dense
family's `<family>_kl`.
"""

from __future__ import annotations

import asyncio
import sys

import torch

from apps.sft import warm_start
from benchmarks.common import ROOT, parse_args, write_result
from forge.losses import mismatch_metrics, mismatch_sums
from forge.tasks import generate
from forge.types import Episode, collate
from services import titan
from services.generator import Generator
from services.schema import GeneratorConfig, SamplingConfig, TinyModelSpec
from services.tiny_model import make_tiny_model

GOAL = "MoE KL with routing replay < without"  # the target the manual's results page shows beside the figures

FAMILIES = ("qwen3", "llama3", "hf", "qwen3_moe")
CAP = 2.0


def model_dir(family: str, quick: bool) -> str:
    """The model configs/grpo_tiny.yaml trains (`make run`'s, shared with it), or an untrained one."""
    if quick:
        return str(make_tiny_model(ROOT / f".cache/forge/models/bench-mismatch-{family}", TinyModelSpec(family=family)))
    spec = TinyModelSpec(family=family, task="reverse", sft_steps=300, sft_noise=0.3)
    return str(
        make_tiny_model(
            ROOT / f".cache/forge/models/tiny-{family}-reverse-sft300-noise0.3", spec, warm_start=warm_start
        )
    )


async def sample(model: str, prompts: list[str], n: int) -> list:
    cfg = GeneratorConfig(dtype="bfloat16", max_model_len=64, sampling=SamplingConfig(temperature=1.0, max_tokens=12))
    gen = await Generator.options().as_service(model, cfg)
    try:
        groups = await asyncio.gather(*(gen.generate.route(p, n=n) for p in prompts))
    finally:
        await gen.shutdown()
    return [c for g in groups for c in g]


def measure(model: torch.nn.Module, batch, routed_experts) -> dict[str, float]:
    with torch.no_grad():
        lp = titan.token_logprobs(model, batch.input_ids, routed_experts=routed_experts)[0]
    return mismatch_metrics(*mismatch_sums(lp, batch, batch.loss_mask, CAP).tolist())


def family_rows(family: str, prompts: list[str], n: int, quick: bool) -> dict[str, dict[str, float]]:
    path = model_dir(family, quick)
    completions = asyncio.run(sample(path, prompts, n))
    batch = collate([Episode.from_completion(c) for c in completions], pad_id=0)
    model = titan.load_hf_model(path)
    rows = {family: measure(model, batch, None)}
    if batch.routed_experts is not None:
        rows[f"{family}+replay"] = measure(model, batch, batch.routed_experts)
    return rows


def main(argv: list[str] | None = None) -> dict:
    a = parse_args("mismatch", __doc__, "untrained models, 8 prompts x 4 samples (smoke run)", argv)
    n_prompts, n = (8, 4) if a.quick else (64, 8)
    prompts = [s.prompt for s in generate("reverse", n_prompts, seed=1)]
    rows: dict[str, dict[str, float]] = {}
    for family in FAMILIES:  # one generator at a time
        rows.update(family_rows(family, prompts, n, a.quick))
    result = {
        "rows": rows,
        "moe_kl_without_replay": rows["qwen3_moe"]["kl"],
        "moe_kl_with_replay": rows["qwen3_moe+replay"]["kl"],
        **{f"{f}_kl": rows[f]["kl"] for f in FAMILIES if f != "qwen3_moe"},
        "workload": {
            "prompts": n_prompts,
            "n": n,
            "generator": "vLLM, bfloat16",
            "trainer": "torchtitan, float32",
            "models": "tiny, untrained" if a.quick else "tiny, warm-started (reverse, 300 SFT steps)",
        },
    }
    print(f"{'model':<18}{'k3 KL':>12}{'|dlogp| mean':>14}{'|dlogp| max':>13}{'outside [1/2,2]':>17}{'tokens':>8}")
    for name, r in rows.items():
        print(
            f"{name:<18}{r['kl']:>12.2e}{r['abs_logprob_mean']:>14.2e}{r['abs_logprob_max']:>13.3f}"
            f"{r['outside_cap_frac']:>17.4f}{r['tokens']:>8.0f}"
        )
    return write_result(a.out, result)


if __name__ == "__main__":
    sys.exit(main() and 0)
