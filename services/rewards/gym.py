"""The `reasoning_gym` reward: the sample's reasoning-gym generator scores the model's answer
with its own `score_answer(answer, entry)`. The sample carries its entry (question, answer,
metadata) and its generator's task and config (forge.sources.ReasoningGymPrompts puts them in its
meta), so no answer column is needed and each task keeps its own notion of right."""

from __future__ import annotations

import functools
import json
from typing import Any

import reasoning_gym
from reasoning_gym.utils import extract_answer

from forge.sources import GYM_COLUMNS
from forge.types import RewardInput, reward_range


@functools.cache
def _generator(task: str, config: str) -> Any:
    """One generator per (task, config) in this process: scoring needs its config, not its entries."""
    return reasoning_gym.create_dataset(task, **json.loads(config))


def model_answer(completion: str) -> str:
    """The answer in a completion: after its reasoning (`</think>`), inside its last
    <answer>...</answer> when it has one (reasoning-gym's prompts ask for them), else all of it,
    stripped as the `exact` reward strips it."""
    text = completion.rsplit("</think>", 1)[-1]
    tagged = extract_answer(text)
    return (tagged if tagged is not None else text).strip()


@reward_range(0, 1)
def score(s: RewardInput) -> dict[str, float]:
    """The generator's score in [0, 1]; `correct` when it is full marks."""
    spec = s.task.get("reasoning_gym")
    if not spec:
        raise ValueError(
            f"sample of {s.task.get('task')!r} is not a reasoning-gym entry (no 'reasoning_gym' in its row): "
            "the reasoning_gym reward scores dataset.reasoning_gym's samples"
        )
    entry = {k: s.task.get(k) for k in GYM_COLUMNS}
    generator = _generator(spec["task"], json.dumps(spec["config"], sort_keys=True))
    got = float(generator.score_answer(model_answer(s.completion), entry))
    return {"reward": got, "correct": float(got >= 1.0)}
