"""One prompt's rollout: generate a group, score it, turn it into GRPO Episodes.

An app's `rollout` config key names the rollout function ("package.module:name"), so a
multi-turn or tool-using rollout replaces `generate_and_score` without touching the loop.
"""

from __future__ import annotations

from typing import Any

import torch

from forge.losses import group_advantages
from forge.tasks import Sample
from forge.types import Completion, Episode, RewardInput, Score


class RolloutError(TypeError):
    """A rollout function returned something other than its contract says: the run stops at
    once (every later call would fail the same way)."""


async def generate_and_score(sample: Sample, gen: Any, rewards: Any, cfg: Any) -> tuple[list[Completion], list[Score]]:
    """`cfg.group_size` completions of `sample.prompt` from the generator service, scored by
    the reward service. A custom rollout has this signature (`cfg` is the app's config) and
    returns Scores, or dicts of a Score's fields."""
    group = await gen.generate.route(sample.prompt, n=cfg.group_size)
    scores = await rewards.score.route([RewardInput(sample.row(), c.text, c.finish_reason) for c in group])
    return group, scores


def check_rollout(result: Any, where: str) -> tuple[list[Completion], list[Score]]:
    """`result` as (completions, scores), or a RolloutError that says what `where` returned wrong."""
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise RolloutError(f"{where} returned a {type(result).__name__}, not a (completions, scores) pair")
    completions, scores = (list(x) for x in result)
    if len(completions) != len(scores) or not completions:
        raise RolloutError(
            f"{where} returned {len(completions)} completions and {len(scores)} scores (one per completion, at least one)"
        )
    for i, c in enumerate(completions):
        if not isinstance(c, Completion):
            raise RolloutError(f"{where}: completions[{i}] is a {type(c).__name__}, not a forge.types.Completion")
    try:
        return completions, [Score.coerce(s, f"{where}: scores[{i}]") for i, s in enumerate(scores)]
    except TypeError as e:
        raise RolloutError(str(e)) from None


REWARD_UNAVAILABLE = ("mask", "zero")  # the GRPO config key `reward_unavailable`


def masked(scores: list[Score], reward_unavailable: str) -> bool:
    """Whether a group stays out of training: with `mask`, when a sample's reward is unknown
    (its infrastructure failed); with `zero` it trains, that reward scored 0."""
    return reward_unavailable == "mask" and any(s.unavailable for s in scores)


def make_group(completions: list[Completion], scores: list[Score], std_normalize: bool = True) -> list[Episode]:
    """Episodes with their scores and group-relative advantages."""
    advantages = group_advantages(torch.tensor([s.reward for s in scores]), std_normalize=std_normalize)
    return [Episode.from_completion(c, score=s, advantage=float(a)) for c, s, a in zip(completions, scores, advantages)]
