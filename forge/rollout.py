"""Rollouts: one prompt's group of scored Episodes with their advantages, and the loops that
fill the replay buffer with them beside training.

Every kind of rollout is a `Rollouts`: `async group(sample) -> list[Episode]`, which owns its
advantages, its reward-failure masking and its metrics. `SingleTurn` runs a single-call rollout
function, `generate_and_score` or a custom one the `rollout` config key names
("package.module:name"; a tool step, a verifier of its own); multi-turn episodes through the
gateway are the `agentic` section's (services/agentic.py `AgenticRollouts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import torch

from forge.console import report
from forge.losses.advantages import group_advantages
from forge.metrics import Reduce, record_metric
from forge.service import outstanding
from forge.tasks import Sample
from forge.types import Completion, Episode, RewardInput, Score


class RolloutError(TypeError):
    """A rollout function returned something other than its contract says: the run stops at
    once (every later call would fail the same way)."""


class RolloutsStopped(RuntimeError):
    """The rollouts cannot go on (they keep failing, or no batch comes): the run stops."""


class Raised(Exception):
    """A BaseException other than a cancellation (SystemExit, KeyboardInterrupt, a library's
    own) that user code raised, as an error of that call: it never stops the process."""


async def guarded(aw: Awaitable[Any]) -> Any:
    """`aw`'s result; a BaseException it raises (a cancellation aside) as a `Raised`. (In a task
    of its own, a SystemExit or KeyboardInterrupt would even stop the event loop.)"""
    try:
        return await aw
    except (Exception, asyncio.CancelledError, GeneratorExit):  # GeneratorExit: the coroutine is closed
        raise
    except BaseException as e:
        raise Raised(f"{type(e).__name__}: {e}") from e


def unawaited(aw: Awaitable[Any]) -> asyncio.Future:
    """`aw` as a task that no one may await: its outcome is read as it ends, so asyncio does
    not log a failure as never retrieved."""
    task = asyncio.ensure_future(aw)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


async def within(aw: Awaitable[Any], timeout_s: float | None, late: str) -> Any:
    """`aw`'s result, run as its own task (`guarded`); after `timeout_s` (None: no limit) a
    TimeoutError(`late`), the task cancelled and abandoned, as it is when the caller is
    cancelled: asyncio.wait_for would wait for it to end, forever if it swallows its cancellation."""
    task = unawaited(guarded(aw))  # abandoned at the timeout: nobody else reads it
    try:
        done, _ = await asyncio.wait([task], timeout=timeout_s)
    finally:
        task.cancel()  # a no-op once it ended; else on a timeout, or this task's own cancellation
    if not done:
        raise TimeoutError(late)
    if task.cancelled():  # it cancelled itself (we cancel only what has not ended)
        raise Raised("CancelledError: it cancelled itself")
    return task.result()


class Rollouts(Protocol):
    async def group(self, sample: Sample) -> list[Episode]:
        """`sample`'s group of scored episodes with group-relative advantages; [] when the
        group must not train."""
        ...


async def generate_and_score(sample: Sample, gen: Any, rewards: Any, cfg: Any) -> tuple[list[Completion], list[Score]]:
    """`cfg.group_size` completions of `sample.prompt` from the generator service, scored by
    the reward service (None: a run without rewards, each scores 0). A custom rollout has this
    signature (`cfg` is the app's config) and returns Scores, or dicts of a Score's fields."""
    group = await gen.generate.route(sample.prompt, n=cfg.group_size, tools=sample.tools)
    if rewards is None:
        return group, [Score(0.0) for _ in group]
    scores = await rewards.score.route(
        [RewardInput(sample.row(), c.text, c.finish_reason, thinking=c.thinking) for c in group]
    )
    return group, scores


def check_rollout(result: Any, where: str) -> tuple[list[Completion], list[Score]]:
    """`result` as (completions, scores), or a RolloutError that says what `where` returned wrong."""
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise RolloutError(f"{where} returned a {type(result).__name__}, not a (completions, scores) pair")
    try:
        completions, scores = (list(x) for x in result)
    except TypeError:  # one of them is not a sequence (None, a lone Score)
        kinds = " and a ".join(type(x).__name__ for x in result)
        raise RolloutError(f"{where} returned a {kinds}, not a list of completions and a list of scores") from None
    if len(completions) != len(scores) or not completions:
        raise RolloutError(
            f"{where} returned {len(completions)} completions and {len(scores)} scores (one per completion, at least one)"
        )
    for i, c in enumerate(completions):
        if not isinstance(c, Completion):
            raise RolloutError(f"{where}: completions[{i}] is a {type(c).__name__}, not a forge.types.Completion")
    try:
        return completions, [Score.coerce(s, f"{where}: scores[{i}]") for i, s in enumerate(scores)]
    except TypeError as e:
        raise RolloutError(str(e)) from None


def masked(scores: list[Score], reward_unavailable: str) -> bool:
    """Whether a group stays out of training: with `mask`, when a sample's reward is unknown
    (its infrastructure failed); with `zero` it trains, that reward scored 0."""
    return reward_unavailable == "mask" and any(s.unavailable for s in scores)


def finite_advantages(rewards: list[float], std_normalize: bool) -> list[float]:
    """One group's GRPO advantages; a ValueError when they are not finite (a reward that is not,
    or rewards each within float32's range whose differences are not): that group fails,
    counted, and no NaN reaches the trainer."""
    advantages = group_advantages(torch.tensor(rewards), std_normalize=std_normalize)
    if not bool(advantages.isfinite().all()):
        shown = ", ".join(f"{r:.3g}" for r in rewards[:8]) + (", ..." if len(rewards) > 8 else "")
        raise ValueError(f"the group's advantages are not finite (its rewards: {shown}): the group is not trained on")
    return advantages.tolist()


def ranked_rewards(scores: list[Score]) -> list[float]:
    """A group's rewards to rank it by: a sample whose reward failed (scored 0) never ranks above
    one whose reward did not, whatever their range (a reward model's scores may all be below 0,
    where a completion made too long for it would otherwise win its group)."""
    scored = [s.reward for s in scores if not s.failed]
    floor = min(scored, default=0.0)
    return [min(s.reward, floor) if s.failed else s.reward for s in scores]


def make_group(
    completions: list[Completion], scores: list[Score], std_normalize: bool = True, task: str = ""
) -> list[Episode]:
    """Episodes of one prompt (of data source `task`) with their scores and group-relative advantages."""
    advantages = finite_advantages(ranked_rewards(scores), std_normalize)
    return [
        Episode.from_completion(c, score=s, advantage=a, task=task) for c, s, a in zip(completions, scores, advantages)
    ]


class SingleTurn:
    """Groups of a single-call rollout function `fn(sample, gen, rewards, cfg)` (`cfg`: the
    app's config) -> (completions, scores), named `name` in errors."""

    def __init__(self, fn: Callable[..., Awaitable[Any]], name: str, gen: Any, rewards: Any, cfg: Any):
        self.fn, self.name, self.gen, self.rewards, self.cfg = fn, name, gen, rewards, cfg

    async def group(self, sample: Sample) -> list[Episode]:
        start = time.perf_counter()
        result = await self.fn(sample, self.gen, self.rewards, self.cfg)
        group, scores = check_rollout(result, f"rollout {self.name!r}")
        record_metric("time/rollout_s", time.perf_counter() - start)  # one group: generation + scoring
        record_metric("generated_tokens", sum(len(c.token_ids) for c in group), Reduce.SUM)
        for sc in scores:
            record_metric("rollout_reward", sc.reward)
            record_metric("reward_failures", sc.failed, Reduce.SUM)
            if sc.unavailable:
                record_metric(f"reward_failures/{sc.unavailable}", 1, Reduce.SUM)
        if masked(scores, self.cfg.reward_unavailable):
            record_metric("groups_masked", 1, Reduce.SUM)
            return []
        return make_group(group, scores, std_normalize=self.cfg.trainer.loss.normalize_std, task=sample.task)


class DrawnPrompts:
    """The rollout loops' prompt stream as a checkpoint part: its position, and the samples
    drawn whose group has not landed in the buffer yet (in flight as the checkpoint is written,
    or the loops stopped by a Ctrl-C). A run resumed from it draws those first: no prompt is
    skipped (one whose group lands while the checkpoint is written may be drawn again)."""

    def __init__(self, prompts: Any):
        self.prompts, self.replay = prompts, []
        self.pending: dict[int, Any] = {}  # draw -> its sample, until its group lands or fails
        self._draws = itertools.count()

    def draw(self) -> tuple[int, Any]:
        sample = self.replay.pop(0) if self.replay else next(self.prompts)
        key = next(self._draws)
        self.pending[key] = sample
        return key, sample

    def done(self, key: int) -> None:
        """Its group landed in the buffer, or failed (a failed one is not drawn again)."""
        self.pending.pop(key, None)

    def state_dict(self) -> dict[str, Any]:
        return {"stream": self.prompts.state_dict(), "in_flight": [*self.pending.values(), *self.replay]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "stream" not in state:  # a checkpoint from before this part held its draws in flight
            state = {"stream": state, "in_flight": []}
        self.prompts.load_state_dict(state["stream"])
        self.replay, self.pending = list(state["in_flight"]), {}
        names = getattr(self.prompts, "names", None)  # a mixture's sources now
        if names is not None:  # one removed for the resume: its prompts are not drawn again
            gone = sum(s.task not in names for s in self.replay)
            self.replay = [s for s in self.replay if s.task in names]
            if gone:
                report("prompts in flight dropped", f"{gone} of sources no longer in dataset.mix")


class RolloutLoops:
    """`cfg.rollout_tasks` loops, each putting groups of `rollouts` (of the next prompts) into
    `buffer` beside training, and the batches they make. Each group is admitted by the buffer
    first (room in a batch to come, and how old its weights may be) and starts once the
    generators hold those weights (`weights`, a forge.weight_sync.WeightSync). A failing
    rollout costs its group: the loop backs off (a passing outage) and goes on, until
    `cfg.max_rollout_failures` fail in a row.

        async with loops.running(version):
            episodes = await loops.batch(version)     # `cfg.groups_per_step` groups usable by it
    """

    def __init__(self, rollouts: Rollouts, prompts: Any, buffer: Any, weights: Any, cfg: Any):
        self.rollouts, self.buffer, self.weights, self.cfg = rollouts, buffer, weights, cfg
        self.prompts = DrawnPrompts(prompts)  # the run's checkpoint part
        self.tasks: list[asyncio.Task] = []
        self.start_id = 0  # the buffer's name for this start of the loops
        self.streak, self.last_error = 0, None  # rollouts failing in a row, and the last one's error

    @contextlib.asynccontextmanager
    async def running(self, version: int) -> AsyncIterator[RolloutLoops]:
        await self.start(version)
        try:
            yield self
        finally:
            await self.stop()

    async def start(self, version: int) -> None:
        """Start the loops, for batches of policy `version` on."""
        self.start_id = await self.buffer.restart.call_one(version)
        self.tasks = [asyncio.create_task(self._loop()) for _ in range(self.cfg.rollout_tasks)]

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks = []

    async def batch(self, version: int, policy_steps: bool = True) -> list[Episode]:
        """The next batch for policy `version` (with `policy_steps` False, one the policy does
        not step on: the batch after it is for `version` too); or why none will come: a loop that
        stopped, or no batch within `cfg.sample_timeout_s`."""
        sample = self.buffer.sample.call_one(self.cfg.groups_per_step, version, policy_steps=policy_steps)
        get = asyncio.ensure_future(sample)
        done, _ = await asyncio.wait(
            [get, *self.tasks], timeout=self.cfg.sample_timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if get in done:
            return get.result()
        get.cancel()
        for t in done:
            t.result()  # a loop ends only by raising
        held = await self.buffer.get_stats.call_one()
        raise RolloutsStopped(
            f"no batch of {self.cfg.groups_per_step} groups usable by policy version {version} within "
            f"{self.cfg.sample_timeout_s} s (config key 'sample_timeout_s'): the buffer holds {held['size']} "
            f"({held}); rollouts last failed with: {self.last_error or 'nothing (none failed)'}; "
            f"calls outstanding: {outstanding()}"
        )

    async def _loop(self) -> None:
        while True:
            try:
                await self._group()
                self.streak = 0
            except RolloutError:
                raise  # a broken contract fails every call alike: stop now
            except Exception as e:  # one bad rollout (prompt, reward, replica) never ends the run
                self.streak += 1
                self.last_error = f"{type(e).__name__}: {e}"
                record_metric("rollout_errors", 1, Reduce.SUM)
                report("rollout failed", self.last_error)
                if self.streak >= self.cfg.max_rollout_failures:
                    raise RolloutsStopped(
                        f"{self.streak} rollouts failed in a row (config key 'max_rollout_failures'); "
                        f"the last: {self.last_error}"
                    ) from None
                await asyncio.sleep(min(0.05 * 2 ** (self.streak - 1), 2.0))  # a passing outage backs off

    async def _group(self) -> None:
        """One group into the buffer."""
        # Room in a batch to come, and how old its weights may be.
        ticket = await self.buffer.admit.call_one(self.start_id)
        if ticket is None:  # the loops restarted under this call: the new ones admit their own
            return
        try:
            await self.weights.wait_held(ticket.weights)
            draw, sample = self.prompts.draw()
            try:
                # Its own task: a SystemExit or a cancellation of its own costs its group, and one
                # that swallows the loops' stop is abandoned (a Ctrl-C's checkpoint waits for the stop).
                episodes = await within(self.rollouts.group(sample), None, "")
            except Exception:
                self.prompts.done(draw)
                raise
        except Exception:
            await self.buffer.withdraw.call_one(ticket)
            raise
        await self.buffer.add.call_one(episodes, ticket)
        self.prompts.done(draw)
