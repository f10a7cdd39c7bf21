"""Agentic rollouts: GRPO groups of multi-turn episodes, each run on its own through the gateway.

An episode is written one of two ways, and both end as the same Episodes:
- an **agent** (the environment calls the framework): `async def run(client, task) -> float | dict`,
  where `client` is an `openai.AsyncOpenAI` on the gateway with the episode's session as its
  key and `task` the dataset row. It does whatever it does; what it returns is the reward (a
  float, or a dict like a reward function's: `reward`, `correct` and named components). Agents
  run in the agent pool (`AgentPool`), processes of their own: one that blocks its event loop
  (`time.sleep`, a blocking library), spins or exits the process stalls or kills that pool
  replica and the episodes on it, never the controller, its gateway or the other roles.
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
import ssl
import time
import uuid
from dataclasses import dataclass
from typing import Any

from monarch.actor import concurrent_endpoint

from forge.actor import ForgeActor
from forge.config import ConfigError, import_object
from forge.console import report
from forge.env import EpisodeStats, run_env_episode
from forge.metrics import Reduce, record_metric
from forge.rollout import Raised, RolloutError, finite_advantages, guarded, ranked_rewards, unawaited, within
from forge.tasks import Sample
from forge.types import Episode, Score
from services.envs import RemoteEnv
from services.gateway import gateway_client
from services.schema import AgenticConfig


class AgentPool(ForgeActor):
    """Runs agent episodes (`agentic.agent`) on the gateway at `base_url`, each with a client of
    its own under its session, many at once on this actor's event loop. Endpoints: run (one
    episode, its Score), abandon (its caller gave up on it: the agent is cancelled). A replica that
    dies fails the episodes it ran (none is run twice) and is respawned for the next."""

    retried = False

    def __init__(self, base_url: str):
        self.base_url = base_url
        self.ssl = ssl.create_default_context()  # one per process (see gateway_client)
        self.episodes: dict[str, asyncio.Task] = {}

    @concurrent_endpoint
    async def run(self, agent: str, episode: str, session: str, task: dict[str, Any]) -> Score:
        self.episodes[episode] = asyncio.current_task()
        client = gateway_client(self.base_url, session, self.ssl)
        try:
            return await run_agent(agent, client, task)
        except ConfigError as e:  # this process cannot import it (another host, working directory): no episode can run
            raise RolloutError(f"the agent pool: {e}") from None
        except (RolloutError, Raised):
            raise
        except Exception as e:  # as text: many classes (openai's errors) cannot be rebuilt from their pickle
            raise Raised(f"{type(e).__name__}: {e}") from None
        finally:
            self.episodes.pop(episode, None)
            await client.close()

    @concurrent_endpoint
    async def abandon(self, episode: str) -> None:
        task = self.episodes.pop(episode, None)
        if task is not None:
            task.cancel()


async def run_agent(agent: str, client: Any, task: dict[str, Any]) -> Score:
    """One episode of agent `agent` ("package.module:name") with `client`: its Score."""
    # guarded: an agent's SystemExit is its episode's error, not the end of the process running it.
    return agent_score(agent, await guarded(import_object("agentic.agent", agent)(client, task)))


def agent_score(agent: str, out: Any) -> Score:
    """What agent `agent` returned, as its episode's Score. Not a reward at all: a RolloutError
    (the contract is broken: every episode would); a reward that is not finite: a ValueError
    (this episode's failure)."""
    try:
        score = Score.coerce(out, f"agent {agent!r} returned {out!r}:", loose=True, check=False)
    except TypeError as e:
        raise RolloutError(f"{e} (an agent returns its reward: a float, or a dict of named components)") from None
    try:
        return score.checked()
    except ValueError as e:
        raise ValueError(f"agent {agent!r} returned {out!r}: {e}") from None


@dataclass
class EpisodeResult:
    score: Score | None  # None: the episode failed
    samples: list[Episode]
    error: str | None = None


class AgenticRollouts:
    """Runs GRPO groups of agent or environment episodes through `gateway`, on `pool`: the
    agent pool service (AgentPool) for an agent, the environment pool (EnvPool) for an
    environment. With `relative` (GRPO), the advantages compare a group's episodes, so a group
    needs two that succeeded; without (a critic's or teachers' advantages, made at train time),
    one is enough."""

    def __init__(
        self, cfg: AgenticConfig, gateway: Any, pool: Any, group_size: int, std_normalize: bool, relative: bool = True
    ):
        self.cfg, self.gateway, self.pool = cfg, gateway, pool
        self.group_size, self.std_normalize = group_size, std_normalize
        self.fewest = 2 if relative else 1  # successful episodes a group trains on

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
        kind = "agent" if self.cfg.agent else "env"
        try:
            session = self.gateway.open_session()
        except RuntimeError as e:  # gateway.max_sessions are open: this episode only
            return EpisodeResult(None, [], _failed(kind, str(e), task))
        start = time.monotonic()
        score, error, stats = None, None, EpisodeStats()
        late = f"no end within {self.cfg.episode_timeout_s} s (config key 'agentic.episode_timeout_s')"
        try:
            # Its own task, abandoned at the timeout even if it ignores its cancellation.
            run = self._run_agent(session, task) if self.cfg.agent else self._run_env(session, task)
            score, stats = await within(run, self.cfg.episode_timeout_s, late)
        except RolloutError:
            raise  # the agent broke its contract: every episode would
        except Raised as e:  # what the agent raised, named as it was
            error = _failed(kind, str(e), task)
        except Exception as e:  # this episode only (a timeout, a BaseException of the agent's): the run goes on
            error = _failed(kind, f"{type(e).__name__}: {e}", task)
        finally:
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
        if self.cfg.env:
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

    async def _run_agent(self, session: str, task: dict[str, Any]) -> tuple[Score, EpisodeStats]:
        pool, episode = self.pool.pinned(), uuid.uuid4().hex
        replica, respawns = pool.replica, pool.replica.respawns  # the one it runs on, as it was
        try:
            return await pool.run.route(self.cfg.agent, episode, session, task), EpisodeStats()
        except asyncio.CancelledError:  # its timeout: the agent is stopped where it runs, unawaited
            unawaited(self._abandon(pool, episode, replica, respawns))
            raise

    async def _abandon(self, pool: Any, episode: str, replica: Any, respawns: int) -> None:
        """Cancel `episode` where it runs; a replica that does not answer within step_timeout_s
        has an agent blocking its event loop for good (a loop without an await): it is replaced,
        or every episode sent to it from now on would time out."""
        if pool.replica is not replica or not replica.healthy:  # it died or moved: the episode went with it
            return
        try:
            await asyncio.wait_for(pool.abandon.route(episode), self.cfg.step_timeout_s)
        except TimeoutError:
            why = f"did not answer within {self.cfg.step_timeout_s} s (its event loop is blocked)"
            self.pool.replace(replica, why, respawns)

    async def _run_env(self, session: str, task: dict[str, Any]) -> tuple[Score, EpisodeStats]:
        env = RemoteEnv(self.pool.pinned(), uuid.uuid4().hex)
        client = self.gateway.client(session)
        try:
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
        finally:
            await client.close()
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
