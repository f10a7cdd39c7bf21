"""Prompt streams for RL apps, as torchdata nodes (stateful, so a resumed run continues
from the same data position)."""

from __future__ import annotations

import random
from typing import Any

from torchdata.nodes import BaseNode

from forge.tasks import Sample, get_task


class TaskPrompts(BaseNode[Sample]):
    """An endless, seeded stream of toy-task samples; sample i depends only on (seed, i)."""

    def __init__(self, task: str, seed: int = 0):
        super().__init__()
        self.task, self.seed, self.index = get_task(task), seed, 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.index = initial_state["index"] if initial_state else 0

    def next(self) -> Sample:
        sample = self.task.sample(random.Random(f"{self.seed}:{self.index}"))
        self.index += 1
        return sample

    def get_state(self) -> dict[str, Any]:
        return {"index": self.index}
