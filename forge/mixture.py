"""A mixture of prompt sources (`dataset.mix`) as one torchdata node, its weights changeable
while the run goes on.

    prompts = build_prompts(cfg.dataset, cfg.task, cfg.seed)   # a Mixture, or one source's stream
    running("grpo_mix_tiny").set_weights({"sort": 2.0})        # from a REPL in the run's process

Each source is the stream a single-source run of it would read (`forge.data.prompt_source`, the
run's seed), its samples tagged with the source's name (`Sample.task`, then `Episode.task`), so
rewards, metrics and evals are kept per source. New weights come from `set_weights` or from
`dataset.mix_file`, re-read between steps when it changes; each change is a console line, and
every step records the weights in force (`mix/weight/NAME`). A checkpoint holds the draw count,
the weights (and the config's), the watched file's stamp (mtime, size, inode, its text's digest; or the error its
stat gave) and each source's position: a resumed run draws the same next prompts under the same
weights, but for a source whose config weight changed since, which takes the new one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torchdata.nodes import BaseNode
from tqdm import tqdm

from forge.config import ConfigError
from forge.data import IndexedPrompts, prompt_source
from forge.metrics import record_metric
from forge.schema import DatasetConfig, MixSource, under, weight_problem
from forge.tasks import Sample

_RUNNING: dict[str, Mixture] = {}  # run name -> its mixture, while the run trains (`running`)
WEIGHTS_FILE_LIMIT = 64 << 10  # bytes: a weights file is a few lines; a larger one is not read


class NotWeights(ValueError):
    """A watched path that is no weights file to read (a FIFO, a device, an oversized file)."""


def read_small(path: Path, limit: int = WEIGHTS_FILE_LIMIT) -> str:
    """The text of regular file `path`, of at most `limit` bytes. Opened without blocking (a
    FIFO would wait for a writer) and read no further than the limit (/dev/zero never ends)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotWeights("not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise NotWeights(f"larger than {limit} bytes")
    return data.decode()


def source_stream(source: MixSource, seed: int, key: str = "dataset.mix") -> IndexedPrompts:
    """One mixture source's prompt stream, as a single-source run of it would read it."""
    try:  # its rows' errors, raised as they are drawn, name `key`; its config's (checked as a
        # single source's, naming `dataset`) are renamed
        return prompt_source(source.source(), source.task, seed, key)
    except ConfigError as e:
        raise ConfigError(under(str(e), key)) from None


def tagged(sample: Sample, source: MixSource) -> Sample:
    """`sample` as its source's: Sample.task is the source's name (a renamed toy task keeps its
    own in `toy_task`, for the `task` reward)."""
    name = source.source_name
    if sample.task == name:
        return sample
    meta = {**sample.meta, "toy_task": source.task} if source.task else sample.meta
    return dataclasses.replace(sample, task=name, meta=meta)


def build_prompts(dataset: DatasetConfig, task: str, seed: int = 0) -> IndexedPrompts | Mixture:
    """A run's prompt stream: the mixture `dataset.mix` names, else its one source."""
    if not dataset.mix:
        return prompt_source(dataset, task, seed)
    streams = {s.source_name: source_stream(s, seed, f"dataset.mix[{i}]") for i, s in enumerate(dataset.mix)}
    return Mixture(
        streams,
        {s.source_name: s.weight for s in dataset.mix},
        seed,
        sources={s.source_name: s for s in dataset.mix},
        watch=dataset.mix_file or None,
    )


class Mixture(BaseNode[Sample]):
    """Prompts drawn from named sources by weight; the weights may change between draws."""

    # torchdata's MultiNodeWeightedSampler fixes its weights when built (no API changes them, its
    # state replays pre-drawn picks under whatever weights it is rebuilt with, and it refuses a
    # weight of 0, a paused source), so draw i picks its source from (seed, i) and the weights in force.
    def __init__(
        self,
        streams: Mapping[str, BaseNode[Sample]],
        weights: Mapping[str, float],
        seed: int = 0,
        sources: Mapping[str, MixSource] | None = None,
        watch: str | Path | None = None,
        say: Callable[[str], None] = tqdm.write,
    ):
        super().__init__()
        self.streams, self.seed, self.say = dict(streams), seed, say
        self.sources = dict(sources or {})
        self.initial = {name: float(weights[name]) for name in self.streams}
        self.watch = Path(watch) if watch else None
        self.weights, self.draws, self.stamp = dict(self.initial), 0, None

    @property
    def names(self) -> list[str]:
        return list(self.streams)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        state = self._as_mixtures(initial_state or {})
        self.draws = state.get("draws", 0)
        # The config's sources now: one added since the checkpoint starts at its beginning and its
        # config weight; one removed is dropped; one whose config weight changed since takes it.
        held, config = state.get("weights", {}), state.get("config_weights", {})
        self.weights = {name: held.get(name, weight) for name, weight in self.initial.items()}
        changed = {n: w for n, w in self.initial.items() if n in config and config[n] != w}
        if changed:
            self.weights.update(changed)
            now = ", ".join(f"{n}={w:g}" for n, w in changed.items())
            self.say(f"forge: mix weights from the config, changed since the checkpoint: {now}")
        if not any(self.weights.values()):  # the removed sources held all the weight: nothing to draw by
            self.weights = dict(self.initial)
            config = ", ".join(f"{n}={w:g}" for n, w in self.weights.items())
            self.say(f"forge: the checkpoint's mix weights are all 0 for these sources; the config's instead: {config}")
        self.stamp = state.get("file_stamp")
        saved = state.get("sources", {})
        for name, stream in self.streams.items():
            stream.reset(saved.get(name))

    def next(self) -> Sample:
        rng = random.Random(f"{self.seed}:mix:{self.draws}")
        self.draws += 1
        [name] = rng.choices(self.names, weights=[self.weights[n] for n in self.names])  # weight 0: never
        sample = next(self.streams[name])
        return tagged(sample, self.sources[name]) if name in self.sources else sample

    def _as_mixtures(self, state: dict[str, Any]) -> dict[str, Any]:
        """`state`, or a single source's checkpoint (forge/data.py IndexedPrompts) as this
        mixture's: that source goes on from its place, the others from their starts."""
        if "index" not in state:
            return state
        name, names = state.get("source"), ", ".join(self.names)
        if name not in self.streams:
            raise ConfigError(
                f"config key 'dataset.mix': the checkpoint's prompts are one source's ({name!r}, at prompt "
                f"{state['index']}), none of this mixture's ({names}); list it in dataset.mix, named so"
            )
        self.say(f"forge: source {name!r} goes on from prompt {state['index']} of the checkpoint; {names} by weight")
        return {"sources": {name: state}}

    def get_state(self) -> dict[str, Any]:
        return {
            "draws": self.draws,
            "weights": dict(self.weights),
            "config_weights": dict(self.initial),
            "file_stamp": self.stamp,
            "sources": {name: stream.state_dict() for name, stream in self.streams.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:  # a run's checkpoint part (forge/run.py)
        self.reset(state)

    def set_weights(self, weights: Mapping[str, Any], origin: str = "set_weights") -> bool:
        """New weights for the sources `weights` names (the others keep theirs), from the next
        draw on. Bad ones (an unknown name, a negative weight, all zero) are refused with a
        console line and the old weights stay. Returns whether they were taken."""
        now = ", ".join(f"{n}={w:g}" for n, w in self.weights.items())
        problem = weight_problem(weights, self.names, self.weights)
        if problem:
            self.say(f"forge: mix weights from {origin} refused: {problem}; the run keeps {now}")
            return False
        self.weights.update({name: float(w) for name, w in weights.items()})
        new = ", ".join(f"{n}={w:g}" for n, w in self.weights.items())
        self.say(f"forge: mix weights from {origin}: {new} (were {now}) from draw {self.draws}")
        return True

    def poll(self) -> None:
        """Take the watched file's weights if it changed since last read (or since the checkpoint)."""
        if self.watch is None:
            return
        try:
            st = self.watch.stat()
        except FileNotFoundError:
            return  # not written yet
        except OSError as e:  # a symlink loop, a folder it may not enter: said once, not each step
            if self.stamp != ["error", e.errno]:
                self.stamp = ["error", e.errno]
                self.say(f"forge: mix weights from {self.watch} refused: unreadable ({e.strerror}); the run keeps them")
            return
        # its text's digest too: a coarse clock may give two writes (`echo ... > file` empties it
        # first) the same mtime, and the same size
        stamp: list[Any] = [st.st_mtime_ns, st.st_size, st.st_ino]
        try:
            text = read_small(self.watch)
            stamp.append(hashlib.sha256(text.encode()).hexdigest())
        except (OSError, ValueError) as e:  # said below, once per stamp
            text, unread = None, e
        if stamp == self.stamp:
            return
        self.stamp = stamp
        try:  # as config files are read (PyYAML alone reads 1e-3 as a string), JSON too
            if text is None:
                raise unread
            weights = OmegaConf.to_container(OmegaConf.create(text))
        except (OSError, ValueError, RecursionError, yaml.YAMLError, OmegaConfBaseException) as e:
            # ValueError: not UTF-8, NotWeights, an integer of more digits than Python converts
            why = str(e) if isinstance(e, NotWeights) else type(e).__name__
            self.say(f"forge: mix weights from {self.watch} refused: unreadable ({why}); the run keeps them")
            return
        if isinstance(weights, dict):  # a name YAML reads as a number (2024.jsonl's stem) is its text
            weights = {str(k): v for k, v in weights.items()}
        self.set_weights(weights if weights is not None else {}, str(self.watch))

    def between_steps(self) -> None:
        """The training loop's hook, before each step: the watched file, and the weights in force
        as this step's metrics (mix/weight/NAME)."""
        self.poll()
        for name, weight in self.weights.items():
            record_metric(f"mix/weight/{name}", weight)


def running(run_name: str) -> Mixture:
    """The mixture of run `run_name` while it trains in this process: the REPL's handle
    (`running(name).set_weights({...})`)."""
    if run_name not in _RUNNING:
        raise KeyError(f"no run {run_name!r} with a mixture is training here; running: {', '.join(_RUNNING) or 'none'}")
    return _RUNNING[run_name]


def register(run_name: str, prompts: BaseNode[Sample]) -> Callable[[], None]:
    """Make a run's mixture reachable by `running` while it trains; returns the undo."""
    if not isinstance(prompts, Mixture):
        return lambda: None
    _RUNNING[run_name] = prompts
    return lambda: _RUNNING.pop(run_name, None)
