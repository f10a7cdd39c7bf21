"""The apps' configs (what `forge run` loads, and checks, before an app and its libraries are
imported): `APPS` maps each app's name (a config's `app:` key, apps/NAME.py) to its Config."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import ipaddress
import operator
from dataclasses import dataclass, field
from typing import ClassVar

from forge import tasks
from forge.config import ConfigError, check_choice, check_ranges, import_object
from forge.schema import (
    PREFERENCE_LOSSES,
    REWARD_UNAVAILABLE,
    DatasetConfig,
    JobConfig,
    LossConfig,
    PreferenceDataConfig,
    RunConfig,
    SFTDataConfig,
    set_keys,
)
from services.schema import (
    AgenticConfig,
    DistillConfig,
    EvalConfig,
    GeneratorConfig,
    ModelConfig,
    PPOConfig,
    RewardsConfig,
    TinkerConfig,
    TrainerConfig,
)

# What a batch's advantages come from: `grpo`, each group's rewards; `ppo`, the rewards and a
# critic's values (GAE); `distill`, the teachers' alone (no reward in the run). With
# `distill.teachers`, grpo's and ppo's gain the teachers' too.
ALGORITHMS = ("grpo", "ppo", "distill")

# The keys that moved, by the apps whose configs had them (RunConfig.MOVED).
WEIGHTS_MOVED = {"rewards.*": ("rewards.weights.*", "rewards take their weights under rewards.weights")}
GRPO_MOVED = {
    **WEIGHTS_MOVED,
    "judge": ("rewards.judge", "the reward sections are under rewards"),
    "code_tests": ("rewards.code_tests", "the reward sections are under rewards"),
}
SUPERVISED_MOVED = {
    **WEIGHTS_MOVED,
    "lr": ("trainer.lr", "the optimizer's keys are the trainer's"),
    "eval_every": ("eval.every", "evals have their own section"),
    "eval_samples": ("eval.prompts", "evals have their own section"),
}


def lr_schedule(cfg: RunConfig, key: str, steps: int, what: str) -> None:
    """The LR schedule of trainer section `key` (trainer, ppo.critic), whose optimizer takes
    `steps` steps in the run (`what`: where that number comes from): its length `total_steps`,
    when null, is `steps` (derived: the saved config keeps it null, so a resumed run with more
    `steps` stretches it); a decaying one set shorter would take the LR below 0 after its end."""
    cfg.derive(f"{key}.total_steps", steps)
    trainer = operator.attrgetter(key)(cfg)
    if trainer.lr_decay != "none" and trainer.total_steps < steps:
        raise ConfigError(
            f"config key '{key}.total_steps' must be >= {steps} ({what}) with {key}.lr_decay {trainer.lr_decay}, "
            f"got {trainer.total_steps}: the schedule would end before the run does"
        )


@dataclass
class GRPOConfig(RunConfig):
    MOVED: ClassVar[dict[str, tuple[str, str]]] = GRPO_MOVED

    app: str = "grpo"
    run_name: str = "grpo"
    task: str = "reverse"  # a generated toy task (forge/tasks.py), unless `dataset` names a source
    dataset: DatasetConfig = field(default_factory=DatasetConfig)  # prompts from a file, HF, reasoning-gym or a mix
    model: ModelConfig = field(default_factory=ModelConfig)  # the policy's starting checkpoint
    group_size: int = 8  # samples per prompt, compared with each other for advantages
    groups_per_step: int = 8  # batch = group_size x groups_per_step episodes
    max_staleness: int = 1  # policy versions a sample may lag the trainer by (0: on-policy)
    algorithm: str = "grpo"  # ALGORITHMS
    distill: DistillConfig = field(default_factory=DistillConfig)  # teachers: on-policy distillation
    ppo: PPOConfig = field(default_factory=PPOConfig)  # algorithm ppo: the critic and GAE
    rollout_tasks: int = 4  # concurrent rollout loops
    rollout: str = "forge.rollout:generate_and_score"  # one prompt -> (completions, scores)
    agentic: AgenticConfig = field(default_factory=AgenticConfig)  # multi-turn agents or environments
    max_rollout_failures: int = 20  # rollouts failing in a row before the run stops
    sample_timeout_s: float = 600.0  # the longest wait for a batch before the run stops
    dynamic_sampling: bool = False  # drop zero-variance groups and refill (DAPO)
    max_episode_tokens: int = 0  # drop longer episodes (0: keep all)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)  # what scores a sample (services/rewards/)
    # A group with a reward whose infrastructure failed (RewardUnavailable): dropped, or trained
    # with that reward at 0.
    reward_unavailable: str = "mask"
    job: JobConfig = field(default_factory=JobConfig)  # where the roles run (forge/job.py); default: this host
    generator_replicas: int = 1  # spread over the hosts of the generator's job mesh
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)  # vLLM's engine and sampling
    trainer_procs: int = 1  # the trainer's processes on each host of its job mesh (its FSDP ranks: all of them)
    trainer_restores: int = 3  # trainer deaths recovered from the last checkpoint before the run stops
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # optimizer, loss, LoRA, weights
    eval: EvalConfig = field(default_factory=EvalConfig)  # held-out evals during training

    @property
    def batch_size(self) -> int:
        return self.group_size * self.groups_per_step

    def trainer_ranks(self) -> int:
        """The trainer's ranks: `trainer_procs` on each host of its job mesh."""
        return self.trainer_procs * self.job.hosts("trainer")

    def check_trainer_ranks(self) -> None:
        """The batch splits over the trainer's ranks and micro-batches, its experts over a divisor
        of its ranks: checked here, not when the trainer starts on the cluster."""
        hosts, ranks = self.job.hosts("trainer"), self.trainer_ranks()
        shards = ranks * self.trainer.grad_accum
        if self.batch_size % shards:
            on = f" x {hosts} trainer hosts (job.meshes)" if hosts > 1 else ""
            raise ConfigError(
                f"batch of {self.batch_size} (group_size x groups_per_step) does not split over "
                f"trainer_procs x trainer.grad_accum{on} = {shards}"
            )
        if ranks % self.trainer.expert_parallel:
            raise ConfigError(
                f"config key 'trainer.expert_parallel': {self.trainer.expert_parallel} does not divide the "
                f"trainer's {ranks} ranks (trainer_procs x the hosts of its job mesh)"
            )

    def generator_gpus(self) -> int:
        """The GPUs each generator replica's vLLM engine takes."""
        engine = self.generator.engine
        return engine.get("tensor_parallel_size", 1) * engine.get("pipeline_parallel_size", 1)

    def check_gpus(self) -> None:
        """A SLURM job's nodes have `gpus_per_node`: the procs of a role placed on them, a GPU
        each (a generator replica its engine's), must fit, else they fail on the allocated nodes."""
        gpus = self.job.args.get("gpus_per_node") if self.job.kind == "slurm" else None
        if not gpus:
            return
        than = f"but job.args.gpus_per_node is {gpus}"
        if "trainer" in self.job.placement and self.trainer_procs > gpus:
            raise ConfigError(f"config key 'trainer_procs': {self.trainer_procs} procs on each trainer host, {than}")
        hosts = self.job.hosts("generator")
        replicas = -(-self.generator_replicas // hosts)  # on the fullest host
        want = replicas * self.generator_gpus()
        if "generator" in self.job.placement and want > gpus:
            raise ConfigError(
                f"config key 'generator_replicas': {replicas} replicas x {self.generator_gpus()} GPUs on each of "
                f"{hosts} generator hosts need {want} GPUs, {than}"
            )

    def validate(self) -> None:
        """The app's own keys and how sections fit together (each section validates itself)."""
        super().validate()
        # A critic's values and a teacher's logprobs need no group to compare with; GRPO's advantages do.
        if self.group_size < (1 if self.algorithm in ("ppo", "distill") else 2):
            raise ConfigError(
                f"config key 'group_size' must be >= 2 (GRPO compares samples of a group), got {self.group_size}"
            )
        check_ranges(self, "", ">= 0", ("max_staleness", "trainer_restores", "max_episode_tokens"))
        check_ranges(self, "", "> 0", ("max_rollout_failures", "sample_timeout_s", "rollout_tasks"))
        check_ranges(self, "", ">= 1", ("groups_per_step", "trainer_procs", "generator_replicas"))
        self.check_trainer_ranks()
        self.check_gpus()
        check_choice("reward_unavailable", self.reward_unavailable, REWARD_UNAVAILABLE)
        warmup = self.ppo.critic_warmup if self.algorithm == "ppo" else 0  # steps the policy does not take
        lr_schedule(self, "trainer", max(1, self.steps - warmup), "steps - ppo.critic_warmup" if warmup else "steps")
        lr_schedule(self, "ppo.critic", self.steps * self.ppo.critic_updates, "steps x ppo.critic_updates")
        if self.agentic.enabled and self.rollout != GRPOConfig.rollout:
            raise ConfigError(
                "config keys 'rollout' and 'agentic': an agent or environment makes the rollouts; set one of them"
            )
        self._check_agents_reach_the_gateway()
        if not self.dataset.enabled:
            try:
                tasks.get_task(self.task)
            except ValueError as e:
                raise ConfigError(
                    f"config key 'task': {e} (or give a source: dataset.path, dataset.hf, dataset.reasoning_gym)"
                ) from None
        self.model.check_tiny_task()
        self._validate_rewards()
        self._validate_eval()
        self._validate_algorithm()
        self._check_sources()
        import_object("rollout", self.rollout)  # last: importing it loads torch (the default's module)

    def _check_agents_reach_the_gateway(self) -> None:
        """Agents placed on a cluster's hosts call the gateway at the address it listens on."""
        host = self.agentic.gateway.host
        if not self.agentic.agent or "envs" not in self.job.placement or self.job.kind not in ("slurm", "kubernetes"):
            return
        try:
            address = ipaddress.ip_address(host)
            local = address.is_loopback or address.is_unspecified
        except ValueError:  # a name
            local = host == "localhost"
        if local:
            raise ConfigError(
                f"config keys 'job.placement.envs' and 'agentic.gateway.host': the agent pool runs on other "
                f"hosts, which cannot reach the gateway at {host!r}; set agentic.gateway.host to an address "
                "of this host they reach"
            )

    def _sources(self) -> dict[str, DatasetConfig]:
        """The run's prompt sources by config key: a mixture's entries (dataset.mix[i]), else `dataset`."""
        if self.dataset.mix:
            return {f"dataset.mix[{i}]": source for i, source in enumerate(self.dataset.mix)}
        return {"dataset": self.dataset}

    def _validate_rewards(self) -> None:
        sources = self._sources()
        rows = [f"{key} ({s.source_name})" for key, s in sources.items() if s.enabled]
        if "task" in self.rewards.weights and rows:
            raise ConfigError(
                f"config key 'rewards.weights': the 'task' reward scores toy tasks, not the rows of {', '.join(rows)}"
            )
        others = [
            f"{key} ({s.source_name or 'the toy task ' + self.task})"
            for key, s in sources.items()
            if s.kind != "reasoning_gym"
        ]
        if "reasoning_gym" in self.rewards.weights and others:
            raise ConfigError(
                "config key 'rewards.weights.reasoning_gym': it scores reasoning-gym entries, not the prompts of "
                f"{', '.join(others)} (a source needs reasoning_gym.task)"
            )
        if self.eval.rewards:
            self.rewards.check_weights(self.eval.rewards, "eval.rewards")
        if "judge" in self.rewards.weights and not any(s.enabled for s in sources.values()):
            self.rewards.check_judge(columns=())  # a dataset's columns: checked once read

    def _validate_algorithm(self) -> None:
        check_choice("algorithm", self.algorithm, ALGORITHMS)
        if self.algorithm == "distill" and not self.distill.enabled:
            raise ConfigError("config key 'distill.teachers': algorithm 'distill' learns from teachers; name one")
        sources = [s.source_name or self.task for s in self._sources().values()]
        for i, teacher in enumerate(self.distill.teachers):
            unknown = [t for t in teacher.tasks if t not in sources]
            if unknown:
                raise ConfigError(
                    f"config key 'distill.teachers[{i}].tasks': {unknown} not among the run's data sources {sources}"
                )
        if self.algorithm == "ppo" and self.ppo.critic_warmup >= self.steps:  # no critic, no warm-up
            raise ConfigError(
                f"config key 'ppo.critic_warmup': {self.ppo.critic_warmup} steps of critic alone leave none of "
                f"the run's {self.steps} for the policy"
            )
        if self.dynamic_sampling and self.group_size < 2:
            raise ConfigError(
                "config key 'dynamic_sampling': it drops groups whose rewards are all equal, and a group "
                "of one's always are (group_size 1): no batch would come"
            )
        if self.algorithm == "distill" and self.dynamic_sampling:
            raise ConfigError(
                "config key 'dynamic_sampling': it drops groups whose rewards are equal, and algorithm "
                "'distill' has no reward (every group's are)"
            )

    def _validate_eval(self) -> None:
        if self.dataset.mix:
            return self._validate_eval_mix()
        if self.eval.enabled and self.dataset.kind == "file" and not self.eval.dataset.enabled:
            raise ConfigError(
                "config key 'eval.dataset.path': a run on a dataset file evaluates on a file too (its held-out rows)"
            )
        if self.eval.enabled and self.dataset.kind == "hf" and not self.eval.dataset.enabled:
            raise ConfigError(
                "config key 'eval.dataset.hf': a run on a Hugging Face dataset evaluates on held-out rows too "
                "(e.g. eval.dataset.hf with eval.dataset.split: test)"
            )
        if self.dataset.kind == "reasoning_gym" and not self.eval.dataset.enabled:
            # the run's generator, and prompt format, from the held-out seed (eval.seed)
            self.eval.dataset = copy.deepcopy(self.dataset)
        held = self.eval.dataset
        if held.enabled and not held.messages_key and not held.chat and held.template == DatasetConfig.template:
            # the run's prompt format, unless the eval's file has its own
            held.template, held.messages_key, held.chat, held.tools_key = (
                self.dataset.template,
                self.dataset.messages_key,
                self.dataset.chat,
                self.dataset.tools_key,
            )
            if held.answer_key == DatasetConfig.answer_key:  # its own, where it names one
                held.answer_key = self.dataset.answer_key

    def _validate_eval_mix(self) -> None:
        """A mixture's evals: each source's own held-out set (services/evals.py `held_out_of`); a
        dataset file's or Hugging Face dataset's held-out rows are an `eval.dataset.mix` entry
        named like the source."""
        names = [s.source_name for s in self.dataset.mix]
        held = {s.source_name: s for s in self.eval.dataset.mix or []}
        if set_keys(self.eval.dataset) - {"mix"}:
            raise ConfigError(
                "config key 'eval.dataset': a mixture's run evaluates each source; give a source's held-out "
                "rows as an entry of eval.dataset.mix named like it"
            )
        unknown = [n for n in held if n not in names]
        if unknown:
            raise ConfigError(f"config key 'eval.dataset.mix': {unknown} not among the run's sources {names}")
        for source in self.dataset.mix:
            own = held.get(source.source_name)
            rows = {"file": "a dataset file", "hf": "a Hugging Face dataset"}.get(source.kind)
            if own is None and rows and self.eval.enabled:
                raise ConfigError(
                    f"config key 'eval.dataset.mix': source {source.source_name!r} is {rows}; evaluate it on "
                    f"held-out rows too (an entry {{name: {source.source_name}, {source.kind}: ...}})"
                )
            if own is not None and not own.messages_key and not own.chat and own.template == DatasetConfig.template:
                own.template, own.messages_key, own.chat, own.tools_key = (  # the source's format
                    source.template,
                    source.messages_key,
                    source.chat,
                    source.tools_key,
                )
                if own.answer_key == DatasetConfig.answer_key:  # its own, where it names one
                    own.answer_key = source.answer_key

    def _check_sources(self) -> None:
        """Load the run's and the eval's sources once (a file's or dataset's rows, a generator's
        first entry; each of a mixture's), so a missing split or column fails here, before
        anything is spawned."""
        run = {key: s for key, s in self._sources().items() if s.enabled}
        mix = {f"eval.dataset.mix[{i}]": s for i, s in enumerate(self.eval.dataset.mix or [])}
        held = {key: s for key, s in {"eval.dataset": self.eval.dataset, **mix}.items() if s.enabled}
        held = held if self.eval.enabled else {}
        if not run and not held:
            return
        # Imported here: the data libraries (datasets, reasoning_gym, torchdata) are for runs
        # that use them, and a config of a toy task is checked without them.
        data = importlib.import_module("forge.data")
        for key, source in run.items():
            data.prompt_source(source, self.task, self.seed, key=key)
        for key, source in held.items():
            data.prompt_source(source, self.task, self.eval.seed, key=key)


@dataclass
class SupervisedConfig(RunConfig):
    """What the supervised apps (SFT, preference training) share: a trainer on a model, and
    held-out evals of a toy task or a file through a generator."""

    MOVED: ClassVar[dict[str, tuple[str, str]]] = SUPERVISED_MOVED

    steps: int = 300
    checkpoint_every: int = 100
    metrics: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    task: str = "add"  # the toy task: the examples when `data.path` is empty, and the eval's rewards
    model: ModelConfig = field(default_factory=ModelConfig)  # the starting checkpoint
    batch_size: int = 64  # examples (preference pairs) per step
    trainer_procs: int = 1  # the trainer's processes (FSDP ranks)
    eval: EvalConfig = field(default_factory=EvalConfig)  # held-out evals (through a generator)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)  # the eval's
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)  # the eval's sampler

    def validate(self) -> None:
        super().validate()
        if self.task not in tasks.TASKS:
            raise ConfigError(f"config key 'task': unknown task {self.task!r}; known: {', '.join(sorted(tasks.TASKS))}")
        self.model.check_tiny_task()
        check_ranges(self, "", ">= 1", ("batch_size", "trainer_procs"))
        lr_schedule(self, "trainer", self.steps, "steps")
        if self.eval.enabled:
            if self.data.path and not self.eval.dataset.path:
                raise ConfigError(
                    "config key 'eval.dataset.path': a run on a dataset file evaluates on a file too (held-out prompts)"
                )
            if self.eval.rewards:
                self.rewards.check_weights(self.eval.rewards, "eval.rewards")

    def check_rows(self, packed: bool) -> None:
        shards = self.trainer_procs * self.trainer.grad_accum
        if self.batch_size % shards and not packed:  # packed: empty rows make up the count
            raise ConfigError(
                f"config key 'batch_size': {self.batch_size} rows do not split over trainer_procs x "
                f"trainer.grad_accum = {shards}"
            )


@dataclass
class SFTConfig(SupervisedConfig):
    app: str = "sft"
    run_name: str = "sft_tiny"
    data: SFTDataConfig = field(default_factory=SFTDataConfig)  # the examples: a file, or the toy task's
    # optimizer and loss (sft)
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(lr=3e-3, loss=LossConfig(name="sft")))

    def validate(self) -> None:
        super().validate()
        if self.trainer.loss.name != "sft":
            raise ConfigError(
                f"config key 'trainer.loss.name': the SFT app trains with 'sft', got {self.trainer.loss.name!r}"
            )
        self.check_rows(packed=bool(self.data.pack_to))


@dataclass
class DPOConfig(SupervisedConfig):
    """Preference training (DPO, IPO) on pairs: the reference is the starting policy, frozen
    (with LoRA: the trainer's own model with its adapters off)."""

    app: str = "dpo"
    run_name: str = "dpo_tiny"
    task: str = "reverse"
    batch_size: int = 32  # pairs per step: one row each (chosen and rejected packed together)
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)  # the pairs: a file, or the toy task's
    # optimizer and loss (dpo or ipo, its beta)
    trainer: TrainerConfig = field(
        default_factory=lambda: TrainerConfig(lr=1e-5, loss=LossConfig(name="dpo", beta=0.1))
    )

    def validate(self) -> None:
        super().validate()
        if self.trainer.loss.name not in PREFERENCE_LOSSES:
            raise ConfigError(
                f"config key 'trainer.loss.name': the DPO app trains with one of {', '.join(sorted(PREFERENCE_LOSSES))}, "
                f"got {self.trainer.loss.name!r}"
            )
        self.check_rows(packed=False)


@dataclass
class RMConfig(SupervisedConfig):
    """A reward model: a score head on the model, trained on preference pairs with the
    Bradley-Terry loss; its evals rank held-out pairs (the toy task's from `eval.seed`, or the
    file `eval.dataset.path`, with the `data` section's columns)."""

    app: str = "rm"
    run_name: str = "rm_tiny"
    task: str = "reverse"
    batch_size: int = 32  # pairs per step
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)  # the pairs: a file, or the toy task's
    # optimizer and loss (bradley_terry) on a score head
    trainer: TrainerConfig = field(
        default_factory=lambda: TrainerConfig(lr=1e-4, head="score", loss=LossConfig(name="bradley_terry"))
    )

    def validate(self) -> None:
        super().validate()
        if self.trainer.head != "score":
            raise ConfigError(f"config key 'trainer.head': a reward model has a score head, got {self.trainer.head!r}")
        if self.trainer.loss.name != "bradley_terry":  # `value` (a critic's) needs returns no pair has
            raise ConfigError(
                f"config key 'trainer.loss.name': a reward model trains with bradley_terry, got {self.trainer.loss.name!r}"
            )
        self.check_rows(packed=False)

    @property
    def held_out(self) -> PreferenceDataConfig:
        return dataclasses.replace(self.data, path=self.eval.dataset.path)


@dataclass
class TinkerAppConfig(RunConfig):
    """`forge tinker`: the Tinker API over one trainer (every client's LoRA adapter on it) and a
    generator service (every sampler's adapter on it), until Ctrl-C."""

    app: str = "tinker"
    run_name: str = "tinker"  # checkpoints: RUNS/NAME/tinker/MODEL_ID/{weights,sampler_weights}/NAME
    model: ModelConfig = field(default_factory=ModelConfig)  # the base model every client's adapter trains on
    tinker: TinkerConfig = field(default_factory=TinkerConfig)  # the server, its keys and bounds
    generator_replicas: int = 1  # generator replicas the samplers share
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)  # vLLM's engine (its LoRA slots)
    trainer_procs: int = 1  # the trainer's processes (FSDP ranks)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # lora: set from `tinker` (rank, alpha, every linear)

    def validate(self) -> None:
        super().validate()
        self.model.check_tiny_task()
        self.tinker.validate()
        check_ranges(self, "", ">= 1", ("generator_replicas", "trainer_procs"))
        if self.trainer.lora.enabled:
            raise ConfigError(
                "config key 'trainer.lora': forge tinker sets each client's adapter (tinker.max_lora_rank, "
                "tinker.lora_alpha); leave trainer.lora unset"
            )


APPS: dict[str, type[RunConfig]] = {
    "grpo": GRPOConfig,
    "sft": SFTConfig,
    "dpo": DPOConfig,
    "rm": RMConfig,
    "tinker": TinkerAppConfig,
}
