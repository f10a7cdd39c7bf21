"""From one prompt's completions to a scored GRPO group of Episodes."""

from __future__ import annotations

import uuid

import torch

from forge.losses import group_advantages
from forge.types import Completion, Episode


def make_group(completions: list[Completion], scores: list[dict[str, float]], std_normalize: bool = True) -> list[Episode]:
    """Episodes with their rewards and group-relative advantages."""
    rewards = torch.tensor([s["reward"] for s in scores])
    advantages = group_advantages(rewards, std_normalize=std_normalize)
    group_id = uuid.uuid4().hex[:12]
    return [
        Episode.from_completion(c, group_id, reward=s["reward"], advantage=float(a), rewards=dict(s))
        for c, s, a in zip(completions, scores, advantages)
    ]
