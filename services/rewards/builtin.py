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
    """1 for exactly the answer, else 0: the verifiable reward of RLVR. A row without an answer (a
    null or empty cell) fails: an empty completion would be exactly it."""
    if not s.answer.strip():
        raise ValueError("the row has no answer (its answer column is empty): nothing to compare with")
    return float(s.completion.strip() == s.answer)


@inline
def format_(s: RewardInput) -> float:
    """1 when the model stopped by itself and wrote only the answer's kind of characters."""
    allowed = set(string.ascii_lowercase + string.digits)
    return float(s.finish_reason == "stop" and bool(s.completion) and set(s.completion) <= allowed)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
# A reasoning model's thoughts: <think> blocks, an unclosed one (cut at max_tokens) to the end, and
# text before a </think> whose <think> the chat template wrote (or, `thinking`, all of an unclosed one).
THINKING = re.compile(r"<think>.*?(?:</think>|\Z)|\A.*?</think>", re.S)


def after_thinking(text: str, thinking: bool = False) -> str:
    """`text` without its reasoning: the answer a reasoning model gave, if any. `thinking`: the
    text starts inside a <think> block its prompt opened (RewardInput.thinking)."""
    return THINKING.sub("", "<think>" + text if thinking else text)


def last_boxed(text: str) -> str | None:
    """The last \\boxed{...}'s content, to its first '}'. Split at the '}'s, not by a regex,
    which would rescan the rest of the text from each unclosed \\boxed{ (quadratic)."""
    for piece in reversed(text.split("}")[:-1]):  # the pieces a '}' ends
        if "\\boxed{" in piece:
            return piece[piece.index("\\boxed{") + len("\\boxed{") :]
    return None


def final_number(text: str) -> float | None:
    """The answer a math solution ends with: \\boxed{...}, else after '####', else its last number."""
    boxed = last_boxed(text)
    found = [boxed] if boxed is not None else re.findall(r"####\s*([^\n]*)", text)
    numbers = _NUMBER.findall(found[-1] if found else text)
    return float(numbers[-1].replace(",", "")) if numbers else None


def same_number(answer: str, text: str, thinking: bool = False) -> float:
    """1 when the final number of `text`'s answer (after any reasoning) equals the reference
    `answer`'s (GSM8K: after '####'), to within float noise, not a tolerance that grows with it."""
    want, got = final_number(answer), final_number(after_thinking(text, thinking))
    if want is None:
        raise ValueError(f"reference answer {answer[-40:]!r} has no number")
    return float(got is not None and abs(got - want) < 1e-6)


@inline
def math(s: RewardInput) -> dict[str, float]:
    """The final number matches; also the sample's `correct`."""
    right = same_number(s.answer, s.completion, s.thinking)
    return {"reward": right, "correct": right}


@inline
def task(s: RewardInput) -> float:
    """The sample's toy task's own score (forge/tasks.py; partial credit). A mixture's source
    named otherwise keeps its toy task in `toy_task`."""
    return get_task(s.task.get("toy_task") or s.task["task"]).score(s.completion, s.answer)
