"""The policy version the generators serve (forge/weight_sync.py) and the buffer's admission of
rollouts (forge/buffer.py): on-policy, exactly one batch of groups per version, on its weights;
off-policy, never on weights older than max_staleness allows."""

import asyncio
import contextlib
import itertools
import time
from types import SimpleNamespace

import pytest

from forge.buffer import ReplayBuffer
from forge.data import IndexedPrompts
from forge.rollout import DrawnPrompts, RolloutLoops, SingleTurn, make_group
from forge.tasks import Sample
from forge.types import Completion, Episode, Score
from forge.weight_sync import WeightSync


class Fanout:
    def __init__(self, fn):
        self.fn = fn

    async def fanout(self, *args):
        return await self.fn(*args)


class FakeGen:
    """A generator service of `replicas` replicas that load a version in `load_s`; the next
    `fail` loads raise."""

    def __init__(self, replicas: int = 2, load_s: float = 0.05):
        self.versions, self.load_s, self.loads, self.fail = [0] * replicas, load_s, [], 0
        self.policy_version = Fanout(self._versions)
        self.load_version = Fanout(self._load)

    async def _versions(self):
        return list(self.versions)

    async def _load(self, version):
        self.loads.append(version)
        await asyncio.sleep(self.load_s)
        if self.fail:
            self.fail -= 1
            raise RuntimeError("a replica died mid-load")
        self.versions = [max(v, version) for v in self.versions]
        return list(self.versions)


@contextlib.asynccontextmanager
async def syncing(gen: FakeGen):
    """A WeightSync over `gen`, for the test to publish to, stopped after it."""
    sync = WeightSync(None, gen)
    await sync.start()
    try:
        yield sync
    finally:
        await sync.stop()


def test_the_generators_load_each_new_version_and_skip_those_published_meanwhile():
    async def main():
        gen = FakeGen()
        async with syncing(gen) as sync:
            sync.publish(1)
            await sync.wait_held(1, timeout_s=5)
            sync.publish(2)
            await asyncio.sleep(0.01)  # the load of 2 is under way
            sync.publish(3)
            sync.publish(4)
            await sync.wait_held(4, timeout_s=5)
            assert gen.loads == [1, 2, 4] and gen.versions == [4, 4] and sync.held == 4
            gen.fail = 2  # a load that fails is tried again
            sync.publish(5)
            await sync.wait_held(5, timeout_s=5)
            assert gen.loads[3:] == [5, 5, 5]
            with pytest.raises(TimeoutError):
                await sync.wait_held(6, timeout_s=0.2)  # never published

    asyncio.run(main())


def test_a_hold_keeps_the_generators_on_their_version_until_released_or_run_out():
    async def main():
        gen = FakeGen()
        async with syncing(gen) as sync:
            sync.publish(1)
            async with sync.hold(1, 5.0) as held:  # waits for version 1, then holds it
                assert held == 1 and gen.versions == [1, 1]
                sync.publish(2)
                await asyncio.sleep(0.2)
                assert gen.versions == [1, 1] and gen.loads == [1]
            await sync.wait_held(2, timeout_s=5)  # released: the version waiting lands

            sync.publish(3)
            await asyncio.sleep(0.01)
            async with sync.hold(3, 5.0) as held:  # a load under way lands first
                assert held == 3

            never_released = sync.hold(3, 0.3)
            await never_released.__aenter__()
            start = time.monotonic()
            sync.publish(4)
            await sync.wait_held(4, timeout_s=5)
            assert time.monotonic() - start >= 0.25  # the hold ran out
            await never_released.__aexit__(None, None, None)

    asyncio.run(main())


def test_a_hold_is_granted_while_versions_come_faster_than_the_generators_load_them():
    """An eval's hold lands after the load under way, even when the next version is always
    published before that load ends (waiting for a gap between loads would never end)."""

    async def main():
        gen = FakeGen(load_s=0.05)
        async with syncing(gen) as sync:

            async def trainer():
                for v in itertools.count(1):
                    sync.publish(v)
                    await asyncio.sleep(0.01)

            pushing = asyncio.create_task(trainer())
            try:
                await sync.wait_held(2, timeout_s=5)
                async with asyncio.timeout(2), sync.hold(2, 5.0) as held:
                    loads = len(gen.loads)
                    await asyncio.sleep(0.2)
                    assert gen.versions == [held, held] and len(gen.loads) == loads  # nothing loads while held
            finally:
                pushing.cancel()

    asyncio.run(main())


class Recorder:
    """Rollouts that note the version the generators hold when each group starts; group `i`
    fails (raises `error`) when `fail(i)`, and is empty (masked) when `empty(i)`."""

    def __init__(self, gen: FakeGen, fail=lambda i: False, empty=lambda i: False, error=RuntimeError):
        self.gen, self.fail, self.empty, self.error = gen, fail, empty, error
        self.started: list[int] = []

    async def group(self, sample):
        i, version = len(self.started), min(self.gen.versions)
        self.started.append(version)
        await asyncio.sleep(0.01)
        if self.fail(i):
            raise self.error("rollout failed")
        if self.empty(i):
            return []
        return [Episode([1, 2], [0, 1], [0.0, 0.0], score=Score(r), policy_version=version) for r in (0.0, 1.0)]


@contextlib.asynccontextmanager
async def loops_on(gen, rollouts, max_staleness: int, groups: int = 2):
    """RolloutLoops of `rollouts` into a buffer of `groups` per step, and the WeightSync they wait on."""
    cfg = SimpleNamespace(groups_per_step=groups, rollout_tasks=5, max_rollout_failures=5, sample_timeout_s=10)
    buffer = await ReplayBuffer.options().as_actor(capacity=groups * (max_staleness + 1), max_staleness=max_staleness)
    try:
        async with syncing(gen) as sync:
            yield RolloutLoops(rollouts, itertools.count(), buffer, sync, cfg), sync
    finally:
        await buffer.shutdown()


def test_on_policy_a_batch_is_exactly_the_groups_started_for_it_on_its_weights():
    async def main():
        gen = FakeGen()
        rollouts = Recorder(gen)
        async with loops_on(gen, rollouts, max_staleness=0) as (loops, sync):
            async with loops.running(1):
                await asyncio.sleep(0.3)
                assert rollouts.started == []  # nothing starts on old weights
                sync.publish(1)
                batch = await loops.batch(1)
                assert {e.policy_version for e in batch} == {1} and len(batch) == 4
                await asyncio.sleep(0.3)
                assert rollouts.started == [1, 1]  # the batch's 2 groups, and none before version 2
                sync.publish(2)
                assert {e.policy_version for e in await loops.batch(2)} == {2}
                assert rollouts.started == [1, 1, 2, 2]
            async with loops.running(2):  # a rewind to version 2: its batch starts anew
                assert {e.policy_version for e in await loops.batch(2)} == {2}
            assert rollouts.started == [1, 1, 2, 2, 2, 2]

    asyncio.run(main())


def test_on_policy_batches_the_policy_does_not_step_on_keep_coming_on_its_weights():
    """PPO's critic warm-up on-policy: two batches the policy does not step on (it stays at
    version 0, nothing is published), each of groups started for it on version 0, then one it
    steps on; the next batch waits for version 1."""

    async def main():
        gen = FakeGen()
        rollouts = Recorder(gen)
        async with loops_on(gen, rollouts, max_staleness=0) as (loops, sync):
            async with loops.running(0):
                for _ in range(2):
                    assert {e.policy_version for e in await loops.batch(0, policy_steps=False)} == {0}
                assert len(await loops.batch(0)) == 4
                await asyncio.sleep(0.3)
                assert rollouts.started == [0] * 6  # three batches' groups, none ahead of version 1
                sync.publish(1)
                assert {e.policy_version for e in await loops.batch(1)} == {1}

    asyncio.run(main())


@pytest.mark.parametrize(
    "fail, empty, error",
    [
        (lambda i: i == 0, lambda i: False, RuntimeError),  # a failed group gives its room back: one more starts
        (lambda i: False, lambda i: i == 1, RuntimeError),  # a group the buffer did not keep (masked): room for another
        (lambda i: i == 0, lambda i: False, SystemExit),  # a rollout's SystemExit costs its group, not the run
        (lambda i: i == 0, lambda i: False, asyncio.CancelledError),  # so does a cancellation of its own
    ],
)
def test_a_group_that_is_not_kept_gives_its_room_back(fail, empty, error):
    async def main():
        gen = FakeGen()
        rollouts = Recorder(gen, fail=fail, empty=empty, error=error)
        async with loops_on(gen, rollouts, max_staleness=0) as (loops, sync):
            async with loops.running(0):
                assert len(await loops.batch(0)) == 4
                await asyncio.sleep(0.3)
            assert rollouts.started == [0, 0, 0]

    asyncio.run(main())


class Deaf:
    """Rollouts of which one swallows its cancellation (a retry loop's bare `except:`)."""

    def __init__(self):
        self.deaf, self.running = True, 0

    async def group(self, sample):
        self.running += 1
        for _ in range(20):
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                if not self.deaf:
                    raise
                self.deaf = False
        return []


def test_stopping_the_loops_does_not_wait_for_a_rollout_that_swallows_its_cancellation():
    """A Ctrl-C (or a trainer's restore) stops the loops first, then saves: a rollout that
    ignores its cancellation is abandoned, and its loop stops all the same."""

    async def main():
        gen = FakeGen()
        rollouts = Deaf()
        async with loops_on(gen, rollouts, max_staleness=0) as (loops, sync):
            await loops.start(0)
            while not rollouts.running:
                await asyncio.sleep(0.01)
            stopping = asyncio.ensure_future(loops.stop())
            done, _ = await asyncio.wait([stopping], timeout=30)
            assert done, "the loops did not stop"
            assert not rollouts.deaf  # the rollout did swallow its cancellation

    asyncio.run(main())


def test_off_policy_groups_never_start_on_weights_older_than_max_staleness_allows():
    async def main():
        gen = FakeGen()
        rollouts = Recorder(gen)
        async with loops_on(gen, rollouts, max_staleness=1) as (loops, sync):
            async with loops.running(3):  # batch 3 may use weights 2 or 3; the generators hold 0
                await asyncio.sleep(0.3)
                assert rollouts.started == []
                sync.publish(2)
                batch = await loops.batch(3)
                assert {e.policy_version for e in batch} == {2}
                assert len(rollouts.started) > 2  # off-policy: no per-batch limit

    asyncio.run(main())


def test_the_default_rollout_gives_the_generator_a_sample_s_tools():
    """A dataset row's tools (dataset.tools_key) reach the generator with its chat prompt."""
    from forge.rollout import generate_and_score
    from forge.tasks import Sample
    from forge.types import Completion

    tool = {"type": "function", "function": {"name": "calc"}}
    asked = []

    async def generate(prompt, n, tools=None):
        asked.append((prompt, n, tools))
        return [Completion([1], [2], [-0.5], "4", "stop")] * n

    async def score(inputs):
        return [Score(float(i.completion == i.task["answer"])) for i in inputs]

    gen = SimpleNamespace(generate=SimpleNamespace(route=generate))
    rewards = SimpleNamespace(score=SimpleNamespace(route=score))
    sample = Sample([{"role": "user", "content": "2+2?"}], "4", "calc", tools=[tool])
    group, scores = asyncio.run(generate_and_score(sample, gen, rewards, SimpleNamespace(group_size=2)))
    assert asked == [(sample.prompt, 2, [tool])] and [s.reward for s in scores] == [1.0, 1.0]
    # Its episodes carry their data source (a teacher's `tasks` picks them by it).
    cfg = SimpleNamespace(
        group_size=2, reward_unavailable="mask", trainer=SimpleNamespace(loss=SimpleNamespace(normalize_std=True))
    )
    episodes = asyncio.run(SingleTurn(generate_and_score, "default", gen, rewards, cfg).group(sample))
    assert [e.task for e in episodes] == ["calc", "calc"]


def test_a_group_whose_advantages_are_not_finite_fails():
    """Rewards each within float32's range whose differences are not (Dr.GRPO's reward - mean):
    the group fails (a ValueError the rollout loop counts), its infs never reach the trainer."""
    c = Completion([1], [2], [-0.1], "x", "stop")
    with pytest.raises(ValueError, match="the group's advantages are not finite"):
        make_group([c] * 4, [Score(-3e38), Score(3e38), Score(3e38), Score(1.0)], std_normalize=False)
    assert [e.advantage for e in make_group([c] * 2, [Score(1.0), Score(0.0)])] == pytest.approx([1, -1], abs=1e-5)


def test_a_sample_whose_reward_failed_never_ranks_above_one_scored():
    """A reward model's scores are logits, all below 0 here; a completion made too long for it
    fails its reward (scored 0, marked). It must not be its group's best: it ranks with the
    lowest of the others, and a group of [0, 1] rewards ranks as it did."""
    c = Completion([1], [2], [-0.1], "x", "stop")
    scores = [Score(-0.3), Score(-0.1), Score(0.0, error="reward_model: ValueError: longer than its context")]
    advantages = [e.advantage for e in make_group([c] * 3, scores)]
    assert advantages[2] == pytest.approx(min(advantages)) and advantages[1] == max(advantages), advantages
    bounded = [Score(1.0), Score(0.5), Score(0.0, error="math: ValueError")]
    plain = [Score(1.0), Score(0.5), Score(0.0)]
    assert [e.advantage for e in make_group([c] * 3, bounded)] == [e.advantage for e in make_group([c] * 3, plain)]


class NumberedPrompts(IndexedPrompts):
    def sample(self, i):
        return Sample(prompt=str(i), answer="", task="t")


class SlowGroups:
    version = 0

    async def group(self, sample):
        await asyncio.sleep(0.05)  # generation, where a group spends its time
        return [
            Episode([1, 2], [0, 1], [0.0, 0.0], score=Score(r), policy_version=self.version, task=sample.prompt)
            for r in (0.0, 1.0)
        ]


class HeldWeights:
    async def wait_held(self, version):
        return None


def test_a_resumed_run_draws_first_the_prompts_in_flight_when_it_stopped():
    """The checkpoint's data position counts every prompt drawn, its buffer only the groups that
    landed: the groups in flight (one per loop) were in neither, and a resumed run never trained
    them. The prompts part holds them, and a resumed run draws them first."""

    async def main():
        cfg = SimpleNamespace(groups_per_step=2, rollout_tasks=4, max_rollout_failures=5, sample_timeout_s=10)
        buffer = await ReplayBuffer.options().as_actor(capacity=4, max_staleness=1)
        seen, rollouts = [], SlowGroups()
        try:
            loops = RolloutLoops(rollouts, NumberedPrompts(), buffer, HeldWeights(), cfg)
            loops.prompts.prompts.reset()
            async with loops.running(0):
                for v in range(3):
                    seen += [e.task for e in await loops.batch(v)][::2]
                    await buffer.notify_version.call_one(v + 1)
                    rollouts.version = v + 1
                await asyncio.sleep(0.02)  # groups under way
            saved = loops.prompts.state_dict()  # as Run.save, after a Ctrl-C stopped the loops
            seen += [g[0].task for g in (await buffer.state_dict.call_one())["groups"]]
        finally:
            await buffer.shutdown()
        resumed = RolloutLoops(rollouts, NumberedPrompts(), None, None, cfg).prompts
        resumed.load_state_dict(saved)
        seen += [resumed.draw()[1].prompt for _ in saved["in_flight"]]
        assert saved["in_flight"] and sorted(map(int, seen)) == list(range(saved["stream"]["index"]))
        assert resumed.draw()[1].prompt == str(saved["stream"]["index"])  # then the stream goes on

    asyncio.run(main())


def test_prompts_in_flight_from_a_source_removed_for_the_resume_are_dropped():
    """A mixture's prompts in flight at the checkpoint, from a source the resumed run's
    `dataset.mix` no longer lists, are not drawn (the source was removed); the others are."""
    from forge.data import TaskPrompts
    from forge.mixture import Mixture
    from forge.schema import MixSource

    def mixture(names):
        sources = {n: MixSource(task=n) for n in names}
        return Mixture({n: TaskPrompts(n) for n in names}, dict.fromkeys(names, 1.0), sources=sources)

    old = DrawnPrompts(mixture(["reverse", "sort"]))
    old.prompts.reset()
    drawn = [old.draw()[1] for _ in range(12)]
    assert {s.task for s in drawn} == {"reverse", "sort"}
    resumed = DrawnPrompts(mixture(["reverse"]))
    resumed.load_state_dict(old.state_dict())
    kept = [s for s in drawn if s.task == "reverse"]
    assert [resumed.draw()[1] for _ in kept] == kept and resumed.replay == []


@pytest.mark.parametrize("scores", [None, Score(1.0)])
def test_a_rollout_whose_scores_are_not_a_list_breaks_its_contract(scores):
    """Not a list of scores (None, one Score): the run stops at once, naming the rollout, as
    for any other broken contract (not a TypeError counted as a rollout that failed)."""
    from forge.rollout import RolloutError, check_rollout

    c = Completion([1], [2], [-0.1], "x", "stop")
    with pytest.raises(RolloutError, match=r"rollout 'm:f' returned a list and a (NoneType|Score)"):
        check_rollout(([c], scores), "rollout 'm:f'")
