"""Custom GRPO rollouts that break the contract, for tests/test_grpo.py (imported by name)."""

import asyncio

from forge.rollout import generate_and_score


async def score_without_reward(sample, gen, rewards, cfg):
    group, scores = await generate_and_score(sample, gen, rewards, cfg)
    return group, [{"correct": s.correct} for s in scores]  # an old-style dict missing `reward`


async def always_raises(sample, gen, rewards, cfg):
    raise ConnectionError(f"tool server unreachable for {sample.prompt!r}")


async def never_returns(sample, gen, rewards, cfg):
    await asyncio.Event().wait()
