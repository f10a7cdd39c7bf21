"""Rewards: the built-in rule and verifier rewards, a model judge, code run against tests, a
trained reward model, and users' own reward functions by import path, all with one signature,
weighted into one Score.

    rewards:                                   # the config section: a RewardsConfig
      weights: {task: 1.0, my.module:fn: 0.5}  # name -> weight; empty: {exact: 1.0}
      judge: {base_url: ..., model: ...}       # the `judge` reward's endpoint and rubric
      code_tests: {all_pass: false}            # the `code_tests` reward's sandbox
      reward_model: {path: runs/rm_tiny/model} # the `reward_model` reward's checkpoint

    rewards = await Rewards.options().as_service(cfg.rewards)
    scores = await rewards.score.route([RewardInput(task_row, completion_text, finish_reason), ...])  # [Score]

A reward function receives the whole sample, a `forge.types.RewardInput` (the task row with its
columns, prompt, completion, finish reason, the messages of a multi-turn episode), and returns a
float or a dict of named components (its reward is the dict's `reward`, else the sum of the
rest; a `correct` key is the sample's correctness); it may be sync (run in a thread) or async,
and may declare its values with `@forge.types.reward_range(low, high)`. `REWARDS` names the
built-ins (services/rewards/builtin.py, judge.py, code_tests.py, reward_model.py, gym.py; a config is checked against
their names, `services.schema.REWARD_NAMES`); any other name is a "package.module:function".
A reward that raises (any exception, SystemExit too), or returns a value that is not finite (as
a float32) or outside its declared range, scores 0 for that sample and marks its Score failed:
it never ends the run. One that raises `RewardUnavailable` (its infrastructure failed), or runs
past `rewards.timeout_s` (then it is abandoned), also marks the Score `unavailable`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from monarch.actor import endpoint

from forge.actor import ForgeActor
from forge.config import import_object
from forge.env import call
from forge.rollout import within
from forge.types import RewardInput, RewardUnavailable, Score, check_reward
from services.rewards import builtin
from services.rewards.code_tests import CodeTests
from services.rewards.judge import Judge
from services.rewards.reward_model import RewardModel
from services.schema import RewardsConfig, user_reward

log = logging.getLogger("forge")


RewardFn = Callable[[RewardInput], Any]
# Sync rewards running at once per replica, in threads of the service's own: a hung one holds
# its thread (a thread cannot be stopped), never the event loop's default executor.
REWARD_THREADS = 32
# The built-in rewards: name -> its function, made from the section.
REWARDS: dict[str, Callable[[RewardsConfig], RewardFn]] = {
    "exact": lambda cfg: builtin.exact,
    "math": lambda cfg: builtin.math,
    "format": lambda cfg: builtin.format_,
    "task": lambda cfg: builtin.task,
    "judge": lambda cfg: Judge(cfg.judge),
    "code_tests": lambda cfg: CodeTests(cfg.code_tests),
    "reward_model": lambda cfg: RewardModel(cfg.reward_model),
    # By name, as a user's reward is: reasoning_gym takes ~2 s to import, for runs that use it.
    "reasoning_gym": lambda cfg: import_object("rewards.weights.reasoning_gym", "services.rewards.gym:score"),
}


def build_rewards(cfg: RewardsConfig) -> dict[str, RewardFn]:
    """The reward functions of a validated `rewards` section, by name."""
    return {n: REWARDS[n](cfg) if n in REWARDS else user_reward(n) for n in cfg.weights}


class Rewards(ForgeActor):
    """Scores completions: the weighted sum of the configured rewards, and each component."""

    @classmethod
    def check_args(cls, cfg: RewardsConfig) -> None:
        """A section made in Python, not loaded from a config, is checked (and completed) here."""
        if not isinstance(cfg, RewardsConfig):
            raise TypeError(f"Rewards: cfg must be a RewardsConfig, got {type(cfg).__name__}")
        cfg.validate()

    def __init__(self, cfg: RewardsConfig):  # a validated section (check_args validates it)
        self.weights, self.fns = dict(cfg.weights), build_rewards(cfg)
        self.timeout_s = cfg.timeout_s
        self.threads = ThreadPoolExecutor(REWARD_THREADS, thread_name_prefix="forge-reward")

    @endpoint
    async def score(self, samples: list[RewardInput]) -> list[Score]:
        """For each sample: the weighted total, each component, and `correct` (the last reward's
        that gives one, else exact match)."""
        return list(await asyncio.gather(*(self._score(s) for s in samples)))

    async def _one(self, name: str, s: RewardInput) -> Score:
        """One reward's Score, checked finite and within the range its function declares."""
        fn = self.fns[name]
        late = f"no value within {self.timeout_s} s (config key 'rewards.timeout_s')"
        if getattr(fn, "inline", False):
            out = fn(s)
        else:
            try:  # its own task, abandoned at the timeout even if it ignores its cancellation
                out = await within(call(fn, s, threads=self.threads), self.timeout_s, late)
            except TimeoutError as e:  # unknown, not wrong (a slow judge, a reward model loading)
                raise RewardUnavailable(name, str(e)) from None
        one = Score.coerce(out, f"returned {out!r}", loose=True)
        check_reward(one.reward, "its reward", getattr(fn, "reward_range", None))
        return one

    async def _score(self, s: RewardInput) -> Score:
        parts, errors, correct, unavailable = {}, [], None, None
        for name in self.weights:
            try:
                one = await self._one(name, s)
            except Exception as e:  # a broken (hung, exiting) reward scores 0 and is counted, the run goes on
                log.warning("forge: reward %r failed on %r: %s", name, s.completion[:40], e)
                errors.append(f"{name}: {type(e).__name__}: {e}")
                if isinstance(e, RewardUnavailable):  # unknown, not wrong: the app masks it or scores 0
                    unavailable = unavailable or e.kind
                one = Score(0.0)
            parts[name] = one.reward
            parts.update({f"{name}/{k}": v for k, v in one.components.items()})
            correct = correct if one.correct is None else one.correct
        return Score(
            reward=sum(w * parts[n] for n, w in self.weights.items()),
            components=parts,
            correct=builtin.exact(s) if correct is None else correct,
            error="; ".join(errors) or None,
            unavailable=unavailable,
        )
