"""Replay buffer: GRPO groups in, training batches of whole groups out, with a staleness bound.

    buffer = await ReplayBuffer.options().as_actor(capacity=16, max_staleness=1)
    start = await buffer.restart.call_one(version)         # the rollouts begin, for batches of `version` on
    ticket = await buffer.admit.call_one(start)            # room for a group; its weights: ticket.weights or newer
    await buffer.add.call_one(group, ticket)               # a GRPO group (list of Episodes)
    episodes = await buffer.sample.call_one(8, version)   # waits until 8 fresh groups exist
    episodes = await buffer.sample.call_one(8, version, policy_steps=False)  # the next batch is for `version` too

A group is the unit: its advantages are relative to each other, so a batch that held part of a
group would push its episodes up or down alone (one failed episode of eight, advantage -2.6,
with no siblings to balance it). Groups vary in size (multi-turn episodes of several samples,
failed episodes left out, episodes too long to train on), so batches are counted in groups.
A group generated under policy version p (its oldest episode's) may train the policy at
version v only if v - p <= max_staleness (0: on-policy). `sample` drops the stale ones first
and checks the bound on what it returns. A group whose episodes are all filtered out (too
long; zero reward variance with `dynamic_sampling`) takes no place. When `capacity` groups are
held, `add` waits for room (back-pressure on the rollout loops).

Admission is where a group meets the staleness bound before it is generated: `admit` gives
a Ticket with the oldest policy version its weights may have (`max_staleness` older than the next batch's;
generating on older weights would be thrown away). On-policy (max_staleness 0) it also admits
exactly `capacity` groups per batch, as a synchronous system starts them: without that, loops
that finish early start extra groups, the batch fills with the fastest ones and the slow ones
are thrown away (wasted generation, and a batch biased to short episodes). A batch the policy
does not step on (`policy_steps=False`: PPO's critic trains alone) leaves the version as it is:
the next batch is for the same weights, and its groups are admitted afresh. A group admitted
that fails (`withdraw`) or that the buffer does not keep gives its room back. A rewind
(`load_state_dict`, a checkpoint's groups) voids every ticket given before it: an `add` still
on its way or waiting for room brings a group whose prompt the run replays, and is dropped.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any

from monarch.actor import concurrent_endpoint, endpoint

from forge.actor import ForgeActor
from forge.metrics import Reduce, record_metric
from forge.types import Episode


class StalenessError(AssertionError):
    """An episode older than max_staleness reached a batch."""


@dataclass(frozen=True)
class Ticket:
    """A group's admission: which start of the rollouts admitted it, for which batch, and the
    oldest policy version its weights may have."""

    start: int
    version: int
    weights: int


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
        self.stats = {
            "added": 0,
            "dropped_stale": 0,
            "dropped_filtered": 0,
            "dropped_lost": 0,
            "dropped_rewound": 0,
            "sampled": 0,
        }
        self.lost: list[tuple[int, int]] = []  # (after, upto]: versions of a trainer that died
        self.version = 0  # the next batch's policy version
        self.admitted: defaultdict[int, int] = defaultdict(int)  # on-policy: version -> groups started or kept
        self.start = 0  # the rollouts' current start: a call from an earlier one admits nothing

    def _drop(self, why: str, episodes: int) -> None:
        """Count `episodes` thrown away (`why`: stale, filtered, lost, rewound), also in the step's metrics."""
        if episodes:
            self.stats[f"dropped_{why}"] += episodes
            record_metric(f"buffer/dropped_{why}", episodes, Reduce.SUM)

    def _lost(self, group: list[Episode]) -> bool:
        if any(lo < e.policy_version <= hi for e in group for lo, hi in self.lost):
            self._drop("lost", len(group))
            return True
        return False

    def _keep(self, group: list[Episode]) -> list[Episode]:
        if self._lost(group):
            return []
        kept = [e for e in group if not (self.max_tokens and len(e.tokens) > self.max_tokens)]
        if self.dynamic_sampling and len({e.reward for e in kept}) < 2:
            kept = []  # no reward variance: zero advantage for all, nothing to learn (DAPO's dynamic sampling)
        self._drop("filtered", len(group) - len(kept))
        return kept

    @endpoint
    async def restart(self, version: int) -> int:
        """The rollouts (re)start, for batches of policy `version` on: what was admitted
        before is forgotten (after a rewind, that version's batch starts anew). Returns the
        start to admit groups of."""
        async with self.changed:
            self.version = version
            self.admitted.clear()
            # Groups held (a checkpoint's) are the batch's already: on-policy, admit only the rest.
            self.admitted[version] = sum(self._fresh(g, version) for g in self.groups)
            self.start += 1
            self.changed.notify_all()
            return self.start

    @concurrent_endpoint
    async def admit(self, start: int) -> Ticket | None:
        """Room for one group of the rollouts' `start`, to be generated now. On-policy, waits
        while the next batch's groups are all admitted. None once the rollouts restarted: a
        call outlives a caller that was cancelled, and must not take the room of those after it."""
        async with self.changed:
            if self.max_staleness == 0:
                await self.changed.wait_for(lambda: start != self.start or self.admitted[self.version] < self.capacity)
            if start != self.start:
                return None
            if self.max_staleness == 0:
                self.admitted[self.version] += 1
            return Ticket(start, self.version, self.version - self.max_staleness)

    @concurrent_endpoint
    async def withdraw(self, ticket: Ticket) -> None:
        """An admitted group that will not come (its rollout failed): its room goes to another."""
        async with self.changed:
            self._give_back(ticket)

    def _void(self, ticket: Ticket | None) -> bool:
        return ticket is not None and ticket.start != self.start

    def _give_back(self, ticket: Ticket) -> None:
        if ticket.start == self.start and self.admitted.get(ticket.version, 0) > 0:
            self.admitted[ticket.version] -= 1
            self.changed.notify_all()

    def _advance(self, version: int) -> None:
        """The batch before `version` was taken: admission moves on to the next."""
        if version > self.version:
            self.version = version
            for old in [v for v in self.admitted if v < version]:
                del self.admitted[old]
            self.changed.notify_all()

    def _again(self, version: int, taken: int) -> None:
        """The batch for `version` was taken and the next is for `version` too (the policy did not
        step on it): the `taken` groups give their room to the next batch's. No new version is
        invented: the trainer publishes them."""
        self._advance(version)
        self.admitted[version] = max(self.admitted[version] - taken, 0)
        self.changed.notify_all()

    @concurrent_endpoint
    async def add(self, group: list[Episode], ticket: Ticket | None = None) -> int:
        """Add one group (admitted with `ticket`, if it was); returns how many of its episodes
        were kept."""
        kept = self._keep(group)
        if not kept:
            if ticket is not None:
                async with self.changed:
                    self._give_back(ticket)
            return 0
        async with self.changed:
            await self.changed.wait_for(lambda: self._void(ticket) or len(self.groups) < self.capacity)
            if self._void(ticket):  # admitted before a rewind: its prompt is replayed, its room is gone
                self._drop("rewound", len(kept))
                return 0
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
            self._drop("stale", sum(len(g) for g in self.groups) - sum(len(g) for g in fresh))
            self.groups = deque(fresh)
            self.changed.notify_all()

    @concurrent_endpoint
    async def sample(
        self, groups: int, version: int, timeout_s: float | None = None, policy_steps: bool = True
    ) -> list[Episode]:
        """The episodes of the `groups` oldest groups usable by policy `version`, once there are
        enough. Admission moves on to version + 1, unless the policy does not step on this batch
        (`policy_steps=False`): then the next batch is for `version` again."""
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
            if policy_steps:
                self._advance(version + 1)
            else:
                self._again(version, groups)
            self.changed.notify_all()  # room for waiting adds
        if not all(self._fresh(g, version) for g in taken):
            raise StalenessError(
                f"a group older than max_staleness={self.max_staleness} in a batch for version {version}"
            )
        for i, g in enumerate(taken):
            for e in g:
                e.group = i  # what goes whole past here too (a group whose advantages are not finite)
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
            self.stats = {**self.stats, **state["stats"]}  # first: the lost groups dropped next count on it
            self.groups = deque(g for g in state["groups"] if not self._lost(g))
            self.start += 1  # a rewind: no group admitted before it lands (the rollouts restart)
            self.admitted.clear()
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
