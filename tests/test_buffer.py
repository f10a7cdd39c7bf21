import asyncio

import pytest
import torch

from forge.buffer import ReplayBuffer
from forge.types import Episode, Score


def group(version: int, rewards=(0.0, 1.0), tokens: int = 4) -> list[Episode]:
    return [
        Episode(
            tokens=[1] * tokens,
            loss_mask=[0] + [1] * (tokens - 1),
            gen_logprobs=[0.0] * tokens,
            score=Score(r),
            policy_version=version,
        )
        for r in rewards
    ]


def test_staleness_capacity_and_state():
    async def main():
        buf = await ReplayBuffer.options().as_actor(capacity=2, max_staleness=1)
        try:
            for v in (0, 1):
                assert await buf.add.call_one(group(v)) == 2
            # Full: the next add waits until a sample makes room.
            blocked = asyncio.ensure_future(buf.add.call_one(group(2)))
            await asyncio.sleep(0.3)
            assert not blocked.done()
            # Policy version 2: the version-0 group is too old and is dropped, not trained on.
            batch = await buf.sample.call_one(1, 2, timeout_s=5)
            assert [e.policy_version for e in batch] == [1, 1]
            assert await blocked == 2
            state = await buf.state_dict.call_one()
            stats = await buf.get_stats.call_one()
            assert stats["dropped_stale"] == 2 and stats["size"] == 1 and stats["episodes"] == 2
            other = await ReplayBuffer.options().as_actor(capacity=2, max_staleness=1)
            await other.load_state_dict.call_one(state)
            assert [e.policy_version for e in await other.sample.call_one(1, 2, timeout_s=5)] == [2, 2]
            await other.shutdown()
            with pytest.raises(Exception, match="fewer than 1 groups usable by policy version 5"):
                await buf.sample.call_one(1, 5, timeout_s=0.5)  # nothing fresh enough for version 5
        finally:
            await buf.shutdown()

    asyncio.run(main())


def test_filtered_group_releases_its_place():
    """A group whose samples are all dropped (zero variance, too long) takes no place: the
    buffer keeps accepting and sampling instead of waiting for it (a known deadlock elsewhere)."""

    async def main():
        buf = await ReplayBuffer.options().as_actor(capacity=1, max_staleness=0, max_tokens=6, dynamic_sampling=True)
        try:
            assert await buf.add.call_one(group(0, rewards=(1.0, 1.0))) == 0  # zero variance
            assert await buf.add.call_one(group(0, tokens=9)) == 0  # too long
            assert await asyncio.wait_for(buf.add.call_one(group(0)), 5) == 2
            assert len(await buf.sample.call_one(1, 0, timeout_s=5)) == 2
            assert (await buf.get_stats.call_one())["dropped_filtered"] == 4
        finally:
            await buf.shutdown()

    asyncio.run(main())


def test_sample_that_drops_stale_wakes_blocked_adds():
    """Full of stale groups with an add waiting for room: the sample that drops them must let
    the add in (it used to wait forever, as a synchronous GRPO run did at step 20)."""

    async def main():
        buf = await ReplayBuffer.options().as_actor(capacity=1, max_staleness=0)
        try:
            await buf.add.call_one(group(0))  # full, version 0
            blocked = asyncio.ensure_future(buf.add.call_one(group(1)))  # waits for room
            await asyncio.sleep(0.5)
            assert not blocked.done()
            batch = await buf.sample.call_one(1, 1, timeout_s=10)  # drops the stale group, takes the fresh one
            assert [e.policy_version for e in batch] == [1, 1] and await blocked == 2
        finally:
            await buf.shutdown()

    asyncio.run(main())


def test_batches_are_whole_groups():
    """A batch never holds part of a group, whatever the groups' sizes (an agentic episode of
    several samples, episodes left out): a lone episode of a group would be pushed by its
    advantage with no siblings to balance it (this split groups at every batch boundary once one
    group was not `group_size` long). A group is as old as its oldest episode: it goes whole."""

    async def main():
        buf = await ReplayBuffer.options().as_actor(capacity=8, max_staleness=0)
        try:
            sizes = [(0.0, 1.0, 1.0), (1.0, 0.0), (0.0, 0.0, 1.0, 1.0, 1.0), (1.0, 0.0)]
            for rewards in sizes:
                g = group(1, rewards)
                for e, a in zip(g, torch.tensor(rewards) - torch.tensor(rewards).mean()):
                    e.advantage = float(a)
                await buf.add.call_one(g)
            mixed = group(1, (0.0, 1.0, 0.5))
            mixed[1].policy_version = 0  # its second episode's first turn was on version 0
            await buf.add.call_one(mixed)
            first = await buf.sample.call_one(2, 1, timeout_s=5)
            second = await buf.sample.call_one(2, 1, timeout_s=5)
            assert [e.reward for e in first] == [*sizes[0], *sizes[1]]
            assert [e.reward for e in second] == [*sizes[2], *sizes[3]]
            for batch in (first, second):
                assert sum(e.advantage for e in batch) == pytest.approx(0, abs=1e-6)
            with pytest.raises(Exception, match="fewer than 1 groups"):
                await buf.sample.call_one(1, 1, timeout_s=0.5)  # the mixed group went whole
            assert (await buf.get_stats.call_one())["dropped_stale"] == 3
        finally:
            await buf.shutdown()

    asyncio.run(main())


def test_a_rewind_after_a_trainer_restore_drops_the_lost_versions_and_replayed_groups():
    """The trainer checkpointed at version 10, published 11 and 12, died, and its restored
    replica publishes 13. The buffer goes back to what the checkpoint held (the prompts after
    it are replayed: their groups would be there twice), and groups sampled by versions 11-12,
    which generators may still produce, never train."""

    async def main():
        buf = await ReplayBuffer.options().as_actor(capacity=8, max_staleness=4)
        try:
            await buf.add.call_one(group(10))
            checkpointed = await buf.state_dict.call_one()
            for v in (11, 12):
                await buf.add.call_one(group(v))  # from prompts the run will replay
            await buf.load_state_dict.call_one(checkpointed)  # the run's rewind, then its restore's loss
            await buf.lose.call_one((10, 12))
            held = await buf.get_stats.call_one()
            late = [await buf.add.call_one(group(v)) for v in (11, 12, 13)]
            batch = await buf.sample.call_one(2, 13, timeout_s=5)
            return held, late, batch, await buf.get_stats.call_one()
        finally:
            await buf.shutdown()

    held, late, batch, stats = asyncio.run(main())
    assert held["size"] == 1 and late == [0, 0, 2]
    assert sorted({e.policy_version for e in batch}) == [10, 13] and stats["dropped_lost"] == 4


def test_an_add_from_before_a_rewind_never_lands():
    """The trainer checkpointed at version 10 and died; the run rewinds the buffer to the
    checkpoint. An add already waiting for room (the loops that sent it are cancelled, the
    actor call is not), and one that arrives after the rewind with a ticket of the old start,
    hold groups of version 10 from prompts the run will replay: neither may land."""

    async def main():
        buf = await ReplayBuffer.options().as_actor(capacity=1, max_staleness=4)
        try:
            start = await buf.restart.call_one(10)
            ticket = await buf.admit.call_one(start)
            checkpointed = await buf.state_dict.call_one()
            await buf.add.call_one(group(10), ticket)  # full now
            waiting = asyncio.ensure_future(buf.add.call_one(group(10), ticket))
            await asyncio.sleep(0.3)
            assert not waiting.done()
            await buf.load_state_dict.call_one(checkpointed)  # the rewind: room again
            waited = await asyncio.wait_for(waiting, 5)
            late = await asyncio.wait_for(buf.add.call_one(group(10), ticket), 5)  # before the loops restart
            return waited, late, await buf.get_stats.call_one()
        finally:
            await buf.shutdown()

    waited, late, stats = asyncio.run(main())
    assert (waited, late) == (0, 0) and stats["size"] == 0


def test_a_batch_the_policy_does_not_step_on_leaves_admission_at_its_version():
    """PPO's critic warm-up: the policy trains on nothing, stays at version 0 and publishes no
    new weights. On-policy, the batch after it is for version 0 again, admitted afresh on
    version 0's weights (admitting for version 1 would wait for weights that never come)."""

    async def main():
        buf = await ReplayBuffer.options().as_actor(capacity=2, max_staleness=0)
        try:
            start = await buf.restart.call_one(0)
            for _ in range(2):
                ticket = await buf.admit.call_one(start)
                await buf.add.call_one(group(0), ticket)
            blocked = asyncio.ensure_future(buf.admit.call_one(start))  # the batch's groups are all admitted
            await asyncio.sleep(0.3)
            assert not blocked.done()
            assert len(await buf.sample.call_one(2, 0, timeout_s=5, policy_steps=False)) == 4
            ticket = await asyncio.wait_for(blocked, 5)
            assert (ticket.version, ticket.weights) == (0, 0)
            await buf.add.call_one(group(0), ticket)
            await buf.add.call_one(group(0), await buf.admit.call_one(start))
            assert len(await buf.sample.call_one(2, 0, timeout_s=5)) == 4  # the policy steps: on to version 1
            assert (await buf.admit.call_one(start)).weights == 1
        finally:
            await buf.shutdown()

    asyncio.run(main())


def test_a_batchs_episodes_name_their_group():
    """Each sampled episode carries its group's place in the batch: what must go whole past the
    buffer (a group whose advantages are not finite) can be found."""

    async def main():
        buf = await ReplayBuffer.options().as_actor(capacity=4, max_staleness=1)
        try:
            for rewards in ((0.0, 1.0, 1.0), (1.0, 0.0)):
                await buf.add.call_one(group(0, rewards))
            return [e.group for e in await buf.sample.call_one(2, 0, timeout_s=5)]
        finally:
            await buf.shutdown()

    assert asyncio.run(main()) == [0, 0, 0, 1, 1]


def test_a_resumed_on_policy_batch_admits_only_the_groups_its_checkpoint_lacks():
    """On-policy, a checkpoint may hold some of the next batch's groups (generated between the
    push and the save). Resumed, the batch admits only the rest: admitting a whole batch more
    would generate groups of which the slowest are thrown away as stale (and bias the batch)."""

    async def main():
        buf = await ReplayBuffer.options().as_actor(capacity=2, max_staleness=0)
        resumed = await ReplayBuffer.options().as_actor(capacity=2, max_staleness=0)
        try:
            start = await buf.restart.call_one(1)
            await buf.add.call_one(group(1), await buf.admit.call_one(start))
            await resumed.load_state_dict.call_one(await buf.state_dict.call_one())
            start = await resumed.restart.call_one(1)
            assert (await asyncio.wait_for(resumed.admit.call_one(start), 5)).version == 1
            blocked = asyncio.ensure_future(resumed.admit.call_one(start))  # the batch is complete
            await asyncio.sleep(0.3)
            assert not blocked.done()
            await resumed.add.call_one(group(1))
            assert len(await resumed.sample.call_one(2, 1, timeout_s=5)) == 4
            assert (await asyncio.wait_for(blocked, 5)).version == 2
        finally:
            await buf.shutdown()
            await resumed.shutdown()

    asyncio.run(main())


def test_each_steps_metrics_count_the_episodes_the_buffer_threw_away(tmp_path):
    """Episodes the buffer drops (too stale, filtered out, sampled by a lost trainer's versions)
    are in the metrics row of the step they were dropped in, not only in `get_stats`."""
    from forge.metrics import MetricWriter, metrics_scope

    async def main():
        with metrics_scope():
            writer = MetricWriter(tmp_path, ["jsonl"])
            buf = await ReplayBuffer.options().as_actor(
                capacity=2, max_staleness=0, max_tokens=6, dynamic_sampling=True
            )
            try:
                await buf.add.call_one(group(0, rewards=(1.0, 1.0)))  # zero variance
                await buf.add.call_one(group(0, tokens=9))  # too long
                await buf.add.call_one(group(0))
                assert await buf.notify_version.call_one(1) == 0  # too old for version 1
                await buf.lose.call_one((1, 2))
                await buf.add.call_one(group(2))  # sampled by a lost version
                return await writer.flush(1), await writer.flush(2)
            finally:
                await buf.shutdown()
                writer.close()

    first, second = asyncio.run(main())
    assert (first["buffer/dropped_filtered"], first["buffer/dropped_stale"], first["buffer/dropped_lost"]) == (4, 2, 2)
    assert not [k for k in second if k.startswith("buffer/")]


def test_groups_of_lost_versions_a_checkpoint_held_are_counted_when_it_loads():
    """A checkpoint taken while a group of version 11 was held, loaded after versions 11-12 were
    lost: that group is dropped, and `dropped_lost` counts it (the checkpoint's counts are loaded
    first, not over it)."""

    async def main():
        buf = await ReplayBuffer.options().as_actor(capacity=8, max_staleness=4)
        try:
            await buf.add.call_one(group(11))
            checkpointed = await buf.state_dict.call_one()
            await buf.lose.call_one((10, 12))
            await buf.load_state_dict.call_one(checkpointed)
            return await buf.get_stats.call_one()
        finally:
            await buf.shutdown()

    stats = asyncio.run(main())
    assert (stats["size"], stats["dropped_lost"]) == (0, 2)
