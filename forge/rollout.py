"""One prompt's rollout: generate a group, score it, turn it into GRPO Episodes.

An app's `rollout` config key names the rollout function ("package.module:name"), so a
multi-turn or tool-using rollout replaces `generate_and_score` without touching the loop.
"""

from __future__ import annotations

import uuid
from typing import Any

import torch

from forge.losses import group_advantages
from forge.tasks import Sample
from forge.types import Completion, Episode


async def generate_and_score(sample: Sample, gen: Any, rewards: Any, cfg: Any) -> tuple[list[Completion], list[dict[str, float]]]:
    """`cfg.group_size` completions of `sample.prompt` from the generator service, scored by
    the reward service. A custom rollout has this signature (`cfg` is the app's config)."""
    group = await gen.generate.route(sample.prompt, n=cfg.group_size)
    scores = await rewards.score.route([(sample.answer, c.text, c.finish_reason) for c in group])
    return group, scores


def make_group(completions: list[Completion], scores: list[dict[str, float]], std_normalize: bool = True) -> list[Episode]:
    """Episodes with their rewards and group-relative advantages."""
    rewards = torch.tensor([s["reward"] for s in scores])
    advantages = group_advantages(rewards, std_normalize=std_normalize)
    group_id = uuid.uuid4().hex[:12]
    return [
        Episode.from_completion(c, group_id, reward=s["reward"], advantage=float(a), rewards=dict(s))
        for c, s, a in zip(completions, scores, advantages)
    ]
