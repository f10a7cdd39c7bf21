"""The one metrics path: per-step dicts of numbers -> console, JSONL, TensorBoard.

`MetricWriter.write(step, values)` is called once per step by the controller; every
backend gets the same values. (Recording from actors in other processes and reducing
across them feeds into this writer; see the Services issue.)
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Mapping, Sequence

BACKENDS = ("console", "jsonl", "tensorboard")


class MetricWriter:
    def __init__(self, run_dir: str | Path, backends: Sequence[str] = BACKENDS, start_time: float | None = None):
        unknown = set(backends) - set(BACKENDS)
        if unknown:
            raise ValueError(f"unknown metrics backend(s) {sorted(unknown)}; known: {', '.join(BACKENDS)}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.start = start_time if start_time is not None else time.time()
        self.backends = tuple(backends)
        self._jsonl = (self.run_dir / "metrics.jsonl").open("a") if "jsonl" in backends else None
        self._tb = None
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tb"))

    def write(self, step: int, values: Mapping[str, float]) -> dict[str, float]:
        row = {"step": step, "wall_s": round(time.time() - self.start, 3), **{k: float(v) for k, v in values.items()}}
        if self._jsonl:
            self._jsonl.write(json.dumps(row) + "\n")
            self._jsonl.flush()
        if self._tb:
            for k, v in row.items():
                if k != "step" and not math.isnan(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if "console" in self.backends:
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        return row

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
