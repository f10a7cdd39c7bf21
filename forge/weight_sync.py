"""The one owner of the policy version the generators serve.

The trainer publishes a version to the WeightStore; `WeightSync` tells the generator replicas,
which pull it while they keep generating, and knows what they hold. Anything waits on it
instead of polling the replicas: until they hold version v (on-policy rollouts), or holding
them on the version they have (an eval, so its samples come from one policy).

    weights = WeightSync(trainer, gen)
    await weights.start()
    version = await weights.push()                # the trainer publishes; replicas load it meanwhile
    await weights.wait_held(version)              # every replica holds it (or newer)
    async with weights.hold(version, 60) as held:  # no swap lands until the block ends (60 s at most)
        ...

One replica load at a time: a version published while the replicas load the one before is
loaded next (or a newer one, skipping it). A respawned replica loads the store's latest itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

log = logging.getLogger("forge")


class WeightSync:
    """The versions the trainer (a service with `push_weights` and `policy_version`) published,
    and the one every replica of `gen` (a service with `load_version` and `policy_version`)
    holds."""

    def __init__(self, trainer: Any, gen: Any):
        self.trainer, self.gen = trainer, gen
        self.published = 0  # the newest version the replicas are to load
        self.held = 0  # every healthy replica holds this version or a newer one
        self._holds, self._hold_until = 0, 0.0  # holders, and when their holds run out at the latest
        self._entering = 0  # holders waiting for the load under way: no later load starts meanwhile
        self._loading = False
        self._change = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Begin on what the replicas hold now (services reused from an earlier run may be past 0);
        replicas on another host than the trainer make room for its versions first."""
        if self.trainer is not None:
            await self.gen.reserve_weights.fanout(await self.trainer.weights_layout.route())
        self.held = min(await self.gen.policy_version.fanout())
        self.published = max(self.published, self.held)
        self._task = asyncio.create_task(self._follow())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def push(self) -> int:
        """The trainer publishes its current weights; returns their version (the replicas load
        it in the background)."""
        version = await self.trainer.push_weights.route()
        self.publish(version)
        return version

    def publish(self, version: int) -> None:
        """`version` is in the store (e.g. a restored trainer published it itself): the replicas
        are to load it."""
        if version > self.published:
            self.published = version
            self._notify()

    async def wait_held(self, version: int, timeout_s: float | None = None) -> None:
        """Until every replica holds `version` or newer; TimeoutError after `timeout_s`."""
        await self._until(lambda: self.held >= version, timeout_s)

    @contextlib.asynccontextmanager
    async def hold(self, version: int, seconds: float) -> AsyncIterator[int]:
        """Wait (up to `seconds`) until the replicas hold `version`, then keep them on what they
        hold until the block ends, or `seconds` at most from entering it (a holder that hangs
        does not stop the run's weights). A load under way lands first. Yields the version held."""
        with contextlib.suppress(TimeoutError):
            await self.wait_held(version, seconds)
        self._holds += 1
        try:
            await self._enter(seconds)
            yield self.held
        finally:
            self._holds -= 1
            if not self._holds:
                self._hold_until = 0.0  # a later hold's limit is its own
            self._notify()

    async def _enter(self, seconds: float) -> None:
        """Wait for the load under way to land, then hold for `seconds`. In force from the start,
        so no later load starts first: with versions published faster than they load, waiting
        for a gap between loads could wait forever; and its `seconds` count from entering, else a
        load longer than them leaves the hold run out as it lands, and the next load starts."""
        self._entering += 1
        try:
            await self._until(lambda: not self._loading)
        finally:
            self._entering -= 1
        self._hold_until = max(self._hold_until, asyncio.get_running_loop().time() + seconds)
        self._notify()  # the follower waits again, now until this hold runs out

    def _notify(self) -> None:
        self._change.set()  # wakes every waiter; each looks again
        self._change = asyncio.Event()

    async def _until(self, ready: Callable[[], bool], timeout_s: float | None = None) -> None:
        async with asyncio.timeout(timeout_s):
            while not ready():
                await self._change.wait()

    def _hold_left(self) -> float:
        if self._entering:
            return math.inf  # until the holder enters (it notifies)
        return self._hold_until - asyncio.get_running_loop().time() if self._holds > 0 else 0.0

    async def _next(self) -> int:
        """The version the replicas load next: once one is newer than theirs and no hold is in force."""
        while not (self.published > self.held and self._hold_left() <= 0):
            left = self._hold_left()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left if 0 < left < math.inf else None):
                    await self._change.wait()
        return self.published

    async def _follow(self) -> None:
        failures = 0
        while True:
            version = await self._next()
            self._loading = True
            try:
                self.held = max(self.held, min(await self.gen.load_version.fanout(version)))
                failures = 0
            except Exception as e:  # e.g. a replica died mid-load: its respawn loads the latest itself
                failures += 1
                log.warning("forge: generators could not load policy version %d: %s", version, e)
                await asyncio.sleep(min(0.1 * 2**failures, 5.0))
            finally:
                self._loading = False
                self._notify()
