"""GRPO: generate groups, score them, train, push weights, as concurrent loops.

    forge run configs/grpo_tiny.yaml [key=value ...]       # or: make run
    forge run --resume runs/grpo_tiny                       # continue from the last checkpoint

`max_staleness` picks the mode: 0 = on-policy (rollouts wait for the newest weights),
1 = one-step off-policy, k = fully async. Change the loss with `trainer.loss.name`, the
rewards with `rewards`, the rollout (multi-turn, tools) with `rollout`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from apps.sft import warm_start
from forge import checkpoint
from forge.buffer import ReplayBuffer
from forge.checkpoint import RunStopped
from forge.config import ConfigError, import_object, to_yaml
from forge.data import DatasetConfig, FilePrompts, TaskPrompts
from forge.job import Job, JobConfig
from forge.metrics import DEFAULT_BACKENDS, MetricWriter, Reduce, discard_pending, plot_rewards, record_metric
from forge.rollout import REWARD_UNAVAILABLE, OnPolicyGate, RolloutError, check_rollout, make_group, masked
from forge.service import ReplicaRestored, ServiceError
from forge.store import start_store, stop_store
from forge.tasks import get_task
from forge.types import collate
from services.agentic import AgenticConfig, AgenticRollouts
from services.envs import EnvPool
from services.evals import BackgroundEvals, EvalConfig, held_out
from services.gateway import Gateway
from services.generator import Generator, GeneratorConfig
from services.judge import JudgeConfig
from services.reference import Reference
from services.rewards import Rewards, check_rewards
from services.sandbox import CodeTestsConfig
from services.tiny_model import ModelConfig
from services.trainer import Trainer, TrainerConfig, weight_store


@dataclass
class Config:
    app: str = "grpo"
    run_name: str = "grpo"
    runs_dir: str = "runs"
    seed: int = 0
    task: str = "reverse"  # a generated toy task (forge/tasks.py), unless `dataset` names a file
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    steps: int = 100
    group_size: int = 8
    groups_per_step: int = 8  # batch = group_size x groups_per_step episodes
    max_staleness: int = 1
    rollout_tasks: int = 4  # concurrent rollout loops
    rollout: str = "forge.rollout:generate_and_score"  # one prompt -> (completions, scores)
    agentic: AgenticConfig = field(default_factory=AgenticConfig)  # multi-turn agents or environments
    max_rollout_failures: int = 20  # rollouts failing in a row before the run stops
    sample_timeout_s: float = 600.0  # the longest wait for a batch before the run stops
    dynamic_sampling: bool = False  # drop zero-variance groups and refill (DAPO)
    max_episode_tokens: int = 0  # drop longer episodes (0: keep all)
    # name: weight (services/rewards.py). Empty here so a config's dict replaces it instead of
    # merging into it (OmegaConf merges dicts); empty after loading means {"exact": 1.0}.
    rewards: dict[str, float] = field(default_factory=dict)
    judge: JudgeConfig = field(default_factory=JudgeConfig)  # the `judge` reward's model and rubric
    code_tests: CodeTestsConfig = field(default_factory=CodeTestsConfig)  # the `code_tests` reward's sandbox
    # A group with a reward whose infrastructure failed (RewardUnavailable): dropped, or trained
    # with that reward at 0.
    reward_unavailable: str = "mask"
    job: JobConfig = field(default_factory=JobConfig)  # where the roles run (forge/job.py); default: this host
    generator_replicas: int = 1  # spread over the hosts of the generator's job mesh
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    trainer_procs: int = 1
    trainer_restores: int = 3  # trainer deaths recovered from the last checkpoint before the run stops
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint_every: int = 25
    eval: EvalConfig = field(default_factory=EvalConfig)  # held-out evals during training
    resume: str | None = None  # a run directory to continue
    metrics: list[str] = field(default_factory=lambda: list(DEFAULT_BACKENDS))

    @property
    def batch_size(self) -> int:
        return self.group_size * self.groups_per_step

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / self.run_name

    def validate(self) -> None:
        """The app's own keys and how sections fit together (each section validates itself)."""
        if self.group_size < 2:
            raise ConfigError(
                f"config key 'group_size' must be >= 2 (GRPO compares samples of a group), got {self.group_size}"
            )
        if self.max_staleness < 0:
            raise ConfigError(f"config key 'max_staleness' must be >= 0, got {self.max_staleness}")
        for key in ("max_rollout_failures", "sample_timeout_s", "rollout_tasks"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"config key '{key}' must be > 0, got {getattr(self, key)}")
        shards = self.trainer_procs * self.trainer.grad_accum
        if self.batch_size % shards:
            raise ConfigError(
                f"batch of {self.batch_size} (group_size x groups_per_step) does not split over "
                f"trainer_procs x trainer.grad_accum = {shards}"
            )
        if not self.rewards:
            self.rewards = {"exact": 1.0}
        if self.reward_unavailable not in REWARD_UNAVAILABLE:
            raise ConfigError(
                f"config key 'reward_unavailable': {self.reward_unavailable!r} is not one of "
                f"{', '.join(REWARD_UNAVAILABLE)}"
            )
        if self.trainer.total_steps is None:
            self.trainer.total_steps = self.steps
        import_object("rollout", self.rollout)
        if self.agentic.enabled and self.rollout != Config.rollout:
            raise ConfigError(
                "config keys 'rollout' and 'agentic': an agent or environment makes the rollouts; set one of them"
            )
        if not self.dataset.path:
            try:
                get_task(self.task)
            except ValueError as e:
                raise ConfigError(f"config key 'task': {e} (or give a file in 'dataset.path')") from None
        self._validate_rewards()
        self._validate_eval()

    def _validate_rewards(self) -> None:
        for key, rewards in (("rewards", self.rewards), ("eval.rewards", self.eval.rewards)):
            try:
                if rewards:
                    check_rewards(self.task, rewards, self.judge, self.code_tests)
            except ValueError as e:
                raise ConfigError(f"config key '{key}': {e}" if key != "rewards" else str(e)) from None
        if "judge" in self.rewards and not self.dataset.path:  # a dataset file's columns: checked once read
            self.judge.check(columns=())

    def _validate_eval(self) -> None:
        if self.eval.enabled and self.dataset.path and not self.eval.dataset.path:
            raise ConfigError(
                "config key 'eval.dataset.path': a run on a dataset file evaluates on a file too (its held-out rows)"
            )
        if self.eval.dataset.path and self.eval.dataset.template == DatasetConfig.template:
            self.eval.dataset.template = self.dataset.template  # the run's prompt format, unless set
            self.eval.dataset.answer_key = self.dataset.answer_key


@dataclass
class Services:
    """What a GRPO run talks to. Spawned once per run; a benchmark reuses them across runs."""

    store: Any
    trainer: Any
    gen: Any
    rewards: Any
    ref: Any | None
    gateway: Gateway | None = None  # the OpenAI API over `gen`, for agents and environments
    envs: Any | None = None  # the environment pool
    eval_rewards: Any | None = None  # the eval's own rewards, when `eval.rewards` differs from the run's
    job: Job | None = None  # the Monarch job whose hosts run the roles

    @classmethod
    async def start(cls, cfg: Config) -> Services:
        model = str(cfg.model.resolve(warm_start))
        job = Job(cfg.job)
        try:
            hosts = job.hosts
            store = await start_store(hosts("store"))
            weights = weight_store(cfg.trainer)  # the run's versions
            trainer = await Trainer.options(
                procs=cfg.trainer_procs, hosts=hosts("trainer"), max_restores=cfg.trainer_restores
            ).as_service(model, cfg.trainer, weights)
            gen = await Generator.options(
                replicas=cfg.generator_replicas, hosts=hosts("generator"), spread=True
            ).as_service(model, cfg.generator, weights)
            rewards = await Rewards.options(hosts=hosts("rewards")).as_service(
                cfg.task, dict(cfg.rewards), cfg.judge, cfg.code_tests
            )
            ref = (
                await Reference.options(hosts=hosts("reference")).as_service(model)
                if cfg.trainer.loss.kl_coef > 0
                else None
            )
            s = cls(store, trainer, gen, rewards, ref, job=job)
            if cfg.eval.enabled and cfg.eval.rewards:
                s.eval_rewards = await Rewards.options().as_service(
                    cfg.task, dict(cfg.eval.rewards), cfg.judge, cfg.code_tests
                )
            if cfg.agentic.enabled:
                s.gateway = await Gateway.start(gen, model, cfg.agentic.gateway, cfg.generator)
            if cfg.agentic.env:
                s.envs = await EnvPool.options(
                    replicas=cfg.agentic.env_replicas, hosts=hosts("envs"), spread=True
                ).as_service(cfg.agentic.env, cfg.agentic.envs_per_replica)
            return s
        except BaseException:
            job.stop()  # its hosts, and whatever already runs on them, go with it: no orphan workers
            raise

    async def shutdown(self) -> None:
        if self.gateway is not None:
            await self.gateway.shutdown()
        await asyncio.gather(
            *([self.envs.shutdown()] if self.envs else []),
            self.gen.shutdown(),
            self.trainer.shutdown(),
            self.rewards.shutdown(),
            *([self.ref.shutdown()] if self.ref else []),
            *([self.eval_rewards.shutdown()] if self.eval_rewards else []),
            return_exceptions=True,
        )
        await stop_store(self.store)
        if self.job is not None:
            self.job.stop()


async def run(cfg: Config) -> dict[str, float]:
    last = checkpoint.latest(cfg.resume) if cfg.resume else None
    if cfg.resume and last is None:
        raise ConfigError(f"config key 'resume': no checkpoint in {cfg.resume}/checkpoints")
    services = await Services.start(cfg)
    try:
        return await train(cfg, services, resume_from=last)
    finally:
        await asyncio.shield(services.shutdown())


async def train(cfg: Config, s: Services, resume_from: Path | None = None) -> dict[str, float]:
    """The GRPO loop on running services; returns the last metrics row. Raises RunStopped when
    the run cannot go on (the trainer could not be restored, rollouts keep failing, no batch
    comes), naming the checkpoint to resume from."""
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    rollout = import_object("rollout", cfg.rollout)
    agentic = (
        AgenticRollouts(cfg.agentic, s.gateway, s.envs, cfg.group_size, cfg.trainer.loss.normalize_std)
        if cfg.agentic.enabled
        else None
    )
    trainer, gen, rewards, ref = s.trainer, s.gen, s.rewards, s.ref
    buffer = await ReplayBuffer.options().as_actor(
        capacity=cfg.groups_per_step * (cfg.max_staleness + 1),
        max_staleness=cfg.max_staleness,
        max_tokens=cfg.max_episode_tokens,
        dynamic_sampling=cfg.dynamic_sampling,
    )
    prompts = FilePrompts(cfg.dataset, cfg.seed) if cfg.dataset.path else TaskPrompts(cfg.task, cfg.seed)
    if "judge" in cfg.rewards and cfg.dataset.path:  # the rubric's fields, now that the file's columns are known
        cfg.judge.check(prompts.rows.column_names)
    prompts.reset()
    version = await trainer.policy_version.route()  # 0, unless these services already trained
    state = {"step": 0, "version": version}
    gate = OnPolicyGate(gen, cfg.groups_per_step, version) if cfg.max_staleness == 0 else None
    failures = {"streak": 0, "last": None}  # rollouts failing in a row, and the last error

    async def rewind(ckpt: Path, trainer_restored: bool = False) -> None:
        """Continue from checkpoint `ckpt`: its step, data position and buffer, and the
        trainer's state (loaded here on --resume; a restored trainer replica loaded it itself
        and published it as a version past the dead one's, whose versions are then lost)."""
        saved = checkpoint.load_run_state(ckpt)
        if not trainer_restored:
            await trainer.load.route(str(ckpt / "trainer"))
            await buffer.load_state_dict.call_one(saved["buffer"])
            await trainer.push_weights.route()  # generators resume on the trained policy
        state["step"] = saved["step"]
        state["version"] = await trainer.policy_version.route()
        if trainer_restored:  # episodes of the replayed prompts, or of the lost versions, must not train
            await buffer.rewind.call_one(saved["buffer"], (saved["version"], state["version"] - 1))
        if gate is not None:
            gate.advance(state["version"])
        prompts.reset(saved["prompts"])
        trainer.set_restore_point(str(ckpt / "trainer"))

    if resume_from is not None:
        await rewind(resume_from)
    writer = MetricWriter(run_dir, cfg.metrics, resume_step=state["step"] if resume_from else None)
    await discard_pending()  # services reused from an earlier run may still hold its values
    evals = BackgroundEvals(
        cfg.eval,
        held_out(cfg.eval, cfg.task) if cfg.eval.enabled else [],
        gen,
        s.eval_rewards or rewards,
        writer,
        "grpo",
    )

    async def rollout_loop() -> None:
        while True:
            try:
                await rollout_once()
                failures["streak"] = 0
            except RolloutError:
                raise  # a broken contract fails every call alike: stop now
            except Exception as e:  # one bad rollout (prompt, reward, replica) never ends the run
                failures["streak"] += 1
                failures["last"] = f"{type(e).__name__}: {e}"
                record_metric("rollout_errors", 1, Reduce.SUM)
                tqdm.write(f"grpo: rollout failed: {failures['last']}")
                if failures["streak"] >= cfg.max_rollout_failures:
                    raise RunStopped(
                        run_dir,
                        state["step"],
                        f"{failures['streak']} rollouts failed in a row (config "
                        f"key 'max_rollout_failures'); the last: {failures['last']}",
                    ) from None
                await asyncio.sleep(min(0.05 * 2 ** (failures["streak"] - 1), 2.0))  # a passing outage backs off

    async def rollout_once() -> None:
        if gate is None:
            await rollout_group()
            return
        async with gate.place() as place:  # on-policy: the next batch's weights, and room in it
            place.kept = await rollout_group() > 0

    async def rollout_group() -> int:
        """One group into the buffer; returns how many of its episodes the buffer kept."""
        start = time.perf_counter()
        if agentic is not None:  # multi-turn episodes through the gateway
            episodes = await agentic.group(next(prompts).row())
            record_metric("time/rollout_s", time.perf_counter() - start)
            for e in episodes:
                record_metric("rollout_reward", e.reward)
            return await buffer.add.call_one(episodes) if episodes else 0
        group, scores = check_rollout(await rollout(next(prompts), gen, rewards, cfg), f"rollout {cfg.rollout!r}")
        record_metric("time/rollout_s", time.perf_counter() - start)  # one group: generation + scoring
        record_metric("generated_tokens", sum(len(c.token_ids) for c in group), Reduce.SUM)
        for sc in scores:
            record_metric("rollout_reward", sc.reward)
            record_metric("reward_failures", sc.failed, Reduce.SUM)
            if sc.unavailable:
                record_metric(f"reward_failures/{sc.unavailable}", 1, Reduce.SUM)
        if masked(scores, cfg.reward_unavailable):
            record_metric("groups_masked", 1, Reduce.SUM)
            return 0
        return await buffer.add.call_one(make_group(group, scores, std_normalize=cfg.trainer.loss.normalize_std))

    async def sample_batch() -> list:
        """The next batch, or the reason none will come: a rollout loop that stopped, or a timeout."""
        get = asyncio.ensure_future(buffer.sample.call_one(cfg.groups_per_step, state["version"]))
        done, _ = await asyncio.wait(
            [get, *rollouts], timeout=cfg.sample_timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if get in done:
            return get.result()
        get.cancel()
        for t in done:
            t.result()  # a rollout loop ends only by raising
        held = await buffer.get_stats.call_one()
        raise RunStopped(
            run_dir,
            state["step"],
            f"no batch of {cfg.groups_per_step} groups usable by policy version "
            f"{state['version']} within {cfg.sample_timeout_s} s (config key 'sample_timeout_s'): the "
            f"buffer holds {held['size']} ({held}); rollouts last failed with: "
            f"{failures['last'] or 'nothing (none failed)'}",
        )

    async def save() -> None:
        partial = checkpoint.partial_dir(run_dir, state["step"])
        await trainer.save.fanout(str(partial / "trainer"))
        path = checkpoint.save_run_state(
            partial, {**state, "prompts": prompts.state_dict(), "buffer": await buffer.state_dict.call_one()}
        )
        trainer.set_restore_point(str(path / "trainer"))

    async def recover(e: ReplicaRestored) -> None:
        died_at = state["step"]
        await evals.cancel()  # its step's rows are about to be dropped
        for t in rollouts:  # their prompts are replayed from the checkpoint's position
            t.cancel()
        await asyncio.gather(*rollouts, return_exceptions=True)
        await rewind(Path(e.restore_point).parent, trainer_restored=True)
        rollouts[:] = [asyncio.create_task(rollout_loop()) for _ in range(cfg.rollout_tasks)]
        writer.rewind(state["step"])
        record_metric("trainer_restores", 1, Reduce.SUM)
        tqdm.write(
            f"grpo: {e}. It died at step {died_at}; the run continues from step {state['step']} "
            f"(policy version {state['version']}); the metrics rows after step {state['step']} are dropped"
        )

    async def step() -> dict[str, float]:
        t0 = time.perf_counter()
        episodes = await sample_batch()
        trained_on = state["version"]
        if gate is not None:
            gate.advance(trained_on + 1)  # rollouts from here on are for the next batch
        t1 = time.perf_counter()
        batch = collate(episodes, pad_id=0, rows_multiple_of=cfg.trainer_procs * cfg.trainer.grad_accum)
        if ref is not None:
            batch.ref_logprobs = await ref.logprobs.route(batch)
        t2 = time.perf_counter()
        version, metrics = await trainer.train_step.route(batch)
        for key, value in metrics.items():
            record_metric(key, value)
        t3 = time.perf_counter()
        await trainer.push_weights.route()  # returns once published
        state["version"] = version
        await buffer.notify_version.call_one(version)
        state["step"] += 1
        for e in episodes:
            record_metric("reward_mean", e.reward)
            record_metric("reward_std", e.reward, Reduce.STD)
            if e.score.correct is not None:
                record_metric("accuracy", e.score.correct)
            record_metric("staleness_mean", trained_on - e.policy_version)
            record_metric("staleness_max", trained_on - e.policy_version, Reduce.MAX)
        wall = time.perf_counter() - t0
        record_metric("tokens_per_s", sum(e.num_response_tokens for e in episodes) / wall)
        for name, seconds in (
            ("wait_s", t1 - t0),
            ("ref_s", t2 - t1),
            ("train_s", t3 - t2),
            ("push_s", wall - (t3 - t0)),
        ):
            record_metric(f"time/{name}", seconds)
        return await writer.flush(state["step"])

    if cfg.eval.before_train and resume_from is None:
        await evals.run(state["step"], state["version"])  # the starting policy, before any rollout
    rollouts = [asyncio.create_task(rollout_loop()) for _ in range(cfg.rollout_tasks)]
    bar = tqdm(total=cfg.steps, initial=state["step"], desc="grpo", unit="step")
    row: dict[str, float] = {}
    plotted = time.monotonic()
    restored: ReplicaRestored | None = None
    try:
        while True:
            try:
                if restored is not None:  # inside the try: the trainer may die again meanwhile
                    await recover(restored)
                    restored = None
                while state["step"] < cfg.steps:
                    row = await step()
                    if time.monotonic() - plotted > 10:  # matplotlib costs ~0.2 s: not every step
                        plot_rewards(run_dir)
                        plotted = time.monotonic()
                    bar.n = state["step"]
                    bar.set_postfix(
                        reward=f"{row['reward_mean']:.3f}",
                        acc=f"{row.get('accuracy', float('nan')):.2f}",
                        tok_s=f"{row['tokens_per_s']:.0f}",
                        **({"eval_acc": f"{evals.accuracy:.2f}"} if cfg.eval.every else {}),
                    )
                    if cfg.checkpoint_every and state["step"] % cfg.checkpoint_every == 0:
                        await save()
                    if cfg.eval.every and state["step"] % cfg.eval.every == 0:
                        evals.start(state["step"], state["version"])
                if cfg.checkpoint_every and state["step"] % cfg.checkpoint_every:
                    await save()  # the final state, unless the loop just saved it
                await evals.wait()
                if cfg.eval.every and state["step"] % cfg.eval.every:
                    await evals.run(state["step"], state["version"])  # the final policy, always
                await trainer.export_hf.route(str(run_dir / "model"))  # the trained policy, HF format
                break
            except ReplicaRestored as e:
                restored = e
    except (KeyboardInterrupt, asyncio.CancelledError):
        print(f"\ngrpo: interrupted at step {state['step']}; saving a checkpoint", flush=True)
        await asyncio.shield(save())
    except (ServiceError, RolloutError) as e:
        raise RunStopped(run_dir, state["step"], str(e)) from e
    finally:
        for t in rollouts:
            t.cancel()
        await asyncio.gather(*rollouts, evals.cancel(), return_exceptions=True)
        bar.close()
        writer.close()
        if (run_dir / "metrics.jsonl").exists():
            plot_rewards(run_dir)
        await asyncio.shield(buffer.shutdown())
    return row


def main(cfg: Config) -> dict[str, float]:
    return asyncio.run(run(cfg))


if __name__ == "__main__":
    from forge.cli import run_app

    run_app("grpo")
