"""Environment pool: N environment actors, each running up to `capacity` episodes at once.

    pool = await EnvPool.options(replicas=4).as_service("services.envs.calculator:Calculator", capacity=64)
    env = RemoteEnv(pool.pinned(), episode_id)       # a MessageEnv; every call on one actor
    messages, tools = await env.reset(task)

An environment is made per episode from `factory` ("package.module:name", a class or a
function returning a MessageEnv) inside the actor, so a slow or crashing environment costs its
own process, never the controller. An actor takes at most `capacity` episodes at once; more
wait for a place (back-pressure on the rollouts). A sync environment method runs in a thread.
"""

from __future__ import annotations

import asyncio
from typing import Any

from monarch.actor import concurrent_endpoint, endpoint

from forge.actor import ForgeActor
from forge.config import import_object
from forge.env import EnvStep, call


class EnvPool(ForgeActor):
    """Environments by episode id. Endpoints: reset, step, close (call them through one
    pinned session: the episode lives in one actor)."""

    @classmethod
    def check_args(cls, factory: str, capacity: int = 64) -> None:
        import_object("agentic.env", factory)
        if capacity < 1:
            raise ValueError(f"EnvPool: capacity must be >= 1, got {capacity}")

    def __init__(self, factory: str, capacity: int = 64):
        self.factory, self.capacity = factory, capacity
        self.envs: dict[str, Any] = {}
        # A reset or step in progress, cancelled if its episode is closed: a reset still waiting
        # for a place would otherwise take one later, for an environment no one closes.
        self.steps: dict[str, asyncio.Task] = {}
        self.places = asyncio.Semaphore(capacity)

    @concurrent_endpoint
    async def reset(self, episode: str, task: dict[str, Any]) -> tuple[list[dict], list[dict] | None]:
        self.steps[episode] = asyncio.current_task()
        try:
            await self.places.acquire()
            try:
                env = self.envs[episode] = import_object("agentic.env", self.factory)()
            except BaseException:
                self.places.release()
                raise
            return await call(env.reset, task)
        except BaseException:
            if self.envs.pop(episode, None) is not None:  # else close took it, and its place
                self.places.release()
            raise
        finally:
            self.steps.pop(episode, None)

    @concurrent_endpoint
    async def step(self, episode: str, message: dict[str, Any]) -> EnvStep:
        if episode not in self.envs:
            raise KeyError(f"EnvPool: no episode {episode!r} here (closed, or this actor was respawned)")
        self.steps[episode] = asyncio.current_task()
        try:
            return await call(self.envs[episode].step, message)
        finally:
            self.steps.pop(episode, None)

    @concurrent_endpoint
    async def close(self, episode: str) -> None:
        if episode in self.steps:  # the caller gave up on a reset or step (its timeout): stop it
            self.steps.pop(episode).cancel()
        env = self.envs.pop(episode, None)
        if env is None:
            return
        try:
            await call(env.close)
        finally:
            self.places.release()

    @endpoint
    async def open_episodes(self) -> int:
        return len(self.envs)


class RemoteEnv:
    """One episode's environment in the pool, as a MessageEnv (its calls on one actor)."""

    def __init__(self, session: Any, episode: str):
        self.session, self.episode = session, episode

    async def reset(self, task: dict[str, Any]) -> tuple[list[dict], list[dict] | None]:
        return await self.session.reset.route(self.episode, task)

    async def step(self, message: dict[str, Any]) -> EnvStep:
        return await self.session.step.route(self.episode, message)

    async def close(self) -> None:
        await self.session.close.route(self.episode)
