"""Replay buffer: GRPO groups in, training batches of whole groups out, with a staleness bound.

    buffer = await ReplayBuffer.options().as_actor(capacity=16, max_staleness=1)
    await buffer.add.call_one(group)                       # a GRPO group (list of Episodes)
    episodes = await buffer.sample.call_one(8, version)   # waits until 8 fresh groups exist

A group is the unit: its advantages are relative to each other, so a batch that held part of a
group would push its episodes up or down alone (one failed episode of eight, advantage -2.6,
with no siblings to balance it). Groups vary in size (multi-turn episodes of several samples,
failed episodes left out, episodes too long to train on), so batches are counted in groups.
A group generated under policy version p (its oldest episode's) may train the policy at
version v only if v - p <= max_staleness (0: on-policy). `sample` drops the stale ones first
and checks the bound on what it returns. A group whose episodes are all filtered out (too
long; zero reward variance with `dynamic_sampling`) takes no place. When `capacity` groups are
held, `add` waits for room (back-pressure on the rollout loops).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from monarch.actor import concurrent_endpoint, endpoint

from forge.actor import ForgeActor
from forge.types import Episode


class StalenessError(AssertionError):
    """An episode older than max_staleness reached a batch."""


class ReplayBuffer(ForgeActor):
    """FIFO of groups, bounded by `capacity` groups, with a staleness bound at sampling time."""

    @classmethod
    def check_args(cls, capacity: int, max_staleness: int, max_tokens: int = 0, dynamic_sampling: bool = False) -> None:
        if capacity < 1 or max_staleness < 0:
            raise ValueError(
                f"ReplayBuffer: capacity must be >= 1 and max_staleness >= 0, got {capacity}, {max_staleness}"
            )

    def __init__(self, capacity: int, max_staleness: int, max_tokens: int = 0, dynamic_sampling: bool = False):
        self.capacity, self.max_staleness, self.max_tokens = capacity, max_staleness, max_tokens
        self.dynamic_sampling = dynamic_sampling
        self.groups: deque[list[Episode]] = deque()
        self.changed = asyncio.Condition()
        self.stats = {"added": 0, "dropped_stale": 0, "dropped_filtered": 0, "dropped_lost": 0, "sampled": 0}
        self.lost: list[tuple[int, int]] = []  # (after, upto]: versions of a trainer that died

    def _lost(self, group: list[Episode]) -> bool:
        if any(lo < e.policy_version <= hi for e in group for lo, hi in self.lost):
            self.stats["dropped_lost"] += len(group)
            return True
        return False

    def _keep(self, group: list[Episode]) -> list[Episode]:
        if self._lost(group):
            return []
        kept = [e for e in group if not (self.max_tokens and len(e.tokens) > self.max_tokens)]
        if self.dynamic_sampling and len({e.reward for e in kept}) < 2:
            kept = []  # no reward variance: zero advantage for all, nothing to learn (DAPO's dynamic sampling)
        self.stats["dropped_filtered"] += len(group) - len(kept)
        return kept

    @concurrent_endpoint
    async def add(self, group: list[Episode]) -> int:
        """Add one group; returns how many of its episodes were kept."""
        kept = self._keep(group)
        if not kept:
            return 0
        async with self.changed:
            await self.changed.wait_for(lambda: len(self.groups) < self.capacity)
            self.groups.append(kept)
            self.stats["added"] += len(kept)
            self.changed.notify_all()
        return len(kept)

    def _fresh(self, group: list[Episode], version: int) -> bool:
        return version - min(e.policy_version for e in group) <= self.max_staleness

    def _drop_stale(self, version: int) -> None:
        """Call with `changed` held. Wakes the adds waiting for the room this frees: without
        that, a `sample` that drops a full buffer of stale groups and then waits deadlocks
        with them."""
        fresh = [g for g in self.groups if self._fresh(g, version)]
        if len(fresh) < len(self.groups):
            self.stats["dropped_stale"] += sum(len(g) for g in self.groups) - sum(len(g) for g in fresh)
            self.groups = deque(fresh)
            self.changed.notify_all()

    @concurrent_endpoint
    async def sample(self, groups: int, version: int, timeout_s: float | None = None) -> list[Episode]:
        """The episodes of the `groups` oldest groups usable by policy `version`, once there are enough."""
        if groups > self.capacity:
            raise ValueError(f"ReplayBuffer: a batch of {groups} groups is larger than capacity {self.capacity}")
        async with self.changed:

            def ready() -> bool:
                self._drop_stale(version)
                return len(self.groups) >= groups

            try:
                await asyncio.wait_for(self.changed.wait_for(ready), timeout_s)
            except TimeoutError:
                raise TimeoutError(
                    f"ReplayBuffer.sample: fewer than {groups} groups usable by policy "
                    f"version {version} after {timeout_s}s ({len(self.groups)} held)"
                ) from None
            taken = [self.groups.popleft() for _ in range(groups)]
            self.changed.notify_all()  # room for waiting adds
        if not all(self._fresh(g, version) for g in taken):
            raise StalenessError(
                f"a group older than max_staleness={self.max_staleness} in a batch for version {version}"
            )
        batch = [e for g in taken for e in g]
        self.stats["sampled"] += len(batch)
        return batch

    @endpoint
    async def notify_version(self, version: int) -> int:
        """The trainer moved to `version`: drop what it can no longer use (frees room for adds).
        Returns the groups held."""
        async with self.changed:
            self._drop_stale(version)
        return len(self.groups)

    @endpoint
    async def state_dict(self) -> dict[str, Any]:
        return {"groups": list(self.groups), "stats": dict(self.stats)}

    @endpoint
    async def load_state_dict(self, state: dict[str, Any]) -> None:
        await self._load(state)

    async def _load(self, state: dict[str, Any]) -> None:
        async with self.changed:
            self.groups = deque(g for g in state["groups"] if not self._lost(g))
            self.stats = {**self.stats, **state["stats"]}
            self.changed.notify_all()

    @endpoint
    async def lose(self, versions: tuple[int, int]) -> None:
        """After a trainer was restored from a checkpoint: never again take a group sampled by
        the versions the dead trainer published after it (`(after, upto]`; generators may still
        be sampling from them), held or to come."""
        self.lost.append(tuple(versions))
        async with self.changed:
            self.groups = deque(g for g in self.groups if not self._lost(g))
            self.changed.notify_all()

    @endpoint
    async def get_stats(self) -> dict[str, int]:
        """Episodes added, dropped and sampled; `size`: groups held, `episodes`: their episodes."""
        return {**self.stats, "size": len(self.groups), "episodes": sum(len(g) for g in self.groups)}
