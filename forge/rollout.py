"""One prompt's rollout: generate a group, score it, turn it into GRPO Episodes.

An app's `rollout` config key names the rollout function ("package.module:name"), so a
custom single-call rollout (a tool step, a verifier of its own) replaces `generate_and_score`.
Multi-turn episodes through the gateway are the `agentic` section's (services/agentic.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import torch

from forge.losses import group_advantages
from forge.tasks import Sample
from forge.types import Completion, Episode, RewardInput, Score


class RolloutError(TypeError):
    """A rollout function returned something other than its contract says: the run stops at
    once (every later call would fail the same way)."""


async def generate_and_score(sample: Sample, gen: Any, rewards: Any, cfg: Any) -> tuple[list[Completion], list[Score]]:
    """`cfg.group_size` completions of `sample.prompt` from the generator service, scored by
    the reward service. A custom rollout has this signature (`cfg` is the app's config) and
    returns Scores, or dicts of a Score's fields."""
    group = await gen.generate.route(sample.prompt, n=cfg.group_size)
    scores = await rewards.score.route([RewardInput(sample.row(), c.text, c.finish_reason) for c in group])
    return group, scores


def check_rollout(result: Any, where: str) -> tuple[list[Completion], list[Score]]:
    """`result` as (completions, scores), or a RolloutError that says what `where` returned wrong."""
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise RolloutError(f"{where} returned a {type(result).__name__}, not a (completions, scores) pair")
    completions, scores = (list(x) for x in result)
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


REWARD_UNAVAILABLE = ("mask", "zero")  # the GRPO config key `reward_unavailable`


def masked(scores: list[Score], reward_unavailable: str) -> bool:
    """Whether a group stays out of training: with `mask`, when a sample's reward is unknown
    (its infrastructure failed); with `zero` it trains, that reward scored 0."""
    return reward_unavailable == "mask" and any(s.unavailable for s in scores)


def make_group(completions: list[Completion], scores: list[Score], std_normalize: bool = True) -> list[Episode]:
    """Episodes with their scores and group-relative advantages."""
    advantages = group_advantages(torch.tensor([s.reward for s in scores]), std_normalize=std_normalize)
    return [Episode.from_completion(c, score=s, advantage=float(a)) for c, s, a in zip(completions, scores, advantages)]


class OnPolicyGate:
    """On-policy rollouts (max_staleness 0): each batch is exactly the groups started for it, on
    the weights it trains, as in a synchronous system. Without the gate, loops that finish early
    start extra groups, the batch fills with the fastest ones and the slow ones are thrown away:
    wasted generation, and a batch biased to short episodes.

        async with gate.place() as place:              # waits for the version's weights and room
            ...; place.kept = await buffer.add.call_one(episodes) > 0
        gate.advance(version + 1)                      # the step took its batch: rollouts for the next

    A group that fails, or that the buffer does not keep, gives its room back."""

    def __init__(self, gen: Any, groups: int, version: int, poll_s: float = 0.02):
        self.gen, self.groups, self.version, self.poll_s = gen, groups, version, poll_s
        self.planned: defaultdict[int, int] = defaultdict(int)  # version -> groups started or kept
        self._live: dict[int, asyncio.Future] = {}
        self._changed = asyncio.Event()  # set when room may have opened: waiters look again

    def advance(self, version: int) -> None:
        if version <= self.version:  # a rewind (checkpoint restore): that version's batch starts anew
            self.planned.clear()
        self.version = version
        self._changed.set()

    async def _weights_live(self, version: int) -> None:
        # Every replica: a group on a replica still a version behind would be dropped as stale,
        # and this batch would wait for it forever.
        while min(await self.gen.policy_version.fanout(), default=version) < version:
            await asyncio.sleep(self.poll_s)

    @contextlib.asynccontextmanager
    async def place(self) -> AsyncIterator[_Place]:
        while self.planned[self.version] >= self.groups:
            self._changed.clear()
            await self._changed.wait()
        place = _Place(self.version)
        self.planned[place.version] += 1
        try:
            live = self._live.get(place.version)
            if live is None or (live.done() and (live.cancelled() or live.exception())):
                # One poll of the replicas per version, shared by the groups that wait for it.
                live = asyncio.ensure_future(self._weights_live(place.version))
                self._live = {place.version: live}
            await asyncio.shield(live)
            yield place
        finally:
            if not place.kept:
                self.planned[place.version] -= 1
                self._changed.set()
            if place.version < self.version:
                self.planned.pop(place.version, None)


class _Place:
    def __init__(self, version: int):
        self.version, self.kept = version, False
