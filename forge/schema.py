"""The config sections of forge's machinery, as dataclasses with no heavy imports (no torch,
Monarch or vLLM), so a bad config is reported before any of them loads. Each section checks its
own keys in `validate()`; the modules that use a section import it from here.

    RunConfig (every app's top level)   DatasetConfig (dataset)   SFTDataConfig (data)
    LossConfig (trainer.loss)   LoRAConfig (trainer.lora)   JobConfig (job)
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from forge import checkpoint, tasks
from forge.config import ConfigError, check_choice, check_range, check_ranges

TRANSPORTS = ("shm", "torchstore")  # how versions of the weights travel (forge/store.py, trainer.transport)
DEFAULT_BACKENDS = ("console", "jsonl", "tensorboard")
BACKENDS = (*DEFAULT_BACKENDS, "wandb")  # what `metrics` may name


@dataclass
class RunConfig:
    """The keys of every app's config that the run skeleton reads (an app's Config extends it)."""

    # Keys of earlier layouts -> (where each lives now, why): loading one is an error saying so
    # (forge/config.py); the config reference lists them.
    MOVED: ClassVar[dict[str, tuple[str, str]]] = {}

    app: str = ""  # the app that runs it (apps/APP.py)
    run_name: str = "run"  # the run's directory under runs_dir: its config, metrics, checkpoints, model
    runs_dir: str = "runs"  # where runs' directories go
    seed: int = 0  # the data's seed: the toy task's examples and the order of the prompts
    steps: int = 100  # training steps (optimizer steps of the policy)
    checkpoint_every: int = 25  # steps between checkpoints (and at the end); 0: none
    resume: str | None = None  # a run directory to continue
    metrics: list[str] = field(default_factory=lambda: list(DEFAULT_BACKENDS))  # console, jsonl, tensorboard, wandb

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / self.run_name

    @property
    def derived(self) -> tuple[str, ...]:
        """The keys `derive` filled in: a saved config keeps them null (forge/config.py `to_yaml`)."""
        return tuple(vars(self).get("_derived", ()))

    def derive(self, key: str, value: Any) -> None:
        """Set config key `key` (dotted), when it is null, to `value`, worked out from other keys
        (an LR schedule's length from `steps`). The run's saved config keeps it null, so a resumed
        run with other `steps` works it out again."""
        *sections, name = key.split(".")
        section = functools.reduce(getattr, sections, self)
        if getattr(section, name) is None:
            setattr(section, name, value)
            vars(self)["_derived"] = (*self.derived, key)

    def validate(self) -> None:
        """The keys every run has (an app's `validate` calls it first)."""
        check_range("steps", self.steps, ">= 1")
        check_range("checkpoint_every", self.checkpoint_every, ">= 0")
        # One directory's name: a path (../x, /x, a/b) or . would put the run's files, and the
        # clearing of an earlier run's metrics, outside runs_dir or in runs_dir itself.
        if self.run_name in ("", ".", "..") or "/" in self.run_name:
            raise ConfigError(
                f"config key 'run_name': {self.run_name!r} is not a directory's name (the run's directory "
                "under runs_dir; no '/' or '..')"
            )
        unknown = sorted(set(self.metrics) - set(BACKENDS))
        if unknown:  # here, not when the writer opens: that is after every service has started
            raise ConfigError(f"config key 'metrics': unknown backend(s) {unknown}; known: {', '.join(BACKENDS)}")

    def resume_point(self) -> Path | None:
        """The checkpoint `resume` names (its newest complete one), or None: a new run."""
        if not self.resume:
            return None
        last = checkpoint.latest(self.resume)
        if last is None:
            raise ConfigError(f"config key 'resume': no checkpoint in {self.resume}/checkpoints")
        other = checkpoint.latest(self.run_dir)
        if Path(self.resume).resolve() != self.run_dir.resolve() and other is not None:
            raise ConfigError(  # its pruning would take them for its own
                f"config key 'resume': the run would go on in {self.run_dir} (runs_dir/run_name), which holds "
                f"another run's checkpoints ({other.name}); name an empty run directory, or resume in {self.resume}"
            )
        saved = checkpoint.load_run_state(last).get("app", self.app)
        if saved != self.app:
            raise ConfigError(f"config key 'resume': {last} is a checkpoint of a {saved} run, not of {self.app}")
        return last


FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass
class ReasoningGymConfig:
    """A reasoning-gym generator as a prompt source (`dataset.reasoning_gym`): each entry's
    `question` is the prompt's `{question}` (through `template` or `chat`), its `answer` the
    sample's answer, and the whole entry goes with the sample (its meta) for the `reasoning_gym`
    reward, the generator's own `score_answer`."""

    task: str = ""  # a registered reasoning-gym dataset (reasoning_gym.factory.DATASETS), e.g. basic_arithmetic
    # The generator's config keys (its config dataclass's, e.g. {min_terms: 2, max_terms: 2});
    # not `seed` or `size`: the stream's seed (the run's `seed`, evals' `eval.seed`) and `size` below.
    config: dict[str, Any] = field(default_factory=dict)
    # How many distinct entries: a fixed set, reshuffled each epoch like a file's rows; 0: endless,
    # entry i generated from (seed, i) alone, so a resumed run continues where it stopped.
    size: int = 0


@dataclass
class DatasetConfig:
    """Where a run's prompts come from, instead of a generated toy task: one source of `path` (a
    local file or a `save_to_disk` directory), `hf` (a Hugging Face dataset by name) or
    `reasoning_gym`, or a mixture of sources (`mix`); and how a row becomes a prompt (`template`,
    `chat`, `messages_key`)."""

    # A local file (.jsonl/.json/.parquet/.csv, e.g. GSM8K), or a directory that
    # `datasets.Dataset(Dict).save_to_disk` wrote. Empty (and no other source): the config's toy `task`.
    path: str = ""
    # A Hugging Face dataset by name (or a local dataset directory), through `datasets.load_dataset`:
    # offline (HF_HUB_OFFLINE=1, or no hub reachable) it loads from the local cache.
    hf: str = ""
    subset: str = ""  # hf: the dataset's config name (load_dataset's `name`, e.g. "main" for openai/gsm8k)
    split: str = ""  # hf, or a DatasetDict directory: which split; empty: train
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)  # task: a procedural generator
    template: str = "{question}"  # a raw-text prompt: the row's columns formatted in
    # The column that holds each row's prompt as chat messages ([{role, content}, ...], a system
    # turn too: TRL's conversational format); the generator renders them with the model's chat
    # template, as `forge serve` does. Empty: `template` makes the prompt.
    messages_key: str = ""
    # Chat messages made from plain columns: each one's content formatted like `template`, e.g.
    # [{role: user, content: "{question} Answer after ####."}]; rendered like `messages_key`'s.
    chat: list[dict[str, str]] = field(default_factory=list)
    # The column of each row's tools (OpenAI's format: [{type: function, function: {name, ...}}],
    # or that list as a JSON string), shown to the model by its chat template. Chat prompts only.
    tools_key: str = ""
    answer_key: str = "answer"  # the column the reward compares with
    # A mixture instead of one source (forge/mixture.py): each entry a source's keys (`path`, `hf`,
    # `reasoning_gym`, ...) or a toy `task`, with its `weight` and `name` (default: its task or
    # source's name); prompts are drawn by weight, rewards, metrics and evals kept per source (reward/NAME).
    mix: list[MixSource] | None = None
    # A YAML or JSON file of {name: weight} the run re-reads between steps when it changes (the
    # sources it names take those weights). Empty: the weights change only from a REPL.
    mix_file: str = ""

    @property
    def kind(self) -> str:
        """Which source the section names: file (a file or a save_to_disk directory), hf,
        reasoning_gym, or "" (none: the toy task)."""
        given = self.sources()
        return given[0] if given else ""

    @property
    def enabled(self) -> bool:
        return bool(self.kind)

    @property
    def source_name(self) -> str:
        """A sample's `task`: the file's (directory's) stem, the hf dataset's last name part, the
        reasoning-gym task; "" with no source. Per-source metrics and teachers key on it."""
        if self.kind == "file":
            return Path(self.path).stem if Path(self.path).suffix in FORMATS else Path(self.path).name
        if self.kind == "hf":
            return Path(self.hf.rstrip("/")).name
        return self.reasoning_gym.task

    def sources(self) -> list[str]:
        return [k for k, v in (("file", self.path), ("hf", self.hf), ("reasoning_gym", self.reasoning_gym.task)) if v]

    def validate(self) -> None:
        if self.mix is not None or self.mix_file:
            check_mix(self)
            return
        given = [k for k in ("messages_key", "chat") if getattr(self, k)]
        given += ["template"] if self.template != DatasetConfig.template else []
        if len(given) > 1:
            raise ConfigError(
                f"config keys {', '.join(f'dataset.{k}' for k in given)}: each makes the prompt; set one of them"
            )
        if self.tools_key and not (self.messages_key or self.chat):
            raise ConfigError(
                "config key 'dataset.tools_key': tools are shown by a chat template: set dataset.messages_key or dataset.chat"
            )
        if any(set(m) != {"role", "content"} for m in self.chat):
            raise ConfigError(f"config key 'dataset.chat': each message is {{role, content}}, got {self.chat}")
        self._validate_source()

    def _validate_source(self) -> None:
        keys = {"file": "dataset.path", "hf": "dataset.hf", "reasoning_gym": "dataset.reasoning_gym.task"}
        if len(self.sources()) > 1:
            raise ConfigError(
                f"config keys {', '.join(keys[k] for k in self.sources())}: each is a source of prompts; set one of them"
            )
        where = Path(self.path)
        if self.path and not where.is_dir():  # a save_to_disk directory's splits are checked when it loads
            if not where.suffix and not where.exists():
                raise ConfigError(f"config key 'dataset.path': no such file or directory: {self.path}")
            if where.suffix not in FORMATS:
                raise ConfigError(
                    f"config key 'dataset.path': {self.path} is not one of {', '.join(FORMATS)} or a save_to_disk directory"
                )
            if not where.is_file():
                raise ConfigError(f"config key 'dataset.path': file not found: {self.path}")
        if self.subset and not self.hf:
            raise ConfigError("config key 'dataset.subset': a Hugging Face dataset's config name; set dataset.hf")
        if self.split and not (self.hf or (self.path and where.is_dir())):
            raise ConfigError(
                "config key 'dataset.split': a split of a Hugging Face dataset (dataset.hf) or of a "
                "save_to_disk directory (dataset.path)"
            )
        if self.reasoning_gym.task or self.reasoning_gym.config or self.reasoning_gym.size:
            # Imported here: reasoning_gym loads sympy and its hundred generators, which a config
            # without one should not pay for.
            from forge.sources import check_reasoning_gym

            check_reasoning_gym(self.reasoning_gym, "dataset.reasoning_gym")


@dataclass
class MixSource(DatasetConfig):
    """One source of a mixture (`dataset.mix[i]`): a source's keys, or a toy `task`, and its weight."""

    weight: float = 1.0  # its share of the prompts: weight / the sum of the weights (>= 0)
    name: str = ""  # in metrics (reward/NAME) and live weights; default: the task, or its source's name
    task: str = ""  # a toy task of forge/tasks.py instead of a dataset

    @property
    def source_name(self) -> str:
        """Its `name`, else its toy task, else its source's (file stem, hf name, reasoning-gym task)."""
        return self.name or self.task or super().source_name

    def source(self) -> DatasetConfig:
        """Its dataset keys alone, as a single-source run's `dataset` section."""
        return DatasetConfig(**{f.name: getattr(self, f.name) for f in fields(DatasetConfig)})

    def check(self, key: str) -> None:
        """Its keys, named under `key` (dataset.mix[i])."""
        given = set_keys(self.source())
        if {"mix", "mix_file"} & given:
            raise ConfigError(f"config key '{key}': a mixture's source is one source, not a mixture")
        if self.task and given:
            raise ConfigError(
                f"config key '{key}': a toy `task` or a dataset's keys ({', '.join(sorted(given))}), not both"
            )
        if not self.task and not given:
            raise ConfigError(f"config key '{key}': no source; give `task: NAME` (a toy task) or a dataset's keys")
        if self.task and self.task not in tasks.TASKS:
            raise ConfigError(
                f"config key '{key}.task': unknown task {self.task!r}; known: {', '.join(sorted(tasks.TASKS))}"
            )
        if not self.weight >= 0:  # NaN too
            raise ConfigError(f"config key '{key}.weight' must be >= 0, got {self.weight}")
        if not self.source_name:
            raise ConfigError(f"config key '{key}.name': name this source (its metrics are reward/NAME)")
        try:
            self.source().validate()
        except ConfigError as e:
            raise ConfigError(under(str(e), key)) from None


def set_keys(cfg: DatasetConfig) -> set[str]:
    """The keys of a `dataset` section that differ from their defaults."""
    default = DatasetConfig()
    return {f.name for f in fields(DatasetConfig) if getattr(cfg, f.name) != getattr(default, f.name)}


def under(message: str, key: str) -> str:
    """A source's error message with its keys named under `key` (dataset.x -> dataset.mix[0].x)."""
    return re.sub(r"'dataset(?=[.'])(?!\.mix\[)", f"'{key}", message)  # not one named under it already


def check_mix(cfg: DatasetConfig) -> None:
    """A `dataset` section with `mix`: its sources, their names and weights."""
    if cfg.mix is None:
        raise ConfigError(
            "config key 'dataset.mix_file': live weights are a mixture's; list its sources in dataset.mix"
        )
    if not cfg.mix:
        raise ConfigError(
            "config key 'dataset.mix' is empty: list its sources ({task: NAME, weight: W}, or a dataset's keys and weight)"
        )
    single = sorted(set_keys(cfg) - {"mix", "mix_file"})
    if single:
        keys = ", ".join(f"'dataset.{k}'" for k in single)
        raise ConfigError(
            f"config keys 'dataset.mix' and {keys}: a mixture's sources carry their own keys; move them into its entries"
        )
    seen: dict[str, int] = {}
    for i, source in enumerate(cfg.mix):
        source.check(f"dataset.mix[{i}]")
        name = source.source_name
        if name in seen:
            raise ConfigError(
                f"config key 'dataset.mix[{i}].name': {name!r} names dataset.mix[{seen[name]}] too; give each source its own `name`"
            )
        seen[name] = i
    problem = weight_problem({s.source_name: s.weight for s in cfg.mix}, list(seen))
    if problem:
        raise ConfigError(f"config key 'dataset.mix': {problem}")


def weight_problem(
    weights: Mapping[str, Any], names: Sequence[str], old: Mapping[str, float] | None = None
) -> str | None:
    """What is wrong with new mixture `weights` (for sources `names`; the others keep `old`), or None."""
    if not isinstance(weights, Mapping) or not weights:
        return f"expected {{name: weight}} for sources {', '.join(names)}, got {weights!r}"
    unknown = [n for n in weights if n not in names]
    if unknown:
        return f"no source named {', '.join(map(repr, unknown))}; sources: {', '.join(names)}"
    for name, w in weights.items():
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < float("inf"):
            return f"the weight of {name!r} must be a number >= 0, got {w!r}"
    if not any({**(old or {}), **weights}.values()):
        return "every weight is 0; at least one source needs weight > 0"
    return _draw_problem({**(old or {}), **weights})


def _draw_problem(weights: Mapping[str, Any]) -> str | None:
    """What the draws (random.choices) would fail on in weights each valid alone: an integer
    beyond a float's range, or a sum that is not finite."""
    for name, w in weights.items():
        try:
            float(w)
        except OverflowError:
            return f"the weight of {name!r} must be a number >= 0 that a float holds, got {str(w)[:20]}..."
    if not math.isfinite(sum(float(w) for w in weights.values())):
        got = ", ".join(f"{n}={float(w):g}" for n, w in weights.items())
        return f"the weights must sum to a finite number, got {got}"
    return None


@dataclass
class RowsConfig:
    """What every supervised app's `data` section has: a local file of rows, or the toy task."""

    path: str = ""  # .jsonl/.json/.parquet/.csv; empty: the toy `task`
    max_tokens: int = 1024  # a longer row is cut to this (its loss tokens past it are lost)
    system: str | None = None  # toy task only: chat examples (this system turn, the task as the user's); None: raw text

    def validate(self) -> None:
        if self.path and Path(self.path).suffix not in FORMATS:
            raise ConfigError(f"config key 'data.path': {self.path} is not one of {', '.join(FORMATS)}")
        if self.path and not Path(self.path).is_file():
            raise ConfigError(f"config key 'data.path': file not found: {self.path}")
        if self.max_tokens < 2:
            raise ConfigError(f"config key 'data.max_tokens' must be >= 2, got {self.max_tokens}")
        if self.path and self.system is not None:
            raise ConfigError(f"config key 'data.system': the toy task's system turn, not {self.path}'s")


@dataclass
class SFTDataConfig(RowsConfig):
    """The SFT app's `data` section: rows of a local file (chat `messages`, or prompt and
    completion columns), or, with no file, the app's toy task (prompt and answer)."""

    messages_key: str = "messages"  # a column of chat messages: loss on the assistant turns only
    prompt_key: str = "prompt"  # else prompt and completion columns: loss on the completion (and EOS)
    completion_key: str = "completion"  # the completion column beside prompt_key
    tools_key: str = "tools"  # a chat row's tools (a list, or it as JSON), if the file has this column
    pack_to: int = 0  # examples packed into rows of up to this many tokens, each seeing only itself; 0: one per row
    noise: float = 0.0  # toy task only: this fraction (0 to 1) of answer characters (or digits) replaced at random
    # Toy task with `system` only: this fraction of examples take a random-length start of the system
    # turn instead (none at length 0), so a model that knows the task behind short prompts learns
    # to find it behind a long one.
    system_cut: float = 0.0
    # With no file: a reasoning-gym generator's entries (question -> answer) in place of the toy
    # task's, `noise` and `system` as for it (a tiny model's warm start on the task GRPO then trains).
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)

    def validate(self) -> None:
        super().validate()
        check_range("data.pack_to", self.pack_to, ">= 0")
        check_ranges(self, "data.", "[0, 1]", ("noise", "system_cut"))
        if self.noise and self.path:
            raise ConfigError(f"config key 'data.noise': corrupts the toy task's answers, not {self.path}'s")
        if self.system_cut and self.system is None:
            raise ConfigError("config key 'data.system_cut' cuts the system turn of data.system, which is not set")
        if self.reasoning_gym.task and self.path:
            raise ConfigError("config keys data.path, data.reasoning_gym.task: each is a source of examples; set one")
        if self.reasoning_gym.task:
            from forge.sources import check_reasoning_gym  # imported here as in DatasetConfig

            check_reasoning_gym(self.reasoning_gym, "data.reasoning_gym")


@dataclass
class PreferenceDataConfig(RowsConfig):
    """A preference app's `data` section: rows of a local file with a prompt and a chosen and a
    rejected completion (plain text, or chat messages as TRL's conversational preference
    datasets have them), or, with no file, pairs of the app's toy task (chosen: the answer,
    rejected: a wrong one)."""

    prompt_key: str = "prompt"  # text, or chat messages (then chosen and rejected are the assistant's)
    chosen_key: str = "chosen"  # the preferred completion's column (text, or chat messages)
    rejected_key: str = "rejected"  # the other completion's column


# The names of forge.losses' LOSSES and IS_CORRECTIONS (tests/test_losses.py checks they agree).
LOSS_NAMES = ("grpo", "dr_grpo", "dapo", "gspo", "cispo", "reinforce", "sft", "dpo", "ipo")
PREFERENCE_LOSSES = {"dpo", "ipo"}  # on pairs of episodes (chosen, rejected), against the reference
# A score head's (trainer.head: score): a reward model's on pairs of sequences, a critic's on returns.
SCORE_LOSS_NAMES = ("bradley_terry", "value")
IS_CORRECTION_NAMES = ("token_truncate", "sequence_truncate", "token_mask", "sequence_mask")
NO_STD_NORMALIZE = {"dr_grpo"}  # Dr.GRPO: the std division biases towards easy and hard groups


@dataclass
class LossConfig:
    name: str = "grpo"  # grpo | dr_grpo | dapo | gspo | cispo | reinforce | sft | dpo | ipo | bradley_terry | value
    clip_low: float = 0.2  # the ratio's lower clip: 1 - clip_low
    clip_high: float = 0.2  # DAPO's clip-higher uses 0.28
    kl_coef: float = 0.0  # k3 KL to the reference model (needs ref_logprobs)
    is_cap: float = 2.0  # truncated importance sampling cap; masking keeps ratios in [1/is_cap, is_cap]
    # How the generator -> trainer ratio weighs tokens: token_truncate | sequence_truncate |
    # token_mask | sequence_mask (forge.losses.IS_CORRECTIONS).
    is_correction: str = "token_truncate"
    norm_tokens: int = 0  # Dr.GRPO's constant normalizer (0: the batch's longest episode)
    # Divide group advantages by the group's reward std; null: the loss's own choice (Dr.GRPO
    # drops it, the others keep it).
    std_normalize: bool | None = None
    beta: float = 0.1  # dpo, ipo: how far from the reference the policy may move (larger: less)
    rpo_alpha: float = 0.0  # dpo, ipo: + this x the chosen completions' NLL (RPO; TRL's rpo_alpha)
    value_clip: float = 0.2  # value (a critic's): how far a step's values may move from the batch's

    def validate(self) -> None:
        if self.name not in LOSS_NAMES + SCORE_LOSS_NAMES:
            raise ConfigError(
                f"unknown loss {self.name!r} (config key 'loss.name'); known: {', '.join(LOSS_NAMES + SCORE_LOSS_NAMES)}"
            )
        check_choice("loss.is_correction", self.is_correction, IS_CORRECTION_NAMES)
        check_range("loss.is_cap", self.is_cap, ">= 1")
        check_ranges(self, "loss.", "> 0", ("beta", "value_clip"))
        # a negative one turns the loss around: clip bounds swapped, Dr.GRPO's sum divided by < 0,
        # a KL that pushes away from the reference
        check_ranges(self, "loss.", ">= 0", ("rpo_alpha", "clip_low", "clip_high", "kl_coef", "norm_tokens"))
        if self.clip_low >= 1:
            raise ConfigError(
                f"config key 'loss.clip_low' must be < 1 (the ratio's floor is 1 - it), got {self.clip_low}"
            )

    @property
    def normalize_std(self) -> bool:
        return self.std_normalize if self.std_normalize is not None else self.name not in NO_STD_NORMALIZE


ADAPTER_CONFIG = "adapter_config.json"  # PEFT's (forge/lora.py writes and reads the format)
# Every linear of attention and MLP, in HF's names (PEFT's `target_modules`).
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoRAConfig:
    """Low-rank adapters on the target linears; the base weights stay frozen."""

    KEY: ClassVar[str] = "trainer.lora"  # how its errors name its keys, wherever it sits (ppo.critic.lora)

    rank: int = 0  # 0: off, every weight trains
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank (> 0)
    dropout: float = 0.0  # on the adapter's input, while training
    targets: list[str] = field(default_factory=lambda: list(ALL_LINEAR))  # HF module names

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def validate(self, key: str = KEY) -> None:
        if self.rank < 0:
            raise ConfigError(f"config key '{key}.rank' must be >= 0 (0: off), got {self.rank}")
        check_range(f"{key}.alpha", self.alpha, "> 0")
        check_range(f"{key}.dropout", self.dropout, "[0, 1)")
        if self.enabled and not self.targets:
            raise ConfigError(f"config key '{key}.targets' names no module to adapt")


KINDS = {
    "local": None,
    "process": "monarch.job:ProcessJob",
    "slurm": "monarch.job:SlurmJob",
    "kubernetes": "monarch.job.kubernetes:KubernetesJob",
}
POD_MESH_NAME = re.compile(r"[a-z][a-z0-9]{0,62}")
ROLES = ("trainer", "generator", "reference", "teacher", "critic", "rewards", "store", "envs")


def job_class(kind: str) -> type:
    module, name = KINDS[kind].split(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, RuntimeError) as e:  # KubernetesJob raises RuntimeError without its package
        raise ConfigError(f"config key 'job.kind': {kind} needs a package (pip install 'forge[{kind}]'): {e}") from None


@dataclass
class JobConfig:
    """The `job` section: a Monarch job kind, its host meshes, and which role runs on which mesh."""

    kind: str = "local"  # local (this host), process, slurm or kubernetes: Monarch's job classes
    meshes: dict[str, int] = field(default_factory=dict)  # host mesh name -> its number of hosts
    args: dict[str, Any] = field(default_factory=dict)  # the job class's constructor arguments
    # kubernetes: each mesh's `KubernetesJob.add_mesh` arguments (label_selector, port, ...)
    mesh_args: dict[str, Any] = field(default_factory=dict)
    placement: dict[str, str] = field(default_factory=dict)  # role (trainer, generator, ...) -> the mesh it runs on

    def hosts(self, role: str) -> int:
        """The hosts `role` runs on: its mesh's, or 1 (this host). A role's procs run on each."""
        mesh = self.placement.get(role)
        return self.meshes[mesh] if mesh else 1

    def validate(self) -> None:
        check_choice("job.kind", self.kind, KINDS)
        if self.kind == "local":
            for key in ("meshes", "args", "mesh_args", "placement"):
                if getattr(self, key):
                    raise ConfigError(f"config key 'job.{key}': a local job runs every role on this host; set job.kind")
            return
        if not self.meshes or any(not isinstance(n, int) or n < 1 for n in self.meshes.values()):
            raise ConfigError(
                f"config key 'job.meshes': name each host mesh with its host count >= 1, got {self.meshes}"
            )
        for role, mesh in self.placement.items():
            if role not in ROLES:
                raise ConfigError(f"config key 'job.placement.{role}': not a role; roles: {', '.join(ROLES)}")
            if mesh not in self.meshes:
                raise ConfigError(
                    f"config key 'job.placement.{role}': no mesh {mesh!r} in job.meshes ({', '.join(self.meshes)})"
                )
        # The job classes' own signatures say which arguments exist: a misspelt one fails here,
        # before anything is submitted (constructing a job would also reconfigure Monarch's transport).
        cls = job_class(self.kind)
        if self.kind == "kubernetes":
            _bind("args", cls, self.args)
            _bind("mesh_args", cls.add_mesh, {"self": None, "name": "m", "num_replicas": 1, **self.mesh_args})
            for name in self.meshes:  # a DNS label, as KubernetesJob.add_mesh requires
                if not POD_MESH_NAME.fullmatch(name):
                    raise ConfigError(
                        f"config key 'job.meshes.{name}': a kubernetes mesh's name is lowercase letters and "
                        "digits, starting with a letter, at most 63 characters"
                    )
        elif self.mesh_args:
            raise ConfigError("config key 'job.mesh_args': only a kubernetes job takes per-mesh arguments")
        else:
            _bind("args", cls, {"meshes": dict(self.meshes), **self.args})
        # A mesh no role is placed on is allocated (nodes, pods) and idles: unplaced roles run on this host.
        unused = [mesh for mesh in self.meshes if mesh not in self.placement.values()]
        if unused:
            raise ConfigError(
                f"config key 'job.placement': no role is placed on job.meshes {', '.join(unused)} "
                "(roles it does not name run on this host); place a role on each mesh or drop it"
            )


def _bind(key: str, fn: Any, kwargs: dict[str, Any]) -> None:
    try:
        inspect.signature(fn).bind(**kwargs)
    except TypeError as e:
        raise ConfigError(f"config key 'job.{key}': {fn.__qualname__}: {e}") from None


REWARD_UNAVAILABLE = ("mask", "zero")  # the GRPO config key `reward_unavailable`
