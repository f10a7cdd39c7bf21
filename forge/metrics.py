"""The one metrics path: `record_metric` anywhere -> `MetricWriter.flush(step)` -> backends.

    record_metric("loss", 0.3)                        # in any actor, or the controller
    record_metric("tokens", 512, Reduce.SUM)
    row = await writer.flush(step)                    # controller: reduce across processes, write

Each process keeps running sums per key (cheap, no messages per record). `flush` pulls
them from every process forge spawned (a `MetricCollector` actor sits in each) and from
the controller itself, reduces them, and writes one row to console, JSONL, TensorBoard
and, optionally, W&B (offline). Pulling keeps it causal: a value recorded inside an
endpoint that has returned is always in the next flush.

Several runs in one controller (apps/grpo.py `run_together`) each run in a `metrics_scope`:
what a run's tasks record, and the processes they spawn, are flushed by that run alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from monarch.actor import Actor, endpoint, returns_future
from tqdm import tqdm

from forge.schema import BACKENDS, DEFAULT_BACKENDS

log = logging.getLogger("forge")


class Reduce(StrEnum):
    MEAN = "mean"
    SUM = "sum"
    MAX = "max"
    MIN = "min"
    STD = "std"
    P50 = "p50"  # percentiles keep the values of one flush interval
    P99 = "p99"


def _nan_or(pick: Any, a: float, b: float) -> float:
    """`pick(a, b)`, NaN if either is (Python's max and min keep or drop a NaN by its place)."""
    return math.nan if math.isnan(a) or math.isnan(b) else pick(a, b)


@dataclass
class _Acc:
    """Running state of one key in one process; merges exactly across processes."""

    reduce: Reduce
    n: int = 0
    sum: float = 0.0
    sumsq: float = 0.0
    max: float = -math.inf
    min: float = math.inf
    values: list[float] = field(default_factory=list)  # percentile reducers only

    def add(self, v: float) -> None:
        self.n += 1
        self.sum += v
        self.sumsq += v * v
        self.max, self.min = _nan_or(max, self.max, v), _nan_or(min, self.min, v)
        if self.reduce in (Reduce.P50, Reduce.P99):
            self.values.append(v)

    def merge(self, key: str, other: _Acc) -> None:
        if other.reduce != self.reduce:
            raise ValueError(f"metric {key!r} recorded with reduce={self.reduce.value} and {other.reduce.value}")
        self.n += other.n
        self.sum += other.sum
        self.sumsq += other.sumsq
        self.max, self.min = _nan_or(max, self.max, other.max), _nan_or(min, self.min, other.min)
        self.values += other.values

    def value(self) -> float:
        if self.reduce is Reduce.SUM:
            return self.sum
        if self.reduce is Reduce.MAX:
            return self.max
        if self.reduce is Reduce.MIN:
            return self.min
        if self.values:
            ordered = sorted(self.values)
            return ordered[min(len(ordered) - 1, int((0.5 if self.reduce is Reduce.P50 else 0.99) * len(ordered)))]
        mean = self.sum / self.n
        if self.reduce is Reduce.MEAN:
            return mean
        return math.sqrt(max(self.sumsq / self.n - mean * mean, 0.0))  # population std


@dataclass
class _Scope:
    """What one run's flush reduces: the values recorded in this process, and the collectors of
    the processes spawned (by id of their ProcMesh)."""

    local: dict[str, _Acc] = field(default_factory=dict)
    collectors: dict[int, Any] = field(default_factory=dict)


_scope: contextvars.ContextVar[_Scope] = contextvars.ContextVar("forge_metrics", default=_Scope())  # noqa: B039
_scope_of: dict[int, _Scope] = {}  # ProcMesh id -> the scope that spawned it


@contextlib.contextmanager
def metrics_scope() -> Iterator[None]:
    """From here on, in this task and the tasks it starts, metrics are one run's own."""
    token = _scope.set(_Scope())
    try:
        yield
    finally:
        _scope.reset(token)


def record_metric(key: str, value: float, reduce: Reduce = Reduce.MEAN) -> None:
    """Record one value of `key` in this process; reduced with every process's values at flush."""
    reduce = Reduce(reduce)
    acc = _scope.get().local.setdefault(key, _Acc(reduce))
    if acc.reduce != reduce:
        raise ValueError(f"metric {key!r} recorded with reduce={acc.reduce.value} and {reduce.value}")
    acc.add(float(value))


def _drain() -> dict[str, _Acc]:
    local = _scope.get().local
    states = dict(local)
    local.clear()
    return states


def reduce_states(states: Sequence[Mapping[str, _Acc]]) -> dict[str, float]:
    total: dict[str, _Acc] = {}
    for state in states:
        for key, acc in state.items():
            if key in total:
                total[key].merge(key, acc)
            else:
                total[key] = _Acc(acc.reduce)
                total[key].merge(key, acc)
    return {k: acc.value() for k, acc in sorted(total.items())}


class MetricCollector(Actor):
    """One per forge-spawned process: hands the process's running sums to the flush."""

    @endpoint
    async def drain(self) -> dict[str, _Acc]:
        return _drain()


def register_procs(procs: Any) -> None:
    scope = _scope_of[id(procs)] = _scope.get()
    scope.collectors[id(procs)] = procs.spawn("forge_metrics", MetricCollector)


def unregister_procs(procs: Any) -> None:
    scope = _scope_of.pop(id(procs), None)
    if scope is not None:
        scope.collectors.pop(id(procs), None)


async def _gather(timeout: float) -> list[dict[str, _Acc]]:
    collectors = _scope.get().collectors

    async def one(key: int, mesh: Any) -> list[dict[str, _Acc]]:
        try:
            return [v for _, v in (await asyncio.wait_for(mesh.drain.call(), timeout)).items()]
        except TimeoutError:  # a slow mesh (a busy host) loses this flush's values, not its later ones
            log.warning("forge: metrics from a mesh timed out after %ss; this flush goes without them", timeout)
            record_metric("metrics/flush_timeouts", 1, Reduce.SUM)
            return []
        except Exception as e:  # a dead mesh loses its unflushed values, never the run
            log.warning("forge: metrics from a mesh were lost: %s", e)
            collectors.pop(key, None)
            return []

    parts = await asyncio.gather(*(one(k, m) for k, m in list(collectors.items())))
    return [_drain()] + [s for part in parts for s in part]


async def discard_pending(timeout: float = 30.0) -> None:
    """Drop what every process recorded since the last flush: a run that reuses services
    starts its metrics with itself, not with the tail of the run before."""
    await _gather(timeout)


class MetricWriter:
    def __init__(
        self,
        run_dir: str | Path,
        backends: Sequence[str] = DEFAULT_BACKENDS,
        start_time: float | None = None,
        config: Mapping[str, Any] | None = None,
        resume_step: int | None = None,
    ):
        """A new run's writer starts empty files; with `resume_step` (a run resumed from that
        step's checkpoint) rows after it are dropped and wall time continues from its row."""
        unknown = set(backends) - set(BACKENDS)
        if unknown:
            raise ValueError(f"unknown metrics backend(s) {sorted(unknown)}; known: {', '.join(BACKENDS)}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.backends = tuple(backends)
        self._jsonl = self._tb = self._wandb = None
        if resume_step is None:
            shutil.rmtree(self.run_dir / "tb", ignore_errors=True)
            (self.run_dir / "metrics.jsonl").unlink(missing_ok=True)
        kept = self._open(resume_step)
        self._done_s = json.loads(kept[-1])["wall_s"] if kept else 0.0
        self.start = start_time if start_time is not None else time.time() - self._done_s
        if "wandb" in backends:
            import wandb

            # Offline: no hub is reachable from here; `wandb sync runs/<name>/wandb` uploads later.
            self._wandb = wandb.init(
                dir=str(self.run_dir), mode="offline", name=self.run_dir.name, config=dict(config or {})
            )
            # Plotted against their own `step`: W&B's step only goes up, and drops an eval's row written
            # after later steps' and a rewind's rows.
            self._wandb.define_metric("*", step_metric="step")

    def _open(self, keep_until: int | None) -> list[str]:
        """(Re)open the JSONL and TensorBoard files, keeping the rows up to step `keep_until`."""
        jsonl = self.run_dir / "metrics.jsonl"
        kept = []
        if keep_until is not None and jsonl.exists():
            kept = [json.dumps(row) for row in _rows(jsonl) if row["step"] <= keep_until]
        if "jsonl" in self.backends:
            # The kept rows go to a new file that replaces the old once whole: truncating the old
            # first would lose every row to a crash or a full disk meanwhile.
            tmp = jsonl.with_name(f".{jsonl.name}.tmp")
            with tmp.open("w") as f:
                f.writelines(line + "\n" for line in kept)
            os.replace(tmp, jsonl)
            self._jsonl = jsonl.open("a")
        if "tensorboard" in self.backends:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if keep_until is None else keep_until + 1  # TensorBoard hides later events
            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tb"), purge_step=purge)
        return kept

    def start_clock(self) -> None:
        """Wall time counts from now (on from the kept rows' last): set-up before training is not its time."""
        self.start = time.time() - self._done_s

    def rewind(self, step: int) -> None:
        """The run continues from `step` (a checkpoint) again: drop the rows after it. Wall
        time goes on (the lost steps took it)."""
        for f in (self._jsonl, self._tb):
            if f is not None:
                f.close()
        self._open(step)

    @returns_future
    async def flush(self, step: int, timeout: float = 30.0) -> dict[str, float]:
        """Reduce what every process recorded since the last flush; write it as `step`."""
        return self.write(step, reduce_states(await _gather(timeout)))

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
        if self._wandb:
            self._wandb.log(row)
        if "console" in self.backends:
            # Between the progress bar's redraws: printed over it, the row would go on the bar's line.
            tqdm.write(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        return row

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
        if self._wandb:
            self._wandb.finish()


def read_rows(run_dir: str | Path) -> list[dict[str, float]]:
    """The rows of runs/<name>/metrics.jsonl (none before the first)."""
    jsonl = Path(run_dir) / "metrics.jsonl"
    return _rows(jsonl) if jsonl.exists() else []


def _rows(jsonl: Path) -> list[dict[str, Any]]:
    """A metrics.jsonl's rows, but a line cut short (a disk that filled mid-row): not a row."""
    rows = []
    for line in jsonl.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            row = json.loads(line) if line.strip() else None
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                rows.append(row)
    return rows
