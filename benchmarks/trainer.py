"""forge Trainer.train_step (a service call) vs a bare torchtitan step, same model and batch.

    python -m benchmarks.trainer [--quick]

The bare step is torchtitan used directly (FSDP2 on 1 rank, the same AdamW, clipping and
GRPO loss), timed inside its own Monarch process so both sides run in the same kind of
process; the forge step is `await trainer.train_step.route(batch)` timed from the caller,
so it adds the Monarch message, the batch's pickling and forge's metrics. Rounds of each
alternate (2 cores: load drifts) and medians are compared. Writes
benchmarks/results/trainer.json with `overhead` = forge / bare - 1.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

import torch
from monarch.actor import endpoint

from benchmarks.common import parse_args, tiny_model, write_result
from forge.actor import ForgeActor

GOAL = "≤ 5% overhead"  # the target the manual's results page shows beside the figures


def batch(rows: int, seq: int):
    from forge.types import Episode, collate

    g = torch.Generator().manual_seed(0)
    eps = [
        Episode(
            tokens=torch.randint(6, 100, (seq,), generator=g).tolist(),
            loss_mask=[0] * 8 + [1] * (seq - 8),
            gen_logprobs=[-4.6] * seq,
            advantage=float(i % 2) - 0.5,
        )
        for i in range(rows)
    ]
    return collate(eps, pad_id=0)


class BareTitan(ForgeActor):
    """The same model, optimizer and loss as the Trainer, stepped with no forge code around it."""

    distributed = True

    def __init__(self, model_dir: str, threads: int):
        self.model_dir, self.threads = model_dir, threads

    @endpoint
    async def setup(self) -> None:
        from services.schema import TrainerConfig
        from services.titan import build_sharded_model, default_device, init_distributed
        from services.trainer import build_optimizers

        torch.set_num_threads(self.threads)
        device = default_device()
        init_distributed(device)
        self.model = build_sharded_model(self.model_dir, device)  # the trainer's own model setup
        self.opt, self.sched = build_optimizers(self.model, TrainerConfig(lr=1e-5, total_steps=1000))

    @endpoint
    async def steps(self, b, n: int) -> list[float]:
        from torchtitan.distributed import utils as dist_utils

        from forge.losses import grpo, importance_weight
        from forge.schema import LossConfig
        from services.titan import token_logprobs

        cfg, times = LossConfig(), []
        for _ in range(n):
            t = time.perf_counter()
            self.opt.zero_grad()
            lp, _ = token_logprobs(self.model, b.input_ids, with_entropy=True)
            grpo(lp, b, importance_weight(lp, b, cfg), cfg).backward()
            dist_utils.clip_grad_norm_(list(self.model.parameters()), max_norm=1.0, foreach=True)
            self.opt.step()
            self.sched.step()
            times.append(time.perf_counter() - t)
        return times


async def measure(model_dir: str, b, rounds: int, steps: int, threads: int) -> tuple[list[float], list[float]]:
    from services.schema import TrainerConfig
    from services.trainer import Trainer

    trainer = await Trainer.options().as_service(model_dir, TrainerConfig(lr=1e-5, total_steps=1000, threads=threads))
    bare = await BareTitan.options().as_actor(model_dir, threads)
    forge_times, bare_times = [], []
    try:
        await trainer.train_step.route(b)  # warm-up, not timed
        await bare.steps.call_one(b, 1)
        for _ in range(rounds):
            for _ in range(steps):
                t = time.perf_counter()
                await trainer.train_step.route(b)
                forge_times.append(time.perf_counter() - t)
            bare_times += await bare.steps.call_one(b, steps)
    finally:
        await asyncio.gather(trainer.shutdown(), bare.shutdown())
    return forge_times, bare_times


def main(argv: list[str] | None = None) -> dict:
    a = parse_args("trainer", __doc__, "fewer steps (smoke run)", argv)
    model = tiny_model()
    rounds, steps, threads = (2, 2, 2) if a.quick else (6, 5, 2)
    b = batch(64, 32)
    forge_times, bare_times = asyncio.run(measure(model, b, rounds, steps, threads))
    forge_s, bare_s = statistics.median(forge_times), statistics.median(bare_times)
    result = {
        "bare_torchtitan_step_s": bare_s,
        "forge_train_step_s": forge_s,
        "overhead": forge_s / bare_s - 1,
        "batch": {"rows": 64, "seq": 32},
        "rounds": rounds,
        "steps_per_round": steps,
        "threads": threads,
    }
    print(f"{'step':<24}{'seconds (median)':>18}")
    print(f"{'bare torchtitan':<24}{bare_s:>18.4f}")
    print(f"{'forge train_step':<24}{forge_s:>18.4f}")
    print(f"overhead {result['overhead'] * 100:+.1f}%")
    return write_result(a.out, result)


if __name__ == "__main__":
    sys.exit(main() and 0)
