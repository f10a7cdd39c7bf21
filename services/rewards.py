"""Reward service: built-in rule/verifier rewards (toy tasks, math final answers, format), a
model judge, and users' own reward functions, by import path.

    rewards = await Rewards.options().as_service(task="reverse", rewards={"task": 1.0, "my.module:fn": 0.5})
    scores = await rewards.score.route([RewardInput(task_row, completion_text, finish_reason), ...])  # [Score]

A built-in reward is a function (answer, text, finish_reason) -> float (see `make_rewards`);
`judge` asks a model served through the OpenAI API (services/judge.py). A user's reward
function ("package.module:function") receives the whole sample, a `forge.types.RewardInput`
(the task row with its columns, prompt, completion, finish reason, the messages of a multi-turn
episode), and returns a float or a dict of named components (its reward is the dict's `reward`,
else the sum of the rest); it may be sync (run in a thread) or async, and may declare its
values with `@forge.types.reward_range(low, high)`. A reward that raises, or returns a value
that is not finite or outside its declared range, scores 0 for that sample and marks its Score
failed: it never ends the run. One that raises
`RewardUnavailable` (its infrastructure failed) also marks the Score `unavailable`.
"""

from __future__ import annotations

import asyncio
import logging
import re
import string
from collections.abc import Callable
from typing import Any

from monarch.actor import endpoint

from forge.actor import ForgeActor
from forge.config import ConfigError, import_object
from forge.env import call
from forge.tasks import TASKS, get_task
from forge.types import RewardInput, RewardUnavailable, Score, check_reward, reward_range
from services.judge import Judge, JudgeConfig
from services.sandbox import CodeTests, CodeTestsConfig

log = logging.getLogger("forge")
RewardFn = Callable[[str, str, str], float]


@reward_range(0, 1)
def format_reward(answer: str, text: str, finish_reason: str) -> float:
    """1 when the model stopped by itself and wrote only the answer's kind of characters."""
    allowed = set(string.ascii_lowercase + string.digits)
    return float(finish_reason == "stop" and bool(text) and set(text) <= allowed)


@reward_range(0, 1)
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


@reward_range(0, 1)
def math_reward(answer: str, text: str, finish_reason: str) -> float:
    """1 when the response's final number equals the reference's (GSM8K: after '####')."""
    want, got = final_number(answer), final_number(text)
    if want is None:
        raise ValueError(f"reference answer {answer[-40:]!r} has no number")
    return float(got is not None and abs(got - want) < 1e-6 * max(1.0, abs(want)))


def _task_reward(task: str) -> RewardFn:
    t = get_task(task)
    return reward_range(0, 1)(lambda answer, text, finish_reason: t.score(text, answer))


def make_rewards(task: str) -> dict[str, RewardFn]:
    """`exact`: 0/1; `math`: the final number matches; `format`: stopped cleanly; `task`: a toy
    task's own score (partial credit)."""
    rewards = {"exact": exact_reward, "math": math_reward, "format": format_reward}
    if task in TASKS:
        rewards["task"] = _task_reward(task)
    return rewards


def user_reward(name: str) -> Callable[[RewardInput], Any]:
    """The reward function a "package.module:function" name imports, checked callable."""
    fn = import_object(f"rewards.{name}", name)
    if not callable(fn):
        raise ConfigError(f"config key 'rewards.{name}': {type(fn).__name__} is not a function")
    return fn


def check_rewards(
    task: str, weights: dict[str, float], judge: JudgeConfig | None = None, code_tests: CodeTestsConfig | None = None
) -> None:
    """Every name is a built-in reward or an importable function (imported here, before anything
    spawns); with `judge`, its section is complete."""
    known = [*make_rewards(task), "judge", "code_tests"]
    unknown = sorted(n for n in weights if n not in known and ":" not in n)
    if unknown:
        raise ValueError(
            f"unknown reward(s) {unknown} (config key 'rewards'); known: {', '.join(known)}, "
            "or a function 'package.module:function'"
        )
    if not weights:
        raise ValueError("config key 'rewards' is empty: name at least one reward")
    for name in weights:
        if ":" in name:
            user_reward(name)
    if "judge" in weights:
        (judge or JudgeConfig()).check()
    if "code_tests" in weights:
        (code_tests or CodeTestsConfig()).sandbox.validate()


class Rewards(ForgeActor):
    """Scores completions: the weighted sum of the configured rewards, and each component."""

    @classmethod
    def check_args(
        cls,
        task: str,
        rewards: dict[str, float],
        judge: JudgeConfig | None = None,
        code_tests: CodeTestsConfig | None = None,
    ) -> None:
        check_rewards(task, rewards, judge, code_tests)

    def __init__(
        self,
        task: str,
        rewards: dict[str, float],
        judge: JudgeConfig | None = None,
        code_tests: CodeTestsConfig | None = None,
    ):
        self.task, self.weights = task, dict(rewards)
        builtin = make_rewards(task)
        self.builtin = {name: fn for name, fn in builtin.items() if name in rewards}
        # The others see the whole sample: the judge, code_tests, and users' functions.
        made = {"judge": lambda: Judge(judge or JudgeConfig()), "code_tests": lambda: CodeTests(code_tests)}
        self.on_sample = {
            name: made[name]() if name in made else user_reward(name) for name in rewards if name not in builtin
        }

    @endpoint
    async def score(self, samples: list[RewardInput]) -> list[Score]:
        """For each sample: the weighted total, each component, and `correct` (a user reward's
        `correct`, else the `math` reward when configured, else exact match)."""
        return list(await asyncio.gather(*(self._score(s) for s in samples)))

    async def _one(self, name: str, s: RewardInput) -> Score:
        """One reward's Score, checked finite and within the range its function declares."""
        if name in self.builtin:
            fn: Any = self.builtin[name]
            out = fn(s.answer, s.completion, s.finish_reason)
        else:
            fn = self.on_sample[name]
            out = await call(fn, s)
        one = Score.coerce(out, f"returned {out!r}", loose=True)
        check_reward(one.reward, "its reward", getattr(fn, "reward_range", None))
        return one

    async def _score(self, s: RewardInput) -> Score:
        parts, errors, correct, unavailable = {}, [], None, None
        for name in self.weights:
            try:
                one = await self._one(name, s)
            except Exception as e:  # a broken reward scores 0 and is counted, the run goes on
                log.warning("forge: reward %r failed on %r: %s", name, s.completion[:40], e)
                errors.append(f"{name}: {type(e).__name__}: {e}")
                if isinstance(e, RewardUnavailable):  # unknown, not wrong: the app masks it or scores 0
                    unavailable = unavailable or e.kind
                one = Score(0.0)
            parts[name] = one.reward
            parts.update({f"{name}/{k}": v for k, v in one.components.items()})
            correct = correct if one.correct is None else one.correct
        if correct is None:
            correct = parts["math"] if "math" in parts else exact_reward(s.answer, s.completion, s.finish_reason)
        return Score(
            reward=sum(w * parts[n] for n, w in self.weights.items()),
            components=parts,
            correct=correct,
            error="; ".join(errors) or None,
            unavailable=unavailable,
        )
