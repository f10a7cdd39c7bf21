"""Evaluation on a held-out set: the generator samples it, the reward service scores it.
During training (GRPO's `eval` section) it runs beside the loop on a pinned policy version;
alone it is `forge eval CONFIG --model DIR`. A reward model's evals rank held-out pairs
(`PairwiseEvals`).

    eval:
      every: 20           # steps; each eval's row is written at the step it evaluated
      before_train: true  # and one of the starting policy, at step 0
      n: 4                # samples per prompt
      k: [1, 4]           # eval/pass@1, eval/pass@4 (unbiased estimator)
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
from typing import Any

from forge.config import ConfigError
from forge.data import IndexedPrompts, prompt_source
from forge.mixture import source_stream, tagged
from forge.schema import MixSource
from forge.tasks import Sample
from forge.types import Batch, Completion, RewardInput, Score
from services.schema import EvalConfig

log = logging.getLogger("forge")


def held_out(cfg: EvalConfig, task: str, mix: list[MixSource] | None = None) -> list[Sample]:
    """The eval set: `cfg.prompts` prompts of `cfg.dataset`'s source (a file's or a Hugging Face
    dataset's rows: a seeded sample of them, all with prompts: 0; a reasoning-gym generator's
    entries from the held-out seed), else of the toy `task` from the held-out seed. A run's
    mixture `mix`: each source's own (`held_out_of`), one after another."""
    if mix:
        return [s for source in mix for s in held_out_of(cfg, source)]
    return first(prompt_source(cfg.dataset, task, cfg.seed, key="eval.dataset"), cfg.prompts)


def held_out_of(cfg: EvalConfig, source: MixSource) -> list[Sample]:
    """A mixture source's eval set, tagged with its name: the `eval.dataset.mix` entry of that
    name, else the source itself from the held-out seed (a toy task's or a generator's held-out
    prompts); `cfg.prompts` of them, as `held_out`'s."""
    own = {s.source_name: s for s in cfg.dataset.mix or []}.get(source.source_name, source)
    stream = source_stream(own, cfg.seed, "eval.dataset.mix")
    return [tagged(s, source) for s in first(stream, cfg.prompts)]


def first(stream: IndexedPrompts, prompts: int) -> list[Sample]:
    """The first `prompts` samples of `stream`: 64 with prompts: 0 if it is endless; if sized (a
    dataset's rows, reshuffled from the seed), at most its size, all with prompts: 0."""
    if stream.size is None:  # endless: a toy task, a reasoning-gym generator without a size
        count = prompts or 64
    else:
        count = stream.size if prompts == 0 else min(prompts, stream.size)
    samples = []
    for i in range(count):
        try:
            samples.append(stream.sample(i))
        except ConfigError as e:  # a bad row (a null prompt column) costs only itself
            log.warning("forge: eval: %s; the eval goes on without it", e)
    return samples


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from `n` samples of which `c` are correct (Chen et al.
    2021): 1 - C(n-c, k) / C(n, k), as a product that stays exact for large n."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


async def evaluate(cfg: EvalConfig, samples: list[Sample], gen: Any, rewards: Any) -> dict[str, float]:
    """Sample and score every prompt (`cfg.max_concurrent` at a time); the `eval/...` metrics.
    A prompt that fails (a bad prompt, a generator error) counts in eval/errors, not the rest."""
    sampling: dict[str, Any] = {"temperature": cfg.temperature}
    if cfg.max_tokens is not None:
        sampling["max_tokens"] = cfg.max_tokens
    slots = asyncio.Semaphore(cfg.max_concurrent)

    async def one(s: Sample) -> tuple[list[Completion], list[Score]]:
        async with slots:
            group = await gen.generate.route(s.prompt, n=cfg.n, sampling=sampling, tools=s.tools)
            scores = await rewards.score.route(
                [RewardInput(s.row(), c.text, c.finish_reason, thinking=c.thinking) for c in group]
            )
            return group, scores

    results = await asyncio.gather(*(one(s) for s in samples), return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        log.warning("forge: eval: %d of %d prompts failed; the first: %s", len(failed), len(samples), failed[0])
    out = summarize(cfg, [r for r in results if not isinstance(r, BaseException)], asked=len(samples))
    return {**out, **per_source(cfg, samples, results)}


def per_source(cfg: EvalConfig, samples: list[Sample], results: list[Any]) -> dict[str, float]:
    """With prompts of several data sources (a mixture's), each one's metrics too:
    eval/NAME/accuracy, eval/NAME/reward_mean, ..."""
    names = list(dict.fromkeys(s.task for s in samples))
    if len(names) < 2:
        return {}
    out = {}
    for name in names:
        mine = [r for s, r in zip(samples, results) if s.task == name]
        ok = [r for r in mine if not isinstance(r, BaseException)]
        for key, value in summarize(cfg, ok, asked=len(mine)).items():
            out[f"eval/{name}/{key.removeprefix('eval/')}"] = value
    return out


def summarize(
    cfg: EvalConfig, results: list[tuple[list[Completion], list[Score]]], asked: int | None = None
) -> dict[str, float]:
    """The metrics of scored groups (one per prompt). A sample is correct when its reward
    says so (`correct`), else when it has the full reward (1). Samples whose reward was
    unavailable are left out. `asked`: the prompts asked; those without a group are errors."""
    rewards, hits, per_prompt, versions = [], [], [], []
    failures = 0
    for group, scores in results:
        kept = [(c, s) for c, s in zip(group, scores) if not s.unavailable]
        failures += len(group) - len(kept)
        right = [float(s.correct if s.correct is not None else s.reward >= 1.0) for _, s in kept]
        rewards += [s.reward for _, s in kept]
        hits += right
        per_prompt.append((len(right), int(sum(right))))
        versions += [(c.policy_version, c.max_policy_version) for c, _ in kept]
    out = {
        "eval/prompts": float(len(results)),
        "eval/errors": float((asked or len(results)) - len(results)),
        "eval/reward_failures": float(failures),
    }
    if not hits:
        return out
    out["eval/accuracy"] = statistics.fmean(hits)
    out["eval/reward_mean"] = statistics.fmean(rewards)
    out[f"eval/mean@{cfg.n}"] = statistics.fmean(hits)  # correct samples per prompt, averaged
    for k in cfg.k:
        usable = [pass_at_k(n, c, k) for n, c in per_prompt if n >= k]
        if usable:
            out[f"eval/pass@{k}"] = statistics.fmean(usable)
    out["eval/version"] = float(min(v for v, _ in versions))  # the policy evaluated
    out["eval/version_max"] = float(max(v for _, v in versions))  # > eval/version: a swap landed mid-eval
    return out


async def evaluate_pinned(
    cfg: EvalConfig, samples: list[Sample], gen: Any, rewards: Any, weights: Any, version: int = 0
) -> dict[str, float]:
    """`evaluate` on one policy version: waits (a while) until `weights` (a WeightSync) says
    every generator replica has `version` or newer, then holds them on what they have until
    the eval ends (or `max_hold_s`), so no weight swap lands mid-eval. Rollouts go on
    meanwhile, on the held version."""
    async with weights.hold(version, cfg.max_hold_s):
        return await evaluate(cfg, samples, gen, rewards)


class BackgroundEvals:
    """An app's evals beside its training loop: one at a time, each on a pinned version, each
    writing its row at the step it evaluated; a failing eval costs only itself."""

    def __init__(
        self, cfg: EvalConfig, samples: list[Sample], gen: Any, rewards: Any, weights: Any, writer: Any, app: str
    ):
        self.cfg, self.samples, self.gen, self.rewards, self.weights = cfg, samples, gen, rewards, weights
        self.writer, self.app = writer, app
        self.task: asyncio.Task | None = None
        self.accuracy = float("nan")  # the last eval's, for a progress bar

    async def run(self, step: int, version: int) -> None:
        """Evaluate policy `version` (the weights of `step`) now."""
        try:
            result = await self._evaluate(version)
        except Exception as e:  # noqa: BLE001
            log.warning("%s: the eval at step %d failed: %s: %s", self.app, step, type(e).__name__, e)
            return
        self.writer.write(step, result)
        self.accuracy = result.get("eval/accuracy", float("nan"))

    async def _evaluate(self, version: int) -> dict[str, float]:
        return await evaluate_pinned(self.cfg, self.samples, self.gen, self.rewards, self.weights, version)

    def start(self, step: int, version: int) -> None:
        """`run` beside the loop, unless the one before still runs (then this step has none)."""
        if self.task is not None and not self.task.done():
            log.warning("%s: no eval at step %d: the one before still runs (config key 'eval.every')", self.app, step)
            return
        self.task = asyncio.create_task(self.run(step, version))

    async def wait(self) -> None:
        if self.task is not None:
            await self.task

    async def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


class PairwiseEvals(BackgroundEvals):
    """A reward model's evals beside its loop: how often its score ranks a held-out pair's
    chosen completion above the rejected one (`eval/accuracy`), and the mean margin. `pairs`
    holds pair k as episodes 2k and 2k+1; the trainer scores them as they are now."""

    def __init__(self, cfg: EvalConfig, pairs: Batch, trainer: Any, writer: Any, app: str):
        super().__init__(cfg, [], None, None, None, writer, app)
        self.pairs, self.trainer = pairs, trainer

    async def _evaluate(self, version: int) -> dict[str, float]:
        scores = await self.trainer.scores.route(self.pairs)
        n = scores.numel() // 2
        margin = scores[0 : 2 * n : 2] - scores[1 : 2 * n : 2]
        return {
            "eval/accuracy": float((margin > 0).float().mean()),
            "eval/margin": float(margin.mean()),
            "eval/pairs": float(n),
            "eval/version": float(version),
        }
