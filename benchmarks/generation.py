"""Generation tokens/s: forge Generator service (1 and 2 replicas) vs bare vLLM AsyncLLM vs HF generate.

    python -m benchmarks.generation [--quick]

Same tiny model, same prompts, same sampling (ignore_eos, so every completion has exactly
`max_tokens` tokens). Also the reload latency of the service (load_weights of the same
state dict). Prints a table and writes benchmarks/results/generation.json.
"""

from __future__ import annotations

import asyncio
import gc
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

from benchmarks.common import ROOT, parse_args, tiny_model, write_result

GOAL = "service ≥ 90% of bare vLLM; vLLM ≥ 5× HF"  # the target the manual's results page shows beside the figures

SAMPLING = {"temperature": 1.0, "ignore_eos": True}


def prompts(n: int) -> list[str]:
    from forge.tasks import generate

    return [s.prompt for s in generate("reverse", n, seed=0)]


async def timed(run, repeats: int) -> float:
    """Median tokens/s of `run()` (which returns its token count) over `repeats`, after a warm-up."""
    await run()
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        tokens = await run()
        rates.append(tokens / (time.perf_counter() - t))
    return statistics.median(rates)


async def service_rate(model: str, replicas: int, ps: list[str], n: int, max_tokens: int, repeats: int) -> dict:
    from safetensors.torch import load_file

    from services.generator import Generator

    gen = await Generator.options(replicas=replicas).as_service(model)
    sampling = {**SAMPLING, "max_tokens": max_tokens}
    try:

        async def run() -> int:
            groups = await asyncio.gather(*(gen.generate.route(p, n=n, sampling=sampling) for p in ps))
            return sum(len(c.token_ids) for g in groups for c in g)

        rate = await timed(run, repeats)
        reload = {}
        if replicas == 1:
            sd = load_file(Path(model) / "model.safetensors")
            calls, paused = [], []
            for v in range(1, 4):
                t = time.perf_counter()
                paused.append(await gen.load_weights.route(sd, version=v))
                calls.append(time.perf_counter() - t)
            reload = {
                "reload_call_s_median": statistics.median(calls),
                "reload_paused_s_median": statistics.median(paused),
            }
    finally:
        await gen.shutdown()
    return {"tokens_per_s": rate, **reload}


async def bare_vllm_rate(model: str, ps: list[str], n: int, max_tokens: int, repeats: int) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from services.generator import engine_args, engine_env
    from services.schema import GeneratorConfig

    os.environ.setdefault("VLLM_CACHE_ROOT", str(ROOT / ".cache/forge/vllm"))
    os.environ.update(engine_env(GeneratorConfig()))  # the engine the service runs, in this process
    engine = AsyncLLM.from_engine_args(engine_args(GeneratorConfig(), model))
    params = SamplingParams(
        n=n, max_tokens=max_tokens, logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY, **SAMPLING
    )
    try:

        async def one(p: str) -> int:
            async for out in engine.generate(p, params, uuid.uuid4().hex):
                final = out
            return sum(len(c.token_ids) for c in final.outputs)

        async def run() -> int:
            return sum(await asyncio.gather(*(one(p) for p in ps)))

        return {"tokens_per_s": await timed(run, repeats)}
    finally:
        engine.shutdown()
        engine = None  # AsyncLLM.__del__ now (the closures above hold the name, not the engine)
        gc.collect()  # while its imports still exist


async def hf_rate(model: str, ps: list[str], n: int, max_tokens: int, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model, padding_side="left")
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    batch = tok(ps, return_tensors="pt", padding=True)

    async def run() -> int:
        with torch.no_grad():
            out = lm.generate(
                **batch,
                do_sample=True,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                num_return_sequences=n,
                pad_token_id=tok.pad_token_id,
            )
        return (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]

    return {"tokens_per_s": await timed(run, repeats)}


def main(argv: list[str] | None = None) -> dict:
    a = parse_args("generation", __doc__, "fewer prompts, one repeat, no 2-replica row (smoke run)", argv)
    model = tiny_model()
    n_prompts, n, max_tokens, repeats = (16, 4, 32, 1) if a.quick else (64, 4, 64, 3)
    ps = prompts(n_prompts)
    args = (ps, n, max_tokens, repeats)
    # One system at a time, so none slows another down on this 2-core machine.
    rows = {"hf_generate": asyncio.run(hf_rate(model, *args)), "bare_vllm": asyncio.run(bare_vllm_rate(model, *args))}
    rows["service_1_replica"] = asyncio.run(service_rate(model, 1, *args))
    if not a.quick:
        rows["service_2_replicas"] = asyncio.run(service_rate(model, 2, *args))
    result = {
        "rows": rows,
        "service_vs_bare_vllm": rows["service_1_replica"]["tokens_per_s"] / rows["bare_vllm"]["tokens_per_s"],
        "vllm_vs_hf_generate": rows["bare_vllm"]["tokens_per_s"] / rows["hf_generate"]["tokens_per_s"],
        "reload_call_s_median": rows["service_1_replica"]["reload_call_s_median"],
        "reload_paused_s_median": rows["service_1_replica"]["reload_paused_s_median"],
        "workload": {
            "prompts": n_prompts,
            "n": n,
            "max_tokens": max_tokens,
            "repeats": repeats,
            "model": "tiny (2.4M)",
        },
    }
    print(f"{'system':<20}{'tokens/s (median)':>20}")
    for name, r in rows.items():
        print(f"{name:<20}{r['tokens_per_s']:>20.0f}")
    print(
        f"service/bare vLLM x{result['service_vs_bare_vllm']:.2f}; bare vLLM/HF generate x{result['vllm_vs_hf_generate']:.2f}"
    )
    print(
        f"reload: call {result['reload_call_s_median'] * 1e3:.0f} ms, generation paused {result['reload_paused_s_median'] * 1e3:.0f} ms"
    )
    return write_result(a.out, result)


if __name__ == "__main__":
    sys.exit(main() and 0)
