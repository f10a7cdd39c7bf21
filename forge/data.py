"""Prompt streams for RL apps, as torchdata nodes (stateful, so a resumed run continues
from the same data position)."""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchdata.nodes import BaseNode

from forge.config import ConfigError
from forge.tasks import Sample, get_task

FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass
class DatasetConfig:
    """Prompts from a local file instead of a generated toy task (e.g. GSM8K as parquet/jsonl)."""

    path: str = ""  # empty: the config's toy `task`
    template: str = "{question}"  # the prompt: the row's columns formatted in, e.g. inside a chat template
    answer_key: str = "answer"  # the column the reward compares with

    def validate(self) -> None:
        if self.path and Path(self.path).suffix not in FORMATS:
            raise ConfigError(f"config key 'dataset.path': {self.path} is not one of {', '.join(FORMATS)}")
        if self.path and not Path(self.path).is_file():
            raise ConfigError(f"config key 'dataset.path': file not found: {self.path}")


class IndexedPrompts(BaseNode[Sample]):
    """An endless prompt stream where sample i depends only on (seed, i): the index is the state."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.seed, self.index = seed, 0

    def sample(self, i: int) -> Sample:
        raise NotImplementedError

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.index = initial_state["index"] if initial_state else 0

    def next(self) -> Sample:
        sample = self.sample(self.index)
        self.index += 1
        return sample

    def get_state(self) -> dict[str, Any]:
        return {"index": self.index}


class TaskPrompts(IndexedPrompts):
    """Generated toy-task samples."""

    def __init__(self, task: str, seed: int = 0):
        super().__init__(seed)
        self.task = get_task(task)

    def sample(self, i: int) -> Sample:
        return self.task.sample(random.Random(f"{self.seed}:{i}"))


class FilePrompts(IndexedPrompts):
    """Rows of a local dataset file (through HF `datasets`), reshuffled each epoch from the seed."""

    def __init__(self, cfg: DatasetConfig, seed: int = 0):
        import datasets

        super().__init__(seed)
        cfg.validate()
        self.rows = datasets.load_dataset(FORMATS[Path(cfg.path).suffix], data_files=cfg.path, split="train")
        # A field may index its column ({test_list[0]}): the column is the name before [ or .
        fields = (name for _, name, _, _ in string.Formatter().parse(cfg.template) if name)
        wanted = {re.split(r"[.\[]", name)[0] for name in fields} | {cfg.answer_key}
        missing = wanted - set(self.rows.column_names)
        if missing or not len(self.rows):
            raise ConfigError(
                f"config key 'dataset': {cfg.path} has {len(self.rows)} rows and columns "
                f"{self.rows.column_names}; missing {sorted(missing)}"
            )
        self.cfg, self._order = cfg, (-1, [])

    def sample(self, i: int) -> Sample:
        epoch, i = divmod(i, len(self.rows))
        if self._order[0] != epoch:
            order = list(range(len(self.rows)))
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._order = (epoch, order)
        row = self.rows[self._order[1][i]]
        return Sample(
            prompt=self.cfg.template.format(**row),
            answer=str(row[self.cfg.answer_key]),
            task=Path(self.cfg.path).stem,
            meta=dict(row),
        )
