"""The on-policy gate: exactly one batch of rollouts per policy version, on its weights."""

import asyncio

import pytest

from forge.rollout import OnPolicyGate


class Replicas:
    """`gen.policy_version.fanout()` of a service whose replicas are at `versions`."""

    def __init__(self, *versions: int):
        self.versions = list(versions)
        self.policy_version = self

    async def fanout(self) -> list[int]:
        return list(self.versions)


async def started(gate: OnPolicyGate, tries: int, kept=lambda i: True, fail=()) -> list[int]:
    """Run `tries` groups through the gate concurrently; the versions of those that started."""
    began: list[int] = []

    async def group(i: int) -> None:
        async with gate.place() as place:
            began.append(place.version)
            await asyncio.sleep(0.01)
            if i in fail:
                raise RuntimeError("rollout failed")
            place.kept = kept(i)

    tasks = [asyncio.ensure_future(group(i)) for i in range(tries)]
    await asyncio.wait(tasks, timeout=0.3)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return began


def test_a_batch_gets_exactly_its_groups_once_every_replica_has_its_weights():
    async def main():
        gen = Replicas(0, 1)  # one replica still on version 0
        gate = OnPolicyGate(gen, groups=2, version=1, poll_s=0.005)
        assert await started(gate, 5) == []  # nothing starts on old weights
        gen.versions = [1, 1]
        assert await started(gate, 5) == [1, 1]  # 2 groups: the batch, no more
        gate.advance(2)
        gen.versions = [2, 2]
        assert await started(gate, 5) == [2, 2]

    asyncio.run(main())


@pytest.mark.parametrize(
    "kept, fail, expected",
    [
        (lambda i: True, {0}, 3),  # a failed group gives its room back: one more starts
        (lambda i: i != 1, (), 3),  # a group the buffer did not keep (filtered, masked): room for another
        (lambda i: False, (), 5),  # nothing kept: every try starts
    ],
)
def test_a_group_that_is_not_kept_gives_its_room_back(kept, fail, expected):
    async def main():
        gate = OnPolicyGate(Replicas(3), groups=2, version=3, poll_s=0.005)
        assert len(await started(gate, 5, kept=kept, fail=fail)) == expected

    asyncio.run(main())


def test_a_rewind_starts_that_versions_batch_anew():
    async def main():
        gate = OnPolicyGate(Replicas(5), groups=1, version=5, poll_s=0.005)
        assert await started(gate, 2) == [5]
        gate.advance(5)  # restored from a checkpoint at the same version
        assert await started(gate, 2) == [5]

    asyncio.run(main())
