"""Custom GRPO rollouts that break the contract, and user reward functions, for
tests/test_grpo.py and tests/test_rewards.py (imported by name)."""

import asyncio
import zlib

from forge.rollout import generate_and_score
from forge.types import RewardUnavailable, reward_range


async def score_without_reward(sample, gen, rewards, cfg):
    group, scores = await generate_and_score(sample, gen, rewards, cfg)
    return group, [{"correct": s.correct} for s in scores]  # an old-style dict missing `reward`


async def always_raises(sample, gen, rewards, cfg):
    raise ConnectionError(f"tool server unreachable for {sample.prompt!r}")


async def never_returns(sample, gen, rewards, cfg):
    await asyncio.Event().wait()


@reward_range(0, 1)
def reported_fraction(sample):
    """A grader that trusts the count a graded program reported (the row's `passed`)."""
    return sample.task["passed"] / 2


def number_in_text(sample):
    """A reward that parses the completion: 'nan' and 'inf' parse too."""
    return float(sample.completion)


CUTOFF = 3  # not a function: a config naming it fails before anything spawns


def length_reward(sample):
    """A sync user reward: 1 when the completion is no longer than the row's `max_len` column."""
    return float(len(sample.completion) <= sample.task["max_len"])


async def graded_reward(sample):
    """An async user reward with named components; its `correct` feeds `accuracy`."""
    await asyncio.sleep(0)
    stopped = 0.5 * (sample.finish_reason == "stop")
    digits = 0.25 * sample.completion.isdigit()
    return {
        "reward": stopped + digits,
        "stopped": stopped,
        "digits": digits,
        "correct": float(sample.completion == sample.answer),
    }


def knows_its_task(sample):
    """1 when the sample is the reverse task's, with its prompt, answer and row; raises otherwise
    (a raising reward scores 0: a GRPO run using it shows every reward went through it)."""
    row = sample.task
    if not (row["task"] == "reverse" and sample.prompt.startswith("rev ") and row["answer"] == sample.answer):
        raise ValueError(f"unexpected sample {row}")
    return 1.0


def sandboxed(sample):
    """1 when its sandbox runs; the sandbox "crashes" for about half the prompts (always the
    same ones), making the reward unavailable, not 0."""
    if zlib.crc32(sample.prompt.encode()) % 2:
        raise RewardUnavailable("sandbox", f"sandbox crashed on {sample.prompt!r}")
    return 1.0
