"""route() on a forge Service vs a bare Monarch call_one(), for a no-op endpoint.

    python -m benchmarks.service_overhead [--quick]

Prints a table and writes benchmarks/results/service_overhead.json.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

from monarch.actor import endpoint

from benchmarks.common import parse_args, write_result
from forge.actor import ForgeActor

GOAL = "reported: a service route() against a bare Monarch call_one() of a no-op endpoint"  # the target the manual's results page shows beside the figures


class Noop(ForgeActor):
    @endpoint
    async def noop(self) -> int:
        return 0


async def latency_us(call, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        await call()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


async def throughput(call, n: int) -> float:
    t = time.perf_counter()
    await asyncio.gather(*(call() for _ in range(n)))
    return n / (time.perf_counter() - t)


async def measure(n: int, repeats: int) -> dict:
    bare = await Noop.options().as_actor()
    svc = await Noop.options(replicas=1).as_service()
    try:

        def bare_call():
            return bare.noop.call_one()

        def svc_call():
            return svc.noop.route()

        await latency_us(bare_call, 20)  # warm both paths
        await latency_us(svc_call, 20)
        rows = {"bare_call_one": {"lat": [], "tput": []}, "service_route": {"lat": [], "tput": []}}
        for _ in range(repeats):  # interleaved, so drift hits both alike
            for name, call in (("bare_call_one", bare_call), ("service_route", svc_call)):
                rows[name]["lat"].append(await latency_us(call, n))
                rows[name]["tput"].append(await throughput(call, n))
    finally:
        await svc.shutdown()
        await bare.shutdown()
    out = {
        name: {"latency_us_median": statistics.median(r["lat"]), "calls_per_s_median": statistics.median(r["tput"])}
        for name, r in rows.items()
    }
    out["route_latency_ratio"] = out["service_route"]["latency_us_median"] / out["bare_call_one"]["latency_us_median"]
    out["route_throughput_ratio"] = (
        out["service_route"]["calls_per_s_median"] / out["bare_call_one"]["calls_per_s_median"]
    )
    out["calls"], out["repeats"] = n, repeats
    return out


def main(argv: list[str] | None = None) -> dict:
    a = parse_args("service_overhead", __doc__, "fewer calls (smoke run)", argv)
    result = asyncio.run(measure(n=50 if a.quick else 500, repeats=2 if a.quick else 5))
    print(f"{'path':<16}{'latency (us, median)':>22}{'calls/s (median)':>18}")
    for name in ("bare_call_one", "service_route"):
        r = result[name]
        print(f"{name:<16}{r['latency_us_median']:>22.0f}{r['calls_per_s_median']:>18.0f}")
    print(
        f"route/bare: latency x{result['route_latency_ratio']:.2f}, throughput x{result['route_throughput_ratio']:.2f}"
    )
    return write_result(a.out, result)


if __name__ == "__main__":
    sys.exit(main() and 0)
