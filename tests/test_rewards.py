"""Reward functions and the reward service: verifiers, weights, failures scored 0."""

import asyncio

import pytest

from forge.types import Score
from services.rewards import Rewards, check_rewards, final_number, math_reward


@pytest.mark.parametrize(
    "text, number",
    [
        ("3 + 4 = 7\n#### 7", 7.0),
        ("so the answer is \\boxed{1,234}.", 1234.0),
        ("x = 3, then -4.5", -4.5),
        ("#### 12 apples", 12.0),
        ("no digits", None),
    ],
)
def test_final_number(text, number):
    assert final_number(text) == number


def test_math_reward():
    assert math_reward("2 + 5 = 7\n#### 7", "Two plus five is 7.", "stop") == 1.0
    assert math_reward("#### 7", "#### 7.0", "stop") == 1.0
    assert math_reward("#### 7", "I think 8", "stop") == 0.0
    with pytest.raises(ValueError, match="has no number"):
        math_reward("seven", "7", "stop")


def test_unknown_reward_names_what_is_known():
    with pytest.raises(ValueError, match=r"unknown reward\(s\) \['task'\].*known: exact, math, format"):
        check_rewards("gsm8k", {"task": 1.0})  # partial credit exists only for toy tasks


def test_reward_service_weights_and_failures():
    async def main():
        svc = await Rewards.options().as_service("gsm8k", {"math": 1.0, "format": 0.5})
        try:
            return await svc.score.route([("#### 7", "7", "stop"), ("#### 7", "8", "length"), ("seven", "7", "stop")])
        finally:
            await svc.shutdown()

    ok, wrong, broken = asyncio.run(main())
    assert ok == Score(reward=1.5, components={"math": 1.0, "format": 1.0}, correct=1.0)
    assert wrong.reward == 0.0 and wrong.correct == 0.0 and not wrong.failed
    # the reference has no number: the math reward raises, scores 0 and is marked; the run goes on
    assert broken.components["math"] == 0.0 and broken.reward == 0.5
    assert broken.failed and "math: ValueError: reference answer 'seven' has no number" in broken.error
