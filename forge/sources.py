"""The libraries a run's prompt rows come from, behind forge.schema.DatasetConfig: HF `datasets`
loads a local file, a `save_to_disk` directory or a Hugging Face dataset by name (offline: from
the local cache) as one `datasets.Dataset`; reasoning-gym's own factory makes a procedural
generator. Every failure is a ConfigError naming the config key and what there is instead.
forge.data.prompt_source makes prompt streams of both."""

from __future__ import annotations

import codecs
import csv
import difflib
import json
import logging
import random
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import datasets
import reasoning_gym
from datasets.exceptions import DatasetGenerationError
from huggingface_hub import constants as hub_constants
from reasoning_gym.factory import DATASETS as GYM_TASKS

from forge.config import ConfigError
from forge.data import RowPrompts
from forge.schema import FORMATS, DatasetConfig, ReasoningGymConfig
from forge.tasks import Task

log = logging.getLogger("forge")
GYM_RETRIES = 20  # a generator's entries in a row that may fail before its stream stops the run
GYM_COLUMNS = ("question", "answer", "metadata")  # a reasoning-gym entry's keys: a row's columns
# An endless generator is made in chunks of this many entries (each its own generator object, as
# reasoning-gym's are sized), seeded so that together they are one unbounded generator.
GYM_CHUNK = 10_000
GYM_OWN_KEYS = ("seed", "size")  # a generator config's keys that forge sets


def gym_seed(seed: int) -> int:
    """The reasoning-gym seed of a forge stream's `seed`. Generators seed entry idx from
    seed + idx, so streams of seeds 0 and 1 would be one stream shifted by one entry (and a
    run's stream would reach its evals' after eval.seed entries): a hash spreads them apart,
    below 2**31 as numpy's seeding (pool_matrix's) needs seed + idx < 2**32."""
    return random.Random(f"reasoning_gym:{seed}").randrange(2**31)


def load_rows(cfg: DatasetConfig, key: str = "dataset") -> datasets.Dataset:
    """The rows `cfg` names: its `hf` dataset, its save_to_disk directory, or its file."""
    if cfg.hf:
        return _hub_rows(cfg, key)
    if Path(cfg.path).is_dir():
        try:
            saved = datasets.load_from_disk(cfg.path)
        except FileNotFoundError as e:
            raise ConfigError(f"config key '{key}.path': {_first_line(e)}") from None
        return _split(saved, cfg, key, cfg.path)
    return read_file(cfg.path, key)


def read_file(path: str, key: str) -> datasets.Dataset:
    """A local file's rows, read as its suffix says. A file `datasets` cannot read is a
    ConfigError naming `key`.path and the file."""
    kind = FORMATS[Path(path).suffix]
    if Path(path).stat().st_size == 0:
        raise ConfigError(f"config key '{key}.path': {path} is empty")
    try:
        options = _csv_options(path, key) if kind == "csv" else {}
        rows = datasets.load_dataset(kind, data_files=path, split="train", **options)
    except ConfigError:
        raise
    except Exception as e:  # a bad file raises what its format's reader does: StopIteration, KeyError, ArrowInvalid...
        where = bad_line(path) if Path(path).suffix == ".jsonl" else bad_csv_line(path) if kind == "csv" else ""
        if isinstance(e, DatasetGenerationError) and e.__cause__:  # its own text says only that it failed
            e = e.__cause__
        raise ConfigError(
            f"config key '{key}.path': {path}: cannot read it as {kind} ({type(e).__name__}: {_first_line(e)[:200]})"
            f"{where}"
        ) from None
    decimals = [c for c, f in rows.features.items() if getattr(f, "dtype", "").startswith("float")]
    return as_written(rows, path, decimals) if kind == "json" and decimals else rows


def as_written(rows: datasets.Dataset, path: str, columns: list[str]) -> datasets.Dataset:
    """`rows` of JSON file `path` with its `columns` of numbers Arrow reads as float64 (one is a
    decimal, or past int64) as the text written, as a CSV's cells are: float64 would make 72 "72.0"
    in a prompt or a completion, an answer 0.00001 "1e-05" and 1.50 "1.5", and round integers past
    2**53 (2**64 - 1 as 1.8446744073709552e19)."""
    texts: dict[str, list[str | None]] = {c: [] for c in columns}
    for row in _json_rows(path, parse_float=str):
        for c in columns:
            value = row.get(c) if isinstance(row, dict) else None
            texts[c].append(None if value is None else str(value))
    if any(len(t) != len(rows) for t in texts.values()):  # not rows as `datasets` read them: leave them
        return rows
    order = rows.column_names
    for c, text in texts.items():
        rows = rows.remove_columns(c).add_column(c, text)
    return rows.select_columns(order)


def _json_rows(path: str, **parse: Any) -> Iterator[Any]:
    """The rows of a JSON file as `datasets` reads them (json.loads with `parse`): one JSON
    document (a list of rows, or one row), or JSON lines, whatever the file's suffix."""
    text = Path(path).read_bytes()
    if Path(path).suffix != ".jsonl":
        try:
            doc = json.loads(text, **parse)
            return iter(doc if isinstance(doc, list) else [doc])
        except json.JSONDecodeError:
            pass  # a .json file of JSON lines, which `datasets` reads as such
    return (json.loads(raw, **parse) for raw in text.splitlines() if raw.strip())


class _WideInteger(ValueError):
    """An integer of a JSON text that Arrow cannot hold as one."""


def _int64(text: str) -> int:
    value = int(text)
    if not -(2**63) <= value < 2**63:
        raise _WideInteger(text)
    return value


def bad_line(path: str) -> str:
    """Where JSON lines file `path` first breaks, for its error (the reader names only an offset
    in a block of its own): "; line N: why", or "" when every line is a JSON object."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                row = json.loads(raw, parse_int=_int64) if raw.strip() else None
            except _WideInteger as e:
                return f"; line {n}: {e} is past 64-bit integers (Arrow's): write it as a string (in quotes)"
            except UnicodeDecodeError as e:
                return f"; line {n}: not UTF-8 (byte {e.start})"
            except json.JSONDecodeError as e:
                return f"; line {n}, column {e.colno}: {e.msg}"
            except RecursionError:
                return f"; line {n}: nested too deep"
            if not raw.strip():
                return f"; line {n} is blank"
            if raw.startswith(codecs.BOM_UTF8):  # json.loads reads past it; the file's reader does not
                return f"; line {n} starts with a byte order mark (BOM): save the file as UTF-8 without one"
            if not isinstance(row, dict):
                return f"; line {n}: a {type(row).__name__}, not an object of columns"
    return ""


def bad_csv_line(path: str) -> str:
    """What is wrong with CSV file `path` beyond what its reader names, for its error: "; line N:
    not UTF-8", "; no rows below its header", or ""."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                raw.decode()
            except UnicodeDecodeError as e:
                return f"; line {n}: not UTF-8 (byte {e.start})"
    return "; no rows below its header" if n == 1 else ""


def _csv_options(path: str, key: str) -> dict[str, Any]:
    """A CSV's cells as the text written: pandas would read an answer "02134" as 2134, a column of
    integers with one empty cell as floats ("3" as "3.0"), and "NA" or "null" as no value. Only an
    empty cell is none. Each row has a field per column of its header, whose names are there
    and differ: else pandas shifts the columns (a row a field longer takes its first as an index),
    gives a short row's last cells no value, or renames columns, and says nothing."""
    with open(path, newline="", encoding="utf-8-sig", errors="replace") as f:  # -sig: as pandas, past a BOM
        rows = csv.reader(f)
        header = next(rows, [])
        cannot = f"config key '{key}.path': {path}: cannot read it as csv"
        unnamed = [i + 1 for i, name in enumerate(header) if not name]
        if unnamed:
            raise ConfigError(f"{cannot}: its header's column {unnamed[0]} has no name (a comma at its end?)")
        twice = sorted({name for name in header if header.count(name) > 1})
        if twice:
            raise ConfigError(f"{cannot}: its header names column {twice[0]!r} twice")
        for row in rows:
            if row and len(row) != len(header):  # a blank line holds no row
                raise ConfigError(
                    f"{cannot}: line {rows.line_num} has {len(row)} fields where its header names {len(header)} "
                    f"({', '.join(header)[:200]}): quote a cell that holds a comma"
                )
    text = datasets.Features({name: datasets.Value("string") for name in header})
    return {"features": text, "keep_default_na": False, "na_values": [""]}


def _hub_rows(cfg: DatasetConfig, key: str) -> datasets.Dataset:
    """`datasets.load_dataset(hf, subset)`, all its splits (so a missing one can name the others),
    then the split."""
    try:
        loaded = datasets.load_dataset(cfg.hf, cfg.subset or None)
    except ValueError as e:  # a config it lacks: "BuilderConfig 'x' not found. Available: [...]"
        if cfg.subset and cfg.subset in str(e):
            raise ConfigError(f"config key '{key}.subset': {cfg.hf}: {_first_line(e)}") from None
        raise ConfigError(f"config key '{key}.hf': {cfg.hf}: {_first_line(e)}") from None
    except (FileNotFoundError, ConnectionError, OSError) as e:  # DatasetNotFoundError is a FileNotFoundError
        cached = cached_datasets()
        close = difflib.get_close_matches(cfg.hf, cached, n=3, cutoff=0.5)
        raise ConfigError(
            f"config key '{key}.hf': cannot load {cfg.hf!r} ({_first_line(e)[:120]}); "
            f"{'close: ' + ', '.join(close) + '; ' if close else ''}"
            f"in the local cache: {', '.join(cached[:10]) or 'none'}"
        ) from None
    return _split(loaded, cfg, key, cfg.hf)


def _split(loaded: Any, cfg: DatasetConfig, key: str, where: str) -> datasets.Dataset:
    """`loaded`'s split `cfg.split` (empty: train), or `loaded` itself when it has no splits."""
    if isinstance(loaded, datasets.Dataset):
        if cfg.split:
            raise ConfigError(f"config key '{key}.split': {where} is one dataset without splits; unset it")
        return loaded
    split = cfg.split or "train"
    if split not in loaded:
        raise ConfigError(
            f"config key '{key}.split': {where} has no split {split!r}; its splits: {', '.join(loaded) or 'none'}"
        )
    return loaded[split]


def cached_datasets() -> list[str]:
    """The Hugging Face datasets in the local caches (the hub's and `datasets`'), by name."""
    hub = {d.name[len("datasets--") :].replace("--", "/") for d in Path(hub_constants.HF_HUB_CACHE).glob("datasets--*")}
    prepared = {d.name.replace("___", "/") for d in Path(datasets.config.HF_DATASETS_CACHE).glob("*___*")}
    return sorted(hub | prepared)


def check_reasoning_gym(cfg: ReasoningGymConfig, key: str = "dataset.reasoning_gym") -> None:
    """A known task, its generator's config keys, a size >= 0, and a generator that makes an entry."""
    if not cfg.task:
        raise ConfigError(
            f"config key '{key}.task': name a reasoning-gym task (e.g. {', '.join(sorted(GYM_TASKS)[:5])})"
        )
    config_class = gym_config_class(cfg.task, key)
    known = sorted(f.name for f in fields(config_class) if f.name not in GYM_OWN_KEYS)
    for name in cfg.config:
        if name in GYM_OWN_KEYS:
            raise ConfigError(
                f"config key '{key}.config.{name}': forge sets it: the seed is the run's `seed` (evals': "
                f"`eval.seed`), the size {key}.size"
            )
        if name not in known:
            raise ConfigError(
                f"config key '{key}.config.{name}': not a key of {cfg.task}'s generator "
                f"({config_class.__name__}); its keys: {', '.join(known)}"
            )
    if cfg.size < 0:
        raise ConfigError(f"config key '{key}.size' must be >= 0 (0: endless), got {cfg.size}")
    generator = gym_generator(cfg, 0, cfg.size or 1, key)
    try:
        generator[0]
    except Exception as e:  # noqa: BLE001 - a generator's own failure on this config, whatever it is
        raise ConfigError(f"config key '{key}.config': {cfg.task} fails to generate: {type(e).__name__}: {e}") from None


def gym_config_class(task: str, key: str = "dataset.reasoning_gym") -> type:
    """The config dataclass of reasoning-gym task `task`; an unknown one names the closest."""
    if task not in GYM_TASKS:
        close = difflib.get_close_matches(task, GYM_TASKS, n=5, cutoff=0.5) or sorted(GYM_TASKS)[:5]
        raise ConfigError(
            f"config key '{key}.task': no reasoning-gym task {task!r}; close: {', '.join(close)} "
            f"(all {len(GYM_TASKS)}: reasoning_gym.factory.DATASETS)"
        )
    return GYM_TASKS[task][1]


def gym_generator(cfg: ReasoningGymConfig, seed: int, size: int, key: str = "dataset.reasoning_gym") -> Any:
    """The task's generator (a reasoning_gym ProceduralDataset) of `size` entries from `seed`;
    a config its generator rejects (its validate's assertions) names the key."""
    try:
        return reasoning_gym.create_dataset(cfg.task, **cfg.config, seed=seed, size=size)
    except (AssertionError, TypeError, ValueError) as e:
        raise ConfigError(
            f"config key '{key}.config': {cfg.task} rejects {cfg.config}: {type(e).__name__}: {e}"
        ) from None


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


class ReasoningGymPrompts(RowPrompts):
    """A reasoning-gym generator's entries ({question, answer, metadata}): `size` of them,
    reshuffled each epoch, or endless. Entry i comes from (seed, i) alone, so the index is the
    whole state. Each sample carries its entry and the generator's name and config (its meta),
    which the `reasoning_gym` reward scores it with."""

    def __init__(self, cfg: DatasetConfig, seed: int = 0, key: str = "dataset"):
        cfg.validate()
        self.gym, self._made = cfg.reasoning_gym, (-1, None)
        self.spec = {"task": self.gym.task, "config": dict(self.gym.config)}
        where = f"reasoning-gym task {self.gym.task}"
        super().__init__(cfg, list(GYM_COLUMNS), self.gym.size or None, seed, key, where)

    def entry(self, at: int) -> dict[str, Any]:
        """The generator's entry `at`; one it fails to make (basic_arithmetic's default config
        divides by zero now and then) is replaced by the next it makes, so a library's bug in
        one entry costs that entry, not the run."""
        span = self.gym.size or GYM_CHUNK
        chunk, first = divmod(at, span)
        generator = self._generator(chunk)
        for k in range(GYM_RETRIES):
            try:
                return generator[(first + k) % span]
            except Exception as e:  # noqa: BLE001 - whatever a generator raises on an entry
                log.warning(
                    "forge: reasoning-gym %s failed on entry %d (%s: %s); the next one instead",
                    self.gym.task,
                    at + k,
                    type(e).__name__,
                    e,
                )
        raise RuntimeError(f"reasoning-gym {self.gym.task}: {GYM_RETRIES} entries in a row from {at} failed")

    def _generator(self, chunk: int) -> Any:
        """The generator of chunk `chunk` of the endless stream (or the sized set, chunk 0): its
        seed is gym_seed(seed) + chunk x GYM_CHUNK, so for a generator that seeds entry idx from
        seed + idx (reasoning-gym's convention) the chunks are one unbounded generator."""
        if self._made[0] != chunk:
            seed = gym_seed(self.seed) + chunk * GYM_CHUNK
            size, key = self.gym.size or GYM_CHUNK, f"{self.key}.reasoning_gym"
            self._made = (chunk, gym_generator(self.gym, seed, size, key))
        return self._made[1]

    def meta(self, row: dict[str, Any]) -> dict[str, Any]:
        return {**row, "reasoning_gym": self.spec}


class GymTask(Task):
    """A reasoning-gym generator as a toy task, for the supervised apps' examples: a sample is
    one of its first GYM_CHUNK entries from `seed`, drawn by the sample's RNG; its question the
    prompt, its answer the answer (corrupted by the toy tasks' `noise` as theirs are)."""

    def __init__(self, cfg: ReasoningGymConfig, seed: int = 0):
        self.name = cfg.task
        self.generator = gym_generator(cfg, gym_seed(seed), GYM_CHUNK, "data.reasoning_gym")

    def make(self, rng: random.Random) -> tuple[str, str]:
        entry = self.generator[rng.randrange(GYM_CHUNK)]
        return entry["question"], str(entry["answer"])
