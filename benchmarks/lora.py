"""LoRA vs full fine-tune, side by side in one run on the 465 MB benchmark model (--quick: the tiny one).

    python -m benchmarks.lora [--quick]      # or: forge bench lora

For each mode, a Trainer service and a Generator service that follows it (a WeightSync), as a
GRPO run has them: the trainer's step time on a fixed batch, then publish -> live of a new
version (the trainer's push until the generator serves it; for LoRA, the adapter alone) and how
long the generator's engine stopped for it, while 8 request streams keep it busy; generation
tokens/s (LoRA: every request with the published adapter) next to the base model alone; the
optimizer-state bytes of each (AdamW's, counted in this process). Writes
benchmarks/results/lora.json (`sync_speedup_vs_full`, `optimizer_bytes_ratio`,
`generation_fraction_of_base`).
"""

from __future__ import annotations

import asyncio
import statistics
import time

import torch

from benchmarks.common import parse_args, tiny_model, write_result
from benchmarks.generation import prompts
from benchmarks.weight_sync import MEDIUM

GOAL = "reported: LoRA's publish -> live and optimizer bytes against full fine-tuning's, its generation tokens/s against the base model's"  # the target the manual's results page shows beside the figures

LORA = {"rank": 8, "alpha": 16}
SAMPLING = {"temperature": 1.0, "ignore_eos": True}


def batch(rows: int = 8, length: int = 64):
    from forge.types import Episode, collate

    g = torch.Generator().manual_seed(0)
    return collate(
        [
            Episode(
                tokens=torch.randint(6, 100, (length,), generator=g).tolist(),
                loss_mask=[0] * 8 + [1] * (length - 8),
                gen_logprobs=[-1.0] * length,
                advantage=1.0 if i % 2 else -1.0,
            )
            for i in range(rows)
        ],
        pad_id=0,
    )


def optimizer_bytes(model: str, lora) -> int:
    """Bytes of AdamW's state after one step (its moments: 2 per trained parameter)."""
    from services.schema import TrainerConfig
    from services.titan import load_hf_model, token_logprobs
    from services.trainer import build_optimizers

    m = load_hf_model(model, lora=lora)
    optimizers, _ = build_optimizers(m, TrainerConfig(lr=1e-4))
    (-token_logprobs(m, batch(2, 16).input_ids)[0].mean()).backward()
    optimizers.step()
    states = optimizers.optimizers[0].state.values()
    return sum(t.numel() * t.element_size() for s in states for t in s.values() if torch.is_tensor(t) and t.dim())


async def measure(model: str, lora, versions: int, seconds: float) -> dict:
    """One mode: step time, publish -> live and the engine's stop per version, generation tokens/s."""
    from forge.store import WeightStore
    from forge.weight_sync import WeightSync
    from services.generator import Generator
    from services.schema import GeneratorConfig, TrainerConfig
    from services.trainer import Trainer

    weights = WeightStore(f"bench-lora-{lora.rank}")
    cfg = TrainerConfig(lr=1e-4, lora=lora, threads=1)
    trainer = await Trainer.options(procs=1).as_service(model, cfg, weights)
    gen = await Generator.options().as_service(model, GeneratorConfig(max_model_len=256), weights, lora)
    sync = WeightSync(trainer, gen)
    await sync.start()
    ps = prompts(16)
    try:
        steps, live = [], []
        for _ in range(versions):
            t = time.perf_counter()
            await trainer.train_step.route(batch())
            steps.append(time.perf_counter() - t)
        stop = asyncio.Event()

        async def stream(p: str) -> None:
            while not stop.is_set():
                await gen.generate.route(p, n=2, sampling={**SAMPLING, "max_tokens": 32})

        busy = [asyncio.ensure_future(stream(p)) for p in ps[:8]]
        for _ in range(versions):
            await trainer.train_step.route(batch())
            t = time.perf_counter()
            version = await sync.push()
            await sync.wait_held(version)
            live.append(time.perf_counter() - t)
        stop.set()
        await asyncio.gather(*busy)
        paused = (await gen.last_swaps.route())[-versions:]
        tokens = await rate(gen, ps, seconds)
    finally:
        await sync.stop()
        await asyncio.gather(gen.shutdown(), trainer.shutdown())
        await weights.clear()
    return {
        "train_step_s": statistics.median(steps[1:]),
        "publish_to_live_s": live,
        "publish_to_live_s_median": statistics.median(live[1:]),
        "engine_paused_s_median": statistics.median(paused[1:]),
        "tokens_per_s": tokens,
    }


async def rate(gen, ps: list[str], seconds: float) -> float:
    """Generation tokens/s: the prompts' groups again and again for `seconds` (after one round)."""
    sampling = {**SAMPLING, "max_tokens": 32}

    async def round_() -> int:
        groups = await asyncio.gather(*(gen.generate.route(p, n=4, sampling=sampling) for p in ps))
        return sum(len(c.token_ids) for g in groups for c in g)

    await round_()
    tokens, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        tokens += await round_()
    return tokens / (time.perf_counter() - start)


async def run(model: str, versions: int, seconds: float) -> dict:
    from forge.schema import LoRAConfig
    from forge.store import start_store, stop_store

    procs = await start_store()
    try:
        full = await measure(model, LoRAConfig(), versions, seconds)
        lora = await measure(model, LoRAConfig(**LORA), versions, seconds)
    finally:
        await stop_store(procs)
    full["optimizer_bytes"] = optimizer_bytes(model, None)
    lora["optimizer_bytes"] = optimizer_bytes(model, LoRAConfig(**LORA))
    return {
        "model": model,
        "lora": LORA,
        "full": full,
        "lora_run": lora,
        "sync_speedup_vs_full": full["publish_to_live_s_median"] / lora["publish_to_live_s_median"],
        "optimizer_bytes_ratio": lora["optimizer_bytes"] / full["optimizer_bytes"],
        "train_step_speedup_vs_full": full["train_step_s"] / lora["train_step_s"],
        "generation_fraction_of_base": lora["tokens_per_s"] / full["tokens_per_s"],
    }


def main(argv: list[str] | None = None) -> dict:
    a = parse_args("lora", __doc__, "the tiny model, few versions (smoke run)", argv)
    model = tiny_model() if a.quick else tiny_model(**MEDIUM)
    result = asyncio.run(run(model, *((3, 2.0) if a.quick else (6, 20.0))))
    full, lora = result["full"], result["lora_run"]
    print(f"{'':<28}{'full':>12}{'LoRA r8':>12}{'LoRA / full':>14}")
    rows = [
        ("publish -> live (s)", "publish_to_live_s_median", ".3f"),
        ("engine paused per swap (s)", "engine_paused_s_median", ".4f"),
        ("trainer step (s)", "train_step_s", ".3f"),
        ("optimizer state (MB)", "optimizer_bytes", ".1f"),
        ("generation (tokens/s)", "tokens_per_s", ".0f"),
    ]
    for label, key, fmt in rows:
        scale = 2**20 if key == "optimizer_bytes" else 1
        f, lo = full[key] / scale, lora[key] / scale
        print(f"{label:<28}{f:>12{fmt}}{lo:>12{fmt}}{lo / f:>14.3f}")
    print(
        f"sync speed-up {result['sync_speedup_vs_full']:.1f}x, optimizer bytes ratio "
        f"{result['optimizer_bytes_ratio']:.4f}, generation with the adapter {result['generation_fraction_of_base']:.2f} "
        "of the base"
    )
    return write_result(a.out, result)


if __name__ == "__main__":
    main()
