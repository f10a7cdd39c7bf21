"""Reward service: rule/verifier rewards (toy tasks, math final answers), plus a format reward.

    rewards = await Rewards.options().as_service(task="reverse", rewards={"task": 1.0, "format": 0.1})
    scores = await rewards.score.route([(answer, completion_text, finish_reason), ...])  # [Score]

Each reward is a function (answer, text, finish_reason) -> float (see `make_rewards`). One
that raises scores 0 for that sample and marks its Score failed: it never ends the run.
"""

from __future__ import annotations

import logging
import re
import string
from collections.abc import Callable

from monarch.actor import endpoint

from forge.actor import ForgeActor
from forge.tasks import TASKS, get_task
from forge.types import Score

log = logging.getLogger("forge")
RewardFn = Callable[[str, str, str], float]


def format_reward(answer: str, text: str, finish_reason: str) -> float:
    """1 when the model stopped by itself and wrote only the answer's kind of characters."""
    allowed = set(string.ascii_lowercase + string.digits)
    return float(finish_reason == "stop" and bool(text) and set(text) <= allowed)


def exact_reward(answer: str, text: str, finish_reason: str) -> float:
    """1 for exactly the answer, else 0: the verifiable reward of RLVR."""
    return float(text.strip() == answer)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> float | None:
    """The answer a math solution ends with: \\boxed{...}, else after '####', else its last number."""
    for marker in (r"\\boxed\{([^}]*)\}", r"####\s*([^\n]*)"):
        found = re.findall(marker, text)
        if found:
            text = found[-1]
            break
    numbers = _NUMBER.findall(text)
    return float(numbers[-1].replace(",", "")) if numbers else None


def math_reward(answer: str, text: str, finish_reason: str) -> float:
    """1 when the response's final number equals the reference's (GSM8K: after '####')."""
    want, got = final_number(answer), final_number(text)
    if want is None:
        raise ValueError(f"reference answer {answer[-40:]!r} has no number")
    return float(got is not None and abs(got - want) < 1e-6 * max(1.0, abs(want)))


def _task_reward(task: str) -> RewardFn:
    t = get_task(task)
    return lambda answer, text, finish_reason: t.score(text, answer)


def make_rewards(task: str) -> dict[str, RewardFn]:
    """`exact`: 0/1; `math`: the final number matches; `format`: stopped cleanly; `task`: a toy
    task's own score (partial credit)."""
    rewards = {"exact": exact_reward, "math": math_reward, "format": format_reward}
    if task in TASKS:
        rewards["task"] = _task_reward(task)
    return rewards


def check_rewards(task: str, weights: dict[str, float]) -> None:
    known = make_rewards(task)
    unknown = sorted(set(weights) - set(known))
    if unknown:
        raise ValueError(f"unknown reward(s) {unknown} (config key 'rewards'); known: {', '.join(known)}")
    if not weights:
        raise ValueError("config key 'rewards' is empty: name at least one reward")


class Rewards(ForgeActor):
    """Scores completions: the weighted sum of the configured rewards, and each component."""

    @classmethod
    def check_args(cls, task: str, rewards: dict[str, float]) -> None:
        check_rewards(task, rewards)

    def __init__(self, task: str, rewards: dict[str, float]):
        self.task, self.weights = task, dict(rewards)
        self.fns = {name: fn for name, fn in make_rewards(task).items() if name in rewards}

    @endpoint
    async def score(self, samples: list[tuple[str, str, str]]) -> list[Score]:
        """For each (answer, text, finish_reason): the weighted total, each component, and
        `correct` (the `math` reward when configured, else exact match)."""
        out = []
        for answer, text, finish in samples:
            parts, errors = {}, []
            for name, fn in self.fns.items():
                try:
                    parts[name] = float(fn(answer, text, finish))
                except Exception as e:  # a broken reward scores 0 and is counted, the run goes on
                    log.warning("forge: reward %r failed on %r: %s", name, text[:40], e)
                    parts[name] = 0.0
                    errors.append(f"{name}: {type(e).__name__}: {e}")
            correct = parts["math"] if "math" in parts else exact_reward(answer, text, finish)
            out.append(
                Score(
                    reward=sum(self.weights[n] * parts[n] for n in self.fns),
                    components=parts,
                    correct=correct,
                    error="; ".join(errors) or None,
                )
            )
        return out
