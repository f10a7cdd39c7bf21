"""The GRPO loop at cluster scale, simulated: 64-256 generator replicas on this machine.

    python -m benchmarks.scale [--quick] [--replicas 64 256] [--steps 16] [--workloads agentic]   # or: forge bench scale

What is real: the GRPO app's loop (apps/grpo.py `train`), its replay buffer and staleness rule,
the reward service, the Service routing over every generator replica, the WeightSync that
tells them of each version. What is a cost model: the generator and the trainer.
- `SimGenerator`: a sample takes a duration drawn from the workload; `generate(prompt, n)`
  answers when its n samples are done (vLLM's n). A new policy version costs `fetch_s` in the
  background (once per host: one transfer per host), then pauses generation `swap_s`: the
  staged swap's pause that `forge bench weight_sync` measured (its largest model, same host,
  median; `benchmarks/results/weight_sync.json`), 1 s where that file has none.
- `SimTrainer`: a step costs `train_s`, a publish `publish_s`.
Replicas are actors, 64 to a process ("host"), so 256 of them cost 4 processes.

Workloads (real seconds, run `time_scale` times faster):
- agentic (seed 002): episode time log-normal, 40% under 30 s, 10% over 10 min, cut at a
  1 h timeout; groups of 4.
- math (RLVR): response length log-normal (median 1,500 tokens, cut at 16k) at 30 tokens/s per
  sequence; groups of 16.
Each replica serves one group at a time and a step trains one group per replica (a synchronous
system generates the whole batch at once). The ideal speedup comes from the distribution: a
synchronous step waits for the slowest group of its batch, then trains and syncs weights; a
perfect pipeline runs at the pace of its slower stage (rollout throughput or training).
Writes benchmarks/results/scale.json; its top-level figures are the agentic workload's at the
largest scale.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import random
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from monarch.actor import concurrent_endpoint, endpoint

from benchmarks.common import ROOT, parse_args, write_result
from forge.actor import ForgeActor, SpawnOptions, spawn_procs, stop_procs
from forge.types import Completion

GOAL = "async ≥ 2.8× sync, ≥ 90% of ideal, at 64+ generators (agentic)"  # the target the manual's results page shows beside the figures

REPLICAS_PER_HOST = 64
MODES = (0, 1, 4)


@dataclass(frozen=True)
class Workload:
    name: str
    median_s: float  # a sample's duration: log-normal, cut at cap_s
    sigma: float
    cap_s: float
    group_size: int
    train_s: float  # one trainer step
    publish_s: float = 2.0  # the trainer's gather + publish of a version
    fetch_s: float = 1.5  # a host pulls a version (16 GB at ~10 GB/s) while generating
    swap_s: float = 1.0  # generation pauses while a replica swaps the version in (see measured_swap_s)
    time_scale: float = 250.0  # simulated seconds per wall second
    replicas: tuple[int, ...] = (64, 256)  # the scales it runs at (--replicas overrides)

    def draw(self, rng: random.Random) -> float:
        return min(self.cap_s, self.median_s * math.exp(self.sigma * rng.gauss(0, 1)))

    def wall(self, seconds: float) -> float:
        return seconds / self.time_scale


WORKLOADS = {
    # P(< 30 s) = 40%, P(> 600 s) = 10%: ln 20 / (z(0.9) - z(0.4)) = 1.95
    "agentic": Workload("agentic", median_s=49.2, sigma=1.95, cap_s=3600.0, group_size=4, train_s=300.0),
    "math": Workload(
        "math",
        median_s=1500 / 30,
        sigma=0.7,
        cap_s=16384 / 30,
        group_size=16,
        train_s=90.0,
        time_scale=50.0,
        replicas=(64,),
    ),
}


def measured_swap_s(path: Path = ROOT / "benchmarks/results/weight_sync.json") -> dict[str, Any] | None:
    """The generator's swap pause that `forge bench weight_sync` measured: its largest model's
    staged swap on one host (the median pause), or None without that file or row."""
    if not path.exists():
        return None
    rows = [r for r in json.loads(path.read_text()).get("generator_sync", []) if r["staged"] and not r["cross_host"]]
    if not rows:
        return None
    row = max(rows, key=lambda r: r["model_mb"])
    return {"swap_s": row["paused_s_median"], "model_mb": row["model_mb"], "from": path.name}


def ideal(w: Workload, groups: int, samples: int = 2000, seed: int = 0) -> dict[str, float]:
    """Step times (simulated seconds) from the distribution: synchronous, and a perfect pipeline."""
    rng = random.Random(seed)
    group = lambda: max(w.draw(rng) for _ in range(w.group_size))  # noqa: E731
    mean_group = statistics.mean(group() for _ in range(samples))
    slowest = statistics.mean(max(group() for _ in range(groups)) for _ in range(max(20, samples // groups)))
    sync_step = slowest + w.train_s + w.publish_s + w.fetch_s + w.swap_s
    async_step = max(w.train_s + w.publish_s, mean_group + w.swap_s)  # one group per replica in flight
    return {"sync_step_s": sync_step, "async_step_s": async_step, "ideal_speedup": sync_step / async_step}


# ---- the cost models -----------------------------------------------------------------

# What a host's replicas share: one transfer per version (version -> when it is on the host, monotonic).
_ON_HOST: dict[int, float] = {}


class SimGenerator(ForgeActor):
    """A generator replica's costs without a model: samples take the workload's durations;
    a new version is fetched (once per host) while generating, then swapped under a pause."""

    def __init__(self, w: Workload):
        self.w = w
        self.version = 0
        self.started: collections.Counter[int] = collections.Counter()  # samples started, by policy version
        self.paused_s = 0.0  # total pause so far: a request in flight waits out the pauses it spans
        self.resumed_at = 0.0

    @concurrent_endpoint
    async def load_version(self, version: int) -> int:
        if version > self.version:
            now = time.monotonic()
            ready = _ON_HOST.setdefault(version, now + self.w.wall(self.w.fetch_s))
            await asyncio.sleep(max(0.0, ready - now))
            pause = self.w.wall(self.w.swap_s)
            self.resumed_at = time.monotonic() + pause
            self.paused_s += pause
            await asyncio.sleep(pause)
            self.version = version
        return self.version

    @concurrent_endpoint
    async def generate(
        self, prompt: str, n: int = 1, sampling: dict | None = None, tools: list | None = None
    ) -> list[Completion]:  # the Generator's endpoint (tools: rendered into a chat prompt there)
        admitted, paused = self.version, self.paused_s
        self.started[admitted] += n
        rng = random.Random(f"{prompt}")  # the same prompt takes the same time in every mode
        durations = [self.w.draw(rng) for _ in range(n)]
        await asyncio.sleep(self.w.wall(max(durations)))
        while self.paused_s > paused or time.monotonic() < self.resumed_at:  # swaps during the request
            paused = self.paused_s
            await asyncio.sleep(max(self.w.wall(self.w.swap_s), self.resumed_at - time.monotonic()))
        return [
            Completion(
                prompt_ids=[1, 2, 3],
                token_ids=[4, 5],
                logprobs=[-1.0, -1.0],
                text="..",
                finish_reason="stop",
                policy_version=admitted,
                max_policy_version=self.version,
                prompt=prompt,
            )
            for _ in durations
        ]

    @endpoint
    async def policy_version(self) -> int:
        return self.version

    @endpoint
    async def started_by_version(self) -> dict[int, int]:
        return dict(self.started)

    @endpoint
    async def reserve_weights(self, layout: dict | None) -> bool:
        return False  # the per-host fetch is `fetch_s` (load_version): nothing to make room for


class SimTrainer(ForgeActor):
    """The trainer's costs: `train_s` a step, `publish_s` a push (a tiny tensor goes into the
    real weight store)."""

    def __init__(self, w: Workload, weights: Any):
        self.w, self.weights, self.version = w, weights, 0

    @endpoint
    async def train_step(self, batch: Any) -> tuple[int, dict[str, float]]:
        await asyncio.sleep(self.w.wall(self.w.train_s))
        self.version += 1
        return self.version, {"loss": 0.0}

    @endpoint
    async def push_weights(self) -> int:
        await asyncio.sleep(self.w.wall(self.w.publish_s))
        await self.weights.publish(self.version, {"w": torch.zeros(1)})
        await self.weights.drop_older_than(self.version - 1)
        return self.version

    @endpoint
    async def policy_version(self) -> int:
        return self.version

    @endpoint
    async def export_hf(self, path: str) -> str:
        return path

    @endpoint
    async def weights_layout(self) -> dict | None:
        return None  # the generators' per-host fetch is a cost of its own (SimGenerator.load_version)


@dataclass
class Colocated(SpawnOptions):
    """Replicas as actors on shared processes, `per_proc` to each: a Service of 256 simulated
    generators then costs 4 processes, not 256 (forge's own spawn gives each replica its procs)."""

    per_proc: int = REPLICAS_PER_HOST

    def __post_init__(self) -> None:
        super().__post_init__()
        self._procs: list[Any] = []
        self._spawned = 0

    async def spawn_mesh(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        i, self._spawned = self._spawned, self._spawned + 1
        if i % self.per_proc == 0:
            self._procs.append(spawn_procs(1, env=self.env, title="forge:simhost"))
        procs = self._procs[i // self.per_proc]
        mesh = procs.spawn(f"{self.actor.__name__.lower()}{i}", self.actor, *args, **kwargs)
        await mesh.setup.call()
        return procs, mesh

    async def stop(self) -> None:
        for procs in self._procs:
            await stop_procs(procs)


# ---- one workload at one scale -------------------------------------------------------


def config(w: Workload, replicas: int, max_staleness: int, steps: int, runs_dir: Path):
    from apps.grpo import Config
    from forge.config import load_config

    overrides = {
        "run_name": f"{w.name}_{replicas}_staleness_{max_staleness}",
        "runs_dir": str(runs_dir),
        "max_staleness": max_staleness,
        "steps": steps,
        "group_size": w.group_size,
        "groups_per_step": replicas,
        "rollout_tasks": replicas,
        "checkpoint_every": 0,
        "eval.every": 0,
        "metrics": "[jsonl]",
        "sample_timeout_s": 10 * w.wall(w.cap_s) + 60,
    }
    return load_config(str(ROOT / "configs/grpo_tiny.yaml"), [f"{k}={v}" for k, v in overrides.items()], Config)


async def measure(w: Workload, replicas: int, steps: int, runs_dir: Path) -> dict[str, Any]:
    from apps.grpo import train
    from forge.service import Service
    from forge.store import WeightStore, start_store, stop_store
    from forge.weight_sync import WeightSync
    from services.rewards import Rewards
    from services.roles import Roles
    from services.schema import RewardsConfig

    store = await start_store()
    weights = WeightStore("scale")
    await weights.publish(0, {"w": torch.zeros(1)})
    placement = Colocated(SimGenerator, replicas=replicas)
    gen = Service(placement, (w,), {})
    await gen.start()
    trainer = await SimTrainer.options().as_service(w, weights)
    sync = WeightSync(trainer, gen)
    await sync.start()
    rewards = await Rewards.options().as_service(RewardsConfig(weights={"exact": 1.0}))
    services = Roles(store, trainer, gen, sync, rewards, ref=None)
    modes: dict[str, Any] = {}
    try:
        for k in MODES:
            cfg = config(w, replicas, k, steps, runs_dir)
            shutil.rmtree(cfg.run_dir, ignore_errors=True)
            first = await sync.push()  # every mode starts with the generators on the trainer's version
            await sync.wait_held(first)
            cpu = time.process_time()
            await train(cfg, services)
            cpu = time.process_time() - cpu
            # Started for the run's steps: on its versions before the last (on the last, rollouts
            # begin for a step that never comes).
            last = await trainer.policy_version.route()
            episodes = sum(n for c in await gen.started_by_version.fanout() for v, n in c.items() if first <= v < last)
            modes[f"max_staleness={k}"] = summary(cfg.run_dir, cpu, episodes, steps, cfg.batch_size)
    finally:
        await sync.stop()
        await weights.clear()
        await asyncio.gather(trainer.shutdown(), rewards.shutdown(), gen.shutdown(), return_exceptions=True)
        await placement.stop()
        await stop_store(store)
    sync = modes["max_staleness=0"]["wall_s"]
    for m in modes.values():
        m["speedup_vs_sync"] = sync / m["wall_s"]
    best = ideal(w, replicas)
    measured = modes["max_staleness=4"]["speedup_vs_sync"]
    return {
        "replicas": replicas,
        "batch_episodes": replicas * w.group_size,
        "speedup_async_vs_sync": measured,
        "speedup_one_step_vs_sync": modes["max_staleness=1"]["speedup_vs_sync"],
        **best,
        "swap_s": w.swap_s,
        # The same ideal with the 1 s pause this model assumed before weight_sync measured one.
        "ideal_speedup_swap_1s": ideal(replace(w, swap_s=1.0), replicas)["ideal_speedup"],
        "share_of_ideal": measured / best["ideal_speedup"],
        "sync_wall_vs_ideal": modes["max_staleness=0"]["wall_s"] / (steps * w.wall(best["sync_step_s"])),
        "async_wall_vs_ideal": modes["max_staleness=4"]["wall_s"] / (steps * w.wall(best["async_step_s"])),
        "controller_cpu_ms_per_episode": modes["max_staleness=4"]["controller_cpu_ms_per_episode"],
        "modes": modes,
    }


def summary(run_dir: Path, cpu: float, episodes: int, steps: int, batch: int) -> dict[str, float]:
    """A mode's run: its wall time from the first rollout to the last step (the loop's own
    metrics clock: no spawning or export), and what the controller process spent."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "wall_s": rows[-1]["wall_s"],
        "trained_episodes": steps * batch,
        "generated_episodes": episodes,
        # Started but never trained: dropped as stale, or still running or buffered at the end.
        "untrained_frac": 1 - steps * batch / max(episodes, 1),
        "controller_cpu_s": cpu,
        "controller_cpu_ms_per_episode": 1000 * cpu / max(episodes, 1),
        "wait_s_per_step": statistics.mean(r["time/wait_s"] for r in rows),
        "staleness_mean": statistics.mean(r["staleness_mean"] for r in rows),
        "staleness_max": max(r["staleness_max"] for r in rows),
    }


def main(argv: list[str] | None = None) -> dict:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--replicas", type=int, nargs="+", help="default: each workload's own (64 and 256; math 64)")
    extra.add_argument("--steps", type=int, default=16)
    extra.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    a = parse_args("scale", __doc__, "agentic only, 8 replicas, 3 steps, 1000x faster (smoke run)", argv, (extra,))
    steps, workloads = a.steps, {n: WORKLOADS[n] for n in a.workloads}
    if a.replicas:
        workloads = {n: replace(w, replicas=tuple(a.replicas)) for n, w in workloads.items()}
    if a.quick:
        steps, workloads = 3, {"agentic": replace(WORKLOADS["agentic"], time_scale=1000.0, replicas=(8,))}
    swap = measured_swap_s()
    if swap:
        workloads = {n: replace(w, swap_s=swap["swap_s"]) for n, w in workloads.items()}
    runs = ROOT / "runs/bench_scale"
    result: dict[str, Any] = {
        "steps": steps,
        "workloads": {n: asdict(w) for n, w in workloads.items()},
        "swap_measured": swap,
        "runs": {},
    }
    print(
        f"swap pause: {next(iter(workloads.values())).swap_s * 1000:.0f} ms "
        + (f"(forge bench weight_sync, {swap['model_mb']:.0f} MB staged)" if swap else "(fixed: no weight_sync.json)")
    )
    print(
        f"{'workload':<9}{'replicas':>9}{'max_staleness':>14}{'wall s':>9}{'speedup':>9}{'ideal':>7}{'share':>7}"
        f"{'untrained':>10}{'ctrl ms/ep':>11}"
    )
    for name, w in workloads.items():
        for n in w.replicas:
            r = asyncio.run(measure(w, n, steps, runs))
            result["runs"][f"{name}/{n}"] = r
            for mode, m in r["modes"].items():
                share = "" if mode.endswith("=0") else f"{m['speedup_vs_sync'] / r['ideal_speedup']:.2f}"
                print(
                    f"{name:<9}{n:>9}{mode.split('=')[1]:>14}{m['wall_s']:>9.1f}{m['speedup_vs_sync']:>9.2f}"
                    f"{r['ideal_speedup']:>7.2f}{share:>7}"
                    f"{m['untrained_frac']:>10.2f}{m['controller_cpu_ms_per_episode']:>11.2f}"
                )
    first = next(iter(workloads.values()))
    top = result["runs"][f"{first.name}/{max(first.replicas)}"]
    for key in ("speedup_async_vs_sync", "ideal_speedup", "share_of_ideal", "controller_cpu_ms_per_episode"):
        result[key] = top[key]
    return write_result(a.out, result)


if __name__ == "__main__":
    sys.exit(main() and 0)
