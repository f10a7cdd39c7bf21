"""Agentic rollouts: GRPO groups of multi-turn episodes, each run on its own through the gateway.

An episode is written one of two ways, and both end as the same Episodes:
- an **agent** (the environment calls the framework): `async def run(client, task) -> float | dict`,
  where `client` is an `openai.AsyncOpenAI` on the gateway with the episode's session as its
  key and `task` the dataset row. It does whatever it does; what it returns is the reward (a
  float, or a dict like a reward function's: `reward`, `correct` and named components).
- an **environment** (the framework drives it): a MessageEnv (forge/env.py) made per episode in
  the environment pool (services/envs/), run by `run_env_episode` through the same gateway.
The gateway's recording of the session becomes the episode's training samples (its exact
tokens, loss mask, logprobs, versions). An agent or environment that raises (SystemExit too),
returns a reward that is not finite, runs out of time (then it is abandoned) or idles past the
gateway's session timeout (the gateway drops its turns) costs its episode only: counted
(`agent_errors`, `env_errors`), its message printed, and its group trains on the others
(`on_failure: mask`) or is dropped (`drop`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

from forge.config import import_object
from forge.console import report
from forge.env import EpisodeStats, run_env_episode
from forge.metrics import Reduce, record_metric
from forge.rollout import RolloutError, finite_advantages, ranked_rewards, within
from forge.tasks import Sample
from forge.types import Episode, Score
from services.envs import RemoteEnv
from services.schema import AgenticConfig


@dataclass
class EpisodeResult:
    score: Score | None  # None: the episode failed
    samples: list[Episode]
    error: str | None = None


class AgenticRollouts:
    """Runs GRPO groups of agent or environment episodes through `gateway` (and `envs`, the
    environment pool service, for environments). With `relative` (GRPO), the advantages compare
    a group's episodes, so a group needs two that succeeded; without (a critic's or teachers'
    advantages, made at train time), one is enough."""

    def __init__(
        self, cfg: AgenticConfig, gateway: Any, envs: Any, group_size: int, std_normalize: bool, relative: bool = True
    ):
        self.cfg, self.gateway, self.envs = cfg, gateway, envs
        self.group_size, self.std_normalize = group_size, std_normalize
        self.fewest = 2 if relative else 1  # successful episodes a group trains on
        self.agent = import_object("agentic.agent", cfg.agent) if cfg.agent else None

    async def group(self, sample: Sample) -> list[Episode]:
        """`group_size` episodes of `sample`, each on its own; their samples with group-relative
        advantages ([] when too few episodes of the group succeeded)."""
        start = time.perf_counter()
        task = sample.row()
        results = await asyncio.gather(*(self.episode(task) for _ in range(self.group_size)))
        record_metric("time/rollout_s", time.perf_counter() - start)
        ok = [r for r in results if r.score is not None]
        for r in ok:
            record_metric("rollout_reward", r.score.reward)
        if len(ok) < self.fewest or (len(ok) < len(results) and self.cfg.on_failure == "drop"):
            record_metric("groups_dropped", 1, Reduce.SUM)
            return []
        advantages = finite_advantages(ranked_rewards([r.score for r in ok]), self.std_normalize)
        out = []
        for r, a in zip(ok, advantages):
            for sample in r.samples:
                sample.score, sample.advantage, sample.task = r.score, a, task["task"]
                out.append(sample)
        return out

    async def episode(self, task: dict[str, Any]) -> EpisodeResult:
        kind = "agent" if self.agent else "env"
        try:
            session = self.gateway.open_session()
        except RuntimeError as e:  # gateway.max_sessions are open: this episode only
            return EpisodeResult(None, [], _failed(kind, str(e), task))
        client = self.gateway.client(session)
        start = time.monotonic()
        score, error, stats = None, None, EpisodeStats()
        late = f"no end within {self.cfg.episode_timeout_s} s (config key 'agentic.episode_timeout_s')"
        try:
            # Its own task, abandoned at the timeout even if it ignores its cancellation.
            score, stats = await within(self._run(client, task), self.cfg.episode_timeout_s, late)
        except RolloutError:
            raise  # the agent broke its contract: every episode would
        except Exception as e:  # this episode only (a timeout, a BaseException of the agent's): the run goes on
            error = _failed(kind, f"{type(e).__name__}: {e}", task)
        finally:
            await client.close()
            record = await self._finish(session)
        if record is None and score is not None:
            score = None
            error = _failed(kind, _CLOSED, task)
        wall = time.monotonic() - start
        for reduce in (Reduce.MEAN, Reduce.P50, Reduce.P99):
            record_metric(f"episode/wall_s_{reduce.value}", wall, reduce)
        if score is None:
            return EpisodeResult(None, [], error)
        samples = record.samples()
        record_metric("episode/turns", len(record.turns))
        record_metric("episode/samples", len(samples))  # 1 when every turn extended the last
        if self.envs is not None:
            record_metric("episode/tool_calls", stats.tool_calls)
            record_metric("episode/truncated", stats.truncated, Reduce.SUM)
            for seconds in stats.env_s:
                record_metric("env/step_s", seconds)
        trained = sum(sum(s.loss_mask) for s in samples)
        record_metric("tokens/trained", trained, Reduce.SUM)
        record_metric("tokens/masked", sum(len(s.tokens) for s in samples) - trained, Reduce.SUM)
        return EpisodeResult(score, samples)

    async def _finish(self, session: str) -> Any:
        """The session's record; None when the gateway closed it first (idle past its timeout,
        its turns dropped): that costs this episode, not its group."""
        try:
            return await self.gateway.finish(session)
        except KeyError:
            return None

    async def _run(self, client: Any, task: dict[str, Any]) -> tuple[Score, EpisodeStats]:
        if self.agent is not None:
            out = await self.agent(client, task)
            try:
                score = Score.coerce(out, f"agent {self.cfg.agent!r} returned {out!r}:", loose=True, check=False)
            except TypeError as e:
                raise RolloutError(
                    f"{e} (an agent returns its reward: a float, or a dict of named components)"
                ) from None
            try:  # a NaN is this episode's failure, not a broken contract
                return score.checked(), EpisodeStats()
            except ValueError as e:
                raise ValueError(f"agent {self.cfg.agent!r} returned {out!r}: {e}") from None
        env = RemoteEnv(self.envs.pinned(), uuid.uuid4().hex)
        step, stats = await run_env_episode(
            env,
            client,
            task,
            self.gateway.model_name,
            self.cfg.max_turns,
            self.cfg.step_timeout_s,
            self.cfg.sampling,
            self.cfg.max_episode_tokens,
        )
        out = {"reward": step.reward, "components": step.info, "correct": step.info.get("correct")}
        where = f"env {self.cfg.env!r} returned reward {step.reward!r}, info {step.info!r}:"
        try:
            score = Score.coerce(out, where, check=False)
        except TypeError as e:
            raise RolloutError(f"{e} (an environment's EnvStep: a number reward, info of numbers)") from None
        try:  # a NaN fails this episode only
            return score.checked(), stats
        except ValueError as e:
            raise ValueError(f"{where} {e}") from None


_CLOSED = (
    "the gateway closed the episode's session and dropped its turns: idle past its timeout "
    "(config key 'agentic.gateway.session_timeout_s')"
)


def _failed(kind: str, error: str, task: dict[str, Any]) -> str:
    """`error`, counted and shown as a failed episode of `kind` ("agent" or "env")."""
    record_metric(f"{kind}_errors", 1, Reduce.SUM)
    report(f"{kind} episode failed", f"{error} (task {_preview(task)})")
    return error


def _preview(task: dict[str, Any]) -> str:
    """The task's prompt, cut to ~60 characters, still one quoted literal (the console groups
    failures by their message without its quoted values)."""
    text = str(task.get("prompt", task))
    return repr(text if len(text) <= 57 else text[:54] + "...")
