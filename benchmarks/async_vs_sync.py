"""Async vs sync GRPO on a heavy-tailed workload: the same trained samples with
max_staleness = 0 (on-policy), 1 (one-step off-policy) and 4 (fully async).

    python -m benchmarks.async_vs_sync [--quick]      # or: forge bench async_vs_sync

The workload is the GRPO app's own loop (apps/grpo.py `train`) with a custom rollout whose
costs have the heavy tails of agentic RL:
- response lengths: each sample's max_tokens is drawn (EOS ignored): 90% short (2-8
  tokens), 10% at the cap (48 tokens);
- environment latency: each sample then waits on a simulated tool/verifier. A task's
  latency follows seed 002's distribution scaled down 500x (40% of tasks under 30 s and 10%
  over 10 min become 60 ms and 1.2 s: log-normal, capped at 6 s); each of its samples
  takes that times a log-normal jitter (sigma 0.3).
A step trains 8 prompts x 4 samples, with one rollout per prompt of a batch in flight
(8 concurrent rollouts), the way a synchronous system generates a whole batch at once.
The **agentic** variant runs the same steps through the gateway (server mode): each episode is
a two-turn conversation with `SlowToolEnv` in the environment pool, the policy's first reply
answered by a tool that takes the same latency distribution, the second reply ending it.
All six runs share one set of services (warm engine, same model); a variant's three differ
only in `max_staleness`, and each trains the same number of steps. The ideal speedup comes from the
on-policy run's own stage times: a perfect pipeline runs at the pace of its slower stage,
rollouts (mean group time x groups per step / concurrent rollouts) or training (train +
push per step). Writes benchmarks/results/async_vs_sync.json.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, parse_args, tiny_model, write_result

SHORT, CAP = (2, 8), 48
TASK_MEDIAN_S, TASK_SIGMA, TASK_CAP_S, JITTER_SIGMA = 0.098, 1.95, 6.0, 0.3  # P(< 60 ms) = 40%, P(> 1.2 s) = 10%
GROUP_SIZE, GROUPS, ROLLOUTS = 4, 8, 8  # one rollout per prompt of a batch, as a synchronous system generates


def task_latency(rng: random.Random) -> float:
    return min(TASK_CAP_S, TASK_MEDIAN_S * math.exp(TASK_SIGMA * rng.gauss(0, 1)))


async def heavy_tail_rollout(sample: Any, gen: Any, rewards: Any, cfg: Any):
    """A rollout with heavy-tailed lengths and tool latency (the same draws for the same prompt)."""
    rng = random.Random(sample.prompt)
    task_s = task_latency(rng)

    async def one(tokens: int, latency: float):
        [completion] = await gen.generate.route(sample.prompt, n=1, sampling={"max_tokens": tokens, "ignore_eos": True})
        await asyncio.sleep(latency)  # the environment/verifier step
        return completion

    draws = [
        (CAP if rng.random() < 0.1 else rng.randint(*SHORT), task_s * math.exp(JITTER_SIGMA * rng.gauss(0, 1)))
        for _ in range(cfg.group_size)
    ]
    group = await asyncio.gather(*(one(*d) for d in draws))
    from forge.types import RewardInput

    scores = await rewards.score.route([RewardInput(sample.row(), c.text, c.finish_reason) for c in group])
    return list(group), scores


class SlowToolEnv:
    """A two-turn environment whose tool takes a task's latency (drawn from its prompt) times
    a jitter of the episode's own; the second reply is scored."""

    def reset(self, task: dict[str, Any]) -> tuple[list[dict[str, Any]], None]:
        self.task, self.turn = task, 0
        self.tool_s = task_latency(random.Random(task["prompt"])) * math.exp(JITTER_SIGMA * random.gauss(0, 1))
        return [{"role": "user", "content": task["prompt"]}], None

    async def step(self, message: dict[str, Any]) -> Any:
        from forge.env import EnvStep
        from forge.tasks import get_task

        self.turn += 1
        if self.turn == 1:
            await asyncio.sleep(self.tool_s)  # the tool call
            return EnvStep([{"role": "tool", "content": "42", "tool_call_id": "t"}])
        return EnvStep(
            done=True, reward=get_task(self.task["task"]).score(message.get("content") or "", self.task["answer"])
        )

    def close(self) -> None:
        pass


AGENTIC = {
    "agentic.env": "benchmarks.async_vs_sync:SlowToolEnv",
    "agentic.max_turns": 2,
    "agentic.sampling": "{max_tokens: 6, temperature: 1.0, extra_body: {ignore_eos: true}}",
    "generator.max_model_len": 128,
}


def config(max_staleness: int, steps: int, runs_dir: Path, model: str, agentic: bool = False):
    from apps.grpo import Config
    from forge.config import load_config

    overrides = {
        "run_name": f"{'agentic_' if agentic else ''}staleness_{max_staleness}",
        "runs_dir": str(runs_dir),
        "max_staleness": max_staleness,
        "steps": steps,
        "model.path": model,
        "model.tiny": "null",
        "group_size": GROUP_SIZE,
        "groups_per_step": GROUPS,
        "rollout_tasks": ROLLOUTS,
        "rollout": "benchmarks.async_vs_sync:heavy_tail_rollout",
        "generator.max_model_len": 96,
        "checkpoint_every": 0,
        "metrics": "[jsonl]",
        "trainer.lr": 1e-5,
        "trainer.grad_accum": 4,  # micro-batches of similar lengths: the long tail is not everyone's padding
    }
    if agentic:
        del overrides["rollout"]
        overrides.update(AGENTIC)
    return load_config(str(ROOT / "configs/grpo_tiny.yaml"), [f"{k}={v}" for k, v in overrides.items()], Config)


def summary(run_dir: Path, steps: int) -> dict[str, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    wall = rows[-1]["wall_s"]
    total = lambda key: sum(r.get(key, 0.0) for r in rows)  # noqa: E731
    train = total("time/train_s") + total("time/push_s")
    return {
        "wall_s": wall,
        "samples": steps * GROUP_SIZE * GROUPS,
        "generator_busy_frac": total("generator/busy_s") / wall,
        "trainer_busy_frac": train / wall,
        "train_push_s_per_step": train / steps,
        "rollout_s_per_group": statistics.mean(r["time/rollout_s"] for r in rows if "time/rollout_s" in r),
        "staleness_max": max(r["staleness_max"] for r in rows),
    }


async def measure(steps: int, runs_dir: Path, model: str) -> dict[bool, dict[int, dict[str, float]]]:
    """Both variants on one set of services (started for the agentic one: the single-turn runs
    leave its gateway and environment pool idle); agentic -> max_staleness -> summary."""
    from apps.grpo import Services, train

    cfgs = {agentic: {k: config(k, steps, runs_dir, model, agentic) for k in (0, 1, 4)} for agentic in (False, True)}
    services = await Services.start(cfgs[True][0])
    variants: dict[bool, dict[int, dict[str, float]]] = {False: {}, True: {}}
    try:
        for agentic, modes in cfgs.items():
            for k, cfg in modes.items():
                shutil.rmtree(runs_dir / cfg.run_name, ignore_errors=True)
                await train(cfg, services)
                variants[agentic][k] = summary(runs_dir / cfg.run_name, steps)
    finally:
        await services.shutdown()
    return variants


def compare(modes: dict[int, dict[str, float]], steps: int) -> dict[str, Any]:
    """Async and one-step off-policy against on-policy, and the ideal from the on-policy run's
    stage times: GROUPS groups per step through ROLLOUTS concurrent rollouts, overlapped with training."""
    sync = modes[0]
    ideal_step = max(sync["rollout_s_per_group"] * GROUPS / ROLLOUTS, sync["train_push_s_per_step"])
    ideal = sync["wall_s"] / steps / ideal_step
    return {
        "speedup_async_vs_sync": sync["wall_s"] / modes[4]["wall_s"],
        "speedup_one_step_vs_sync": sync["wall_s"] / modes[1]["wall_s"],
        "ideal_speedup": ideal,
        "async_fraction_of_ideal": sync["wall_s"] / modes[4]["wall_s"] / ideal,
        "modes": {f"max_staleness={k}": v for k, v in modes.items()},
    }


def main(argv: list[str] | None = None) -> dict:
    a = parse_args("async_vs_sync", __doc__, "3 steps per mode (smoke run)", argv)
    steps = 3 if a.quick else 20
    runs, model = ROOT / "runs/bench_async_vs_sync", tiny_model()
    variants = asyncio.run(measure(steps, runs, model))
    result = compare(variants[False], steps)
    result["agentic"] = compare(variants[True], steps)
    result["steps"] = steps
    result["workload"] = {
        "group_size": GROUP_SIZE,
        "groups_per_step": GROUPS,
        "rollout_tasks": ROLLOUTS,
        "short_tokens": SHORT,
        "cap_tokens": CAP,
        "cap_frac": 0.1,
        "task_latency_median_s": TASK_MEDIAN_S,
        "task_latency_sigma": TASK_SIGMA,
        "task_latency_cap_s": TASK_CAP_S,
        "sample_jitter_sigma": JITTER_SIGMA,
        "agentic": AGENTIC,
    }
    print(
        f"{'variant':<13}{'max_staleness':>14}{'wall s':>9}{'speedup':>9}{'gen busy':>10}{'train busy':>12}"
        f"{'staleness max':>15}"
    )
    for variant, r in (("single-turn", result), ("agentic", result["agentic"])):
        sync = r["modes"]["max_staleness=0"]["wall_s"]
        for mode, m in r["modes"].items():
            print(
                f"{variant:<13}{mode.split('=')[1]:>14}{m['wall_s']:>9.1f}{sync / m['wall_s']:>9.2f}"
                f"{m['generator_busy_frac']:>10.2f}{m['trainer_busy_frac']:>12.2f}{m['staleness_max']:>15.0f}"
            )
    for variant, r in (("single-turn", result), ("agentic", result["agentic"])):
        print(
            f"{variant}: ideal speedup {r['ideal_speedup']:.2f} (from the on-policy run's stage times); "
            f"async reaches {r['async_fraction_of_ideal'] * 100:.0f}% of it"
        )
    return write_result(a.out, result)


if __name__ == "__main__":
    sys.exit(main() and 0)
