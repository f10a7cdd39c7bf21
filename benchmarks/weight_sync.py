"""Weight sync: WeightStore publish + fetch (+ the swap into a consumer's parameters) vs
state-dict size, next to memcpy of the same bytes.

    python -m benchmarks.weight_sync [--quick]

For each size: a torch copy of the same bytes (memcpy bandwidth, measured in this run), the
"shm" transport (safetensors file in /dev/shm, TorchStore holds the version record) and the
"torchstore" transport (tensors through TorchStore 0.1.2's RPC). Then the stall one sync
causes in a generator that follows the store (tiny model): time from publish to the new
version being live, and how long generation was paused. Writes benchmarks/results/weight_sync.json.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import parse_args, tiny_model, write_result

TENSOR_MB = 4  # the state dict is made of 4 MB fp32 tensors, like a model's weight matrices


def state_dict(mb: int) -> dict[str, torch.Tensor]:
    n = max(1, mb // TENSOR_MB)
    per = (mb * 2**20) // (4 * n)
    return {f"layers.{i}.weight": torch.randn(per) for i in range(n)}


def memcpy_s(sd: dict[str, torch.Tensor], repeats: int, fresh: bool = False) -> float:
    """Copy every tensor into a buffer that is already mapped (fresh=False) or newly allocated
    (fresh=True: first-touch page faults included, as any new file or allocation pays)."""
    dst = {k: torch.empty_like(v) for k, v in sd.items()}
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        for k, v in sd.items():
            (torch.empty_like(v) if fresh else dst[k]).copy_(v)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


async def sync_s(store, sd: dict[str, torch.Tensor], repeats: int, into: bool) -> float:
    """publish + fetch of one version; `into`: fetched into a consumer's existing tensors (a
    model's parameters: the swap), else into new ones. Four rounds warm up: from then on the
    writer cycles through files it has mapped before, as it does in a run."""
    params = {k: torch.empty_like(v) for k, v in sd.items()} if into else None
    times = []
    for v in range(1, repeats + 5):
        t = time.perf_counter()
        await store.publish(v, sd)
        got = await store.fetch(v, into=params)
        times.append(time.perf_counter() - t)
        assert got.keys() == sd.keys()
        await store.drop_older_than(v)
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    await store.clear()
    return statistics.median(times[4:])


async def generator_stall(model: str) -> dict:
    from safetensors.torch import load_file

    from forge.store import WeightStore
    from services.generator import Generator

    store = WeightStore("bench-gen")
    gen = await Generator.options().as_service(model=model, weights_from="bench-gen")
    sd = load_file(Path(model) / "model.safetensors")
    try:
        busy = [asyncio.ensure_future(gen.generate.route("rev abc=", n=4, sampling={"max_tokens": 200, "ignore_eos": True}))
                for _ in range(16)]
        await asyncio.sleep(0.5)
        live = []
        for v in (1, 2, 3):
            t = time.perf_counter()
            await store.publish(v, sd)
            while await gen.policy_version.route() < v:
                await asyncio.sleep(0.005)
            live.append(time.perf_counter() - t)
        swaps = await gen.last_swaps.route()
        await asyncio.gather(*busy)
    finally:
        await gen.shutdown()
        await store.clear()
    return {"publish_to_live_s_median": statistics.median(live), "paused_s_median": statistics.median(swaps),
            "model_mb": sum(t.numel() * t.element_size() for t in sd.values()) / 2**20}


async def measure(sizes: list[int], repeats: int, model: str) -> dict:
    from forge.store import WeightStore, start_store, stop_store

    procs = await start_store()
    rows = []
    try:
        for mb in sizes:
            sd = state_dict(mb)
            row = {"mb": mb, "memcpy_s": memcpy_s(sd, repeats), "memcpy_fresh_s": memcpy_s(sd, repeats, fresh=True)}
            for transport in ("shm", "torchstore"):
                store = WeightStore(f"bench-{transport}", transport=transport)
                row[f"{transport}_s"] = await sync_s(store, sd, repeats, into=True)
                row[f"{transport}_new_tensors_s"] = await sync_s(store, sd, repeats, into=False)
            row["memcpy_gb_s"] = mb / 1024 / row["memcpy_s"]
            row["memcpy_fresh_gb_s"] = mb / 1024 / row["memcpy_fresh_s"]
            for transport in ("shm", "torchstore"):
                row[f"{transport}_gb_s"] = mb / 1024 / row[f"{transport}_s"]
                row[f"{transport}_fraction_of_memcpy"] = row["memcpy_s"] / row[f"{transport}_s"]
                row[f"{transport}_new_tensors_fraction_of_memcpy"] = row["memcpy_s"] / row[f"{transport}_new_tensors_s"]
            rows.append(row)
            del sd
        stall = await generator_stall(model)
    finally:
        await stop_store(procs)
    largest = rows[-1]
    return {"rows": rows, "fraction_of_memcpy": largest["shm_fraction_of_memcpy"],
            "torchstore_fraction_of_memcpy": largest["torchstore_fraction_of_memcpy"],
            "largest_mb": largest["mb"], "generator_sync": stall, "repeats": repeats}


def main(argv: list[str] | None = None) -> dict:
    a = parse_args("weight_sync", __doc__, "sizes up to 64 MB, one repeat (smoke run)", argv)
    model = tiny_model()
    sizes = [1, 16, 64] if a.quick else [1, 16, 64, 256, 500]
    result = asyncio.run(measure(sizes, 1 if a.quick else 3, model))
    print("publish + fetch into the consumer's tensors, as a fraction of one memcpy of the same bytes "
          "(2 copies at memcpy speed = 0.5); '(new)': fetched into newly allocated tensors")
    print(f"{'MB':>6}{'memcpy GB/s':>13}{'shm GB/s':>10}{'shm/memcpy':>12}{'(new)':>7}{'torchstore GB/s':>17}{'ts/memcpy':>11}")
    for r in result["rows"]:
        print(f"{r['mb']:>6}{r['memcpy_gb_s']:>13.2f}{r['shm_gb_s']:>10.2f}{r['shm_fraction_of_memcpy']:>12.2f}"
              f"{r['shm_new_tensors_fraction_of_memcpy']:>7.2f}{r['torchstore_gb_s']:>17.2f}{r['torchstore_fraction_of_memcpy']:>11.2f}")
    g = result["generator_sync"]
    print(f"generator ({g['model_mb']:.1f} MB model): publish -> live {g['publish_to_live_s_median'] * 1e3:.0f} ms, "
          f"generation paused {g['paused_s_median'] * 1e3:.0f} ms")
    return write_result(a.out, result)


if __name__ == "__main__":
    sys.exit(main() and 0)
