"""The built-in rule and verifier rewards: each a RewardInput in, a float (or a dict with
`correct`) out, in [0, 1]. Cheap and pure, so the reward service calls them inline."""

from __future__ import annotations

import re
import string
from collections.abc import Callable
from typing import Any

from forge.tasks import get_task
from forge.types import RewardInput, reward_range


def inline(fn: Callable[[RewardInput], Any]) -> Callable[[RewardInput], Any]:
    """A built-in: values in [0, 1], scored inline (not in a thread like a user's function)."""
    fn.inline = True  # type: ignore[attr-defined]
    return reward_range(0, 1)(fn)


@inline
def exact(s: RewardInput) -> float:
    """1 for exactly the answer, else 0: the verifiable reward of RLVR."""
    return float(s.completion.strip() == s.answer)


@inline
def format_(s: RewardInput) -> float:
    """1 when the model stopped by itself and wrote only the answer's kind of characters."""
    allowed = set(string.ascii_lowercase + string.digits)
    return float(s.finish_reason == "stop" and bool(s.completion) and set(s.completion) <= allowed)


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


def same_number(answer: str, text: str) -> float:
    """1 when `text`'s final number equals the reference `answer`'s (GSM8K: after '####')."""
    want, got = final_number(answer), final_number(text)
    if want is None:
        raise ValueError(f"reference answer {answer[-40:]!r} has no number")
    return float(got is not None and abs(got - want) < 1e-6 * max(1.0, abs(want)))


@inline
def math(s: RewardInput) -> dict[str, float]:
    """The final number matches; also the sample's `correct`."""
    right = same_number(s.answer, s.completion)
    return {"reward": right, "correct": right}


@inline
def task(s: RewardInput) -> float:
    """The sample's toy task's own score (forge/tasks.py; partial credit). A mixture's source
    named otherwise keeps its toy task in `toy_task`."""
    return get_task(s.task.get("toy_task") or s.task["task"]).score(s.completion, s.answer)
