"""Replay buffer: groups of episodes in, training batches out, with a staleness bound.

    buffer = await ReplayBuffer.options().as_actor(capacity=128, max_staleness=1)
    await buffer.add.call_one(group)                       # a GRPO group (list of Episodes)
    episodes = await buffer.sample.call_one(64, version)   # waits until 64 fresh ones exist

An episode generated under policy version p may train the policy at version v only if
v - p <= max_staleness (0: on-policy). `sample` drops the stale ones first and checks the
bound on what it returns. Places are counted per kept episode: a group whose episodes are
all filtered out (too long; zero reward variance with `dynamic_sampling`) takes no place and blocks
nobody. When full, `add` waits for room (back-pressure on the rollout loops). A group enters
whenever the buffer is not full, so it may overshoot `capacity` by up to a group: groups of
multi-turn episodes vary in size, and a buffer short of a batch must always take the next one.
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
    """FIFO of episodes, bounded by `capacity`, with a staleness bound at sampling time."""

    @classmethod
    def check_args(cls, capacity: int, max_staleness: int, max_tokens: int = 0, dynamic_sampling: bool = False) -> None:
        if capacity < 1 or max_staleness < 0:
            raise ValueError(
                f"ReplayBuffer: capacity must be >= 1 and max_staleness >= 0, got {capacity}, {max_staleness}"
            )

    def __init__(self, capacity: int, max_staleness: int, max_tokens: int = 0, dynamic_sampling: bool = False):
        self.capacity, self.max_staleness, self.max_tokens = capacity, max_staleness, max_tokens
        self.dynamic_sampling = dynamic_sampling
        self.episodes: deque[Episode] = deque()
        self.changed = asyncio.Condition()
        self.stats = {"added": 0, "dropped_stale": 0, "dropped_filtered": 0, "sampled": 0}

    def _keep(self, group: list[Episode]) -> list[Episode]:
        kept = [e for e in group if not (self.max_tokens and len(e.tokens) > self.max_tokens)]
        if self.dynamic_sampling and len({e.reward for e in kept}) < 2:
            kept = []  # no reward variance: zero advantage for all, nothing to learn (DAPO's dynamic sampling)
        self.stats["dropped_filtered"] += len(group) - len(kept)
        return kept

    @concurrent_endpoint
    async def add(self, group: list[Episode]) -> int:
        """Add one group; returns how many of its episodes were kept."""
        kept = self._keep(group)
        async with self.changed:
            await self.changed.wait_for(lambda: len(self.episodes) < self.capacity)
            self.episodes.extend(kept)
            self.stats["added"] += len(kept)
            self.changed.notify_all()
        return len(kept)

    def _drop_stale(self, version: int) -> None:
        """Call with `changed` held. Wakes the adds waiting for the room this frees: without
        that, a `sample` that drops a full buffer of stale episodes and then waits deadlocks
        with them."""
        fresh = [e for e in self.episodes if version - e.policy_version <= self.max_staleness]
        if len(fresh) < len(self.episodes):
            self.stats["dropped_stale"] += len(self.episodes) - len(fresh)
            self.episodes = deque(fresh)
            self.changed.notify_all()

    @concurrent_endpoint
    async def sample(self, batch_size: int, version: int, timeout_s: float | None = None) -> list[Episode]:
        """The `batch_size` oldest episodes usable by policy `version`, once there are enough."""
        if batch_size > self.capacity:
            raise ValueError(f"ReplayBuffer: batch of {batch_size} is larger than capacity {self.capacity}")
        async with self.changed:

            def ready() -> bool:
                self._drop_stale(version)
                return len(self.episodes) >= batch_size

            try:
                await asyncio.wait_for(self.changed.wait_for(ready), timeout_s)
            except TimeoutError:
                raise TimeoutError(
                    f"ReplayBuffer.sample: fewer than {batch_size} episodes usable by policy "
                    f"version {version} after {timeout_s}s ({len(self.episodes)} held)"
                ) from None
            batch = [self.episodes.popleft() for _ in range(batch_size)]
            self.stats["sampled"] += batch_size
            self.changed.notify_all()  # room for waiting adds
        worst = max(version - e.policy_version for e in batch)
        if worst > self.max_staleness:
            raise StalenessError(
                f"episode {worst} versions old in a batch for version {version} (max_staleness={self.max_staleness})"
            )
        return batch

    @endpoint
    async def notify_version(self, version: int) -> int:
        """The trainer moved to `version`: drop what it can no longer use (frees room for adds)."""
        async with self.changed:
            self._drop_stale(version)
        return len(self.episodes)

    @endpoint
    async def state_dict(self) -> dict[str, Any]:
        return {"episodes": list(self.episodes), "stats": dict(self.stats)}

    @endpoint
    async def load_state_dict(self, state: dict[str, Any]) -> None:
        async with self.changed:
            self.episodes = deque(state["episodes"])
            self.stats = dict(state["stats"])
            self.changed.notify_all()

    @endpoint
    async def get_stats(self) -> dict[str, int]:
        return {**self.stats, "size": len(self.episodes)}
