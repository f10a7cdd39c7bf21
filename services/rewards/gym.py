"""The `reasoning_gym` reward: the sample's reasoning-gym generator scores the model's answer
with its own `score_answer(answer, entry)`. The sample carries its entry (question, answer,
metadata) and its generator's task and config (forge.sources.ReasoningGymPrompts puts them in its
meta), so no answer column is needed and each task keeps its own notion of right."""

from __future__ import annotations

import functools
import json
from typing import Any

import reasoning_gym

from forge.sources import GYM_COLUMNS
from forge.types import RewardInput, reward_range
from services.rewards.builtin import after_thinking


@functools.cache
def _generator(task: str, config: str) -> Any:
    """One generator per (task, config) in this process: scoring needs its config, not its entries."""
    return reasoning_gym.create_dataset(task, **json.loads(config))


def model_answer(completion: str, thinking: bool = False) -> str:
    """The answer in a completion: after its reasoning (none when it was cut while thinking), inside
    its last <answer>...</answer> when it has one (reasoning-gym's prompts ask for them), else all of
    it, stripped as the `exact` reward strips it."""
    text = after_thinking(completion, thinking)
    tagged = last_answer_tag(text)
    return (tagged if tagged is not None else text).strip()


def last_answer_tag(text: str) -> str | None:
    """What reasoning-gym's `extract_answer` finds (its last `<answer>(.*?)</answer>`), by `find`:
    its regex rescans the rest of the text from each unclosed <answer> (quadratic)."""
    found, start = None, text.find("<answer>")
    while start >= 0:
        end = text.find("</answer>", start + len("<answer>"))
        if end < 0:
            break
        found, start = text[start + len("<answer>") : end], text.find("<answer>", end + len("</answer>"))
    return found


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
    got = float(generator.score_answer(model_answer(s.completion, s.thinking), entry))
    return {"reward": got, "correct": float(got >= 1.0)}
