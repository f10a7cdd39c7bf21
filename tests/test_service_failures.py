"""Services under failure: the only replica respawning, a respawn that fails (or never comes
up), a dependency that dies, a session whose replica dies, a call made while a stateful replica
restores. Each of these once failed calls that could succeed, or respawned a healthy replica
(or, the last ones, stalled a call or ran it on a state its caller did not know of)."""

import asyncio
import itertools
import os
import re
import signal
import time
from types import SimpleNamespace

import pytest
from service_actors import Flaky, Probe, Relay

from forge.service import DependencyError


async def killed(svc) -> asyncio.Future:
    """SIGKILL `svc`'s replica; returns the call that sees its death (the restore starts), once
    the service no longer counts it healthy."""
    os.kill(await svc.pid.route(), signal.SIGKILL)
    first = asyncio.ensure_future(svc.add.route(1))
    deadline = time.monotonic() + 120  # a guard against a hang: a loaded machine takes its time
    while svc.healthy():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    return first


def test_calls_wait_for_the_only_replica_while_it_respawns():
    """With one replica (a generator's default), calls made while it respawns wait for the
    new one instead of failing at once (which stopped runs after max_rollout_failures)."""

    async def main():
        svc = await Probe.options().as_service("p")
        try:
            victim = await svc.pid.route()
            os.kill(victim, signal.SIGKILL)
            first = asyncio.ensure_future(svc.echo.route(0))  # sees the death, starts the respawn
            deadline = time.monotonic() + 120  # a guard against a hang: a loaded machine takes its time
            while svc.healthy():  # until the death is seen: then it is respawning
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            during = await asyncio.gather(*(svc.echo.route(i) for i in range(1, 5)))
            return await first, during, await svc.pid.route(), victim
        finally:
            await svc.shutdown()

    first, during, pid, victim = asyncio.run(main())
    assert first == ("p", 0) and during == [("p", i) for i in range(1, 5)] and pid != victim


def test_a_failed_respawn_is_tried_again_and_a_retried_call_stays_succeeded(tmp_path):
    """A replica whose respawn fails is respawned again, backing off; the call that saw it
    die succeeded on the other replica, and keeps that result."""
    marker = tmp_path / "broken"

    async def main():
        svc = await Flaky.options(replicas=2).as_service(str(marker))
        try:
            pids = sorted(await svc.pid.fanout())
            marker.touch()  # from now on a new replica fails to start
            calls = [asyncio.ensure_future(svc.nap.route(1.0)) for _ in range(2)]  # one on each
            await asyncio.sleep(0.3)
            os.kill(pids[0], signal.SIGKILL)
            deadline = time.monotonic() + 60
            while max(r.respawns for r in svc.replicas) < 2:  # the first respawn has failed
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            marker.unlink()
            results = await asyncio.gather(*calls)
            await svc.wait_healthy(timeout=60)
            return pids, results, sorted(await svc.pid.fanout()), [r.respawns for r in svc.replicas]
        finally:
            await svc.shutdown()

    pids, results, after, respawns = asyncio.run(main())
    assert all(p == pids[1] for p in results[1:]) and len(results) == 2 and pids[1] in results
    assert len(after) == 2 and pids[0] not in after and pids[1] in after
    assert max(respawns) >= 2  # the failed attempt, then the one that came up


def test_a_dependency_that_died_is_the_calls_error_not_the_replicas():
    async def main():
        probe = await Probe.options().as_actor("p")
        svc = await Relay.options().as_service()
        try:
            os.kill(await probe.pid.call_one(), signal.SIGKILL)
            await asyncio.sleep(0.5)
            pid = await svc.pid.route()
            with pytest.raises(DependencyError, match="Relay.relay: an actor it called died"):
                await svc.relay.route(probe.mesh)
            return pid, await svc.pid.route(), svc.replicas[0].respawns
        finally:
            await svc.shutdown()
            await probe.shutdown()

    before, after, respawns = asyncio.run(main())
    assert before == after and respawns == 0


def test_a_session_moves_to_the_replica_that_served_its_retried_call():
    async def main():
        svc = await Probe.options(replicas=2).as_service("p")
        try:
            session = svc.pinned()
            home = await session.pid.route()
            os.kill(home, signal.SIGKILL)
            moved = await session.pid.route()  # retried on the other replica
            await svc.wait_healthy(timeout=60)
            deadline = time.monotonic() + 5
            later = [await session.pid.route() for _ in range(3)]
            assert time.monotonic() < deadline
            return home, moved, later
        finally:
            await svc.shutdown()

    home, moved, later = asyncio.run(main())
    assert moved != home and later == [moved] * 3


def test_a_call_made_while_a_stateful_replica_restores_is_told_so(tmp_path):
    """A call to a stateful role made while its dead replica restores does not run on the
    restored state as if nothing happened: like the call that saw the death, it raises
    ReplicaRestored (its caller's state is ahead of the restore point too)."""
    from service_actors import Counter

    from forge.service import ReplicaRestored

    async def main():
        svc = await Counter.options(max_restores=3).as_service()
        try:
            await svc.add.route(7)
            await svc.save.route(str(tmp_path / "ckpt"))
            svc.set_restore_point(str(tmp_path / "ckpt"))
            await svc.add.route(100)  # lost with the replica
            first = await killed(svc)
            during = await asyncio.gather(svc.add.route(10), return_exceptions=True)
            return await asyncio.gather(first, return_exceptions=True), during, await svc.add.route(1)
        finally:
            await svc.shutdown()

    first, during, after = asyncio.run(main())
    assert isinstance(first[0], ReplicaRestored)
    assert isinstance(during[0], ReplicaRestored), during
    assert during[0].restore_point == str(tmp_path / "ckpt") and "seen by an earlier call" in str(during[0])
    assert after == 8  # the checkpoint's 7: neither call ran on the restored state


def test_a_retried_call_returns_while_the_dead_replica_respawns(tmp_path):
    """A call retried on the other replica returns with its result: it does not wait for the
    dead replica's respawn (here one that keeps failing), which goes on without it."""
    marker = tmp_path / "broken"

    async def main():
        svc = await Flaky.options(replicas=2).as_service(str(marker))
        try:
            pids = await svc.pid.fanout()
            marker.touch()  # the dead replica's respawns fail (e.g. its GPU memory not yet freed)
            calls = [asyncio.ensure_future(svc.nap.route(0.5)) for _ in range(2)]  # one on each
            await asyncio.sleep(0.2)
            os.kill(pids[0], signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*calls), 120)  # respawn_wait_s: 300
            respawning = not svc.replicas[0].healthy
            marker.unlink()
            return pids, results, respawning, await svc.wait_healthy(timeout=60)
        finally:
            await svc.shutdown()

    pids, results, respawning, healthy = asyncio.run(main())
    assert results == [pids[1], pids[1]] and respawning and healthy == 2


def test_a_replica_that_cannot_be_respawned_is_lost_with_its_error(tmp_path, monkeypatch):
    """Respawns that keep failing stop after RESPAWN_ATTEMPTS; the call waiting for the
    replica then fails at once, naming its endpoint and why the replica cannot come back."""
    from forge import service
    from forge.service import ServiceError

    monkeypatch.setattr(service, "RESPAWN_ATTEMPTS", 2, raising=False)
    marker = tmp_path / "broken"

    async def main():
        svc = await Flaky.options(respawn_wait_s=120.0).as_service(str(marker))  # an option, as documented
        try:
            pid = await svc.pid.route()
            marker.touch()
            os.kill(pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(ServiceError) as e:
                await svc.nap.route(0.1)
            return str(e.value), time.monotonic() - start, svc.replicas[0].respawned.done()
        finally:
            await svc.shutdown()

    message, took, gave_up = asyncio.run(main())
    assert message.startswith("Flaky.nap: no healthy replica; replica 0 could not be respawned (")
    assert f"RuntimeError: cannot start: {marker} exists; 2 of 2 attempts)" in message
    assert gave_up and took < 100  # not respawn_wait_s


def test_waiting_for_health_in_vain_does_not_cancel_a_restore(tmp_path):
    """`wait_healthy` that times out leaves the respawn it waited for running: the call that
    saw a stateful replica die still gets ReplicaRestored, not a CancelledError."""
    from service_actors import Counter

    from forge.service import ReplicaRestored

    async def main():
        svc = await Counter.options().as_service()
        try:
            await svc.add.route(7)
            await svc.save.route(str(tmp_path / "ckpt"))
            svc.set_restore_point(str(tmp_path / "ckpt"))
            first = await killed(svc)
            with pytest.raises(TimeoutError):
                await svc.wait_healthy(timeout=0.01)
            return await asyncio.gather(first, return_exceptions=True), await svc.add.route(1)
        finally:
            await svc.shutdown()

    first, after = asyncio.run(main())
    assert isinstance(first[0], ReplicaRestored), first
    assert after == 8


def test_a_fanout_made_while_every_replica_respawns_is_not_empty(tmp_path):
    """A fanout while the only replica respawns waits for it, as a route does; to a stateful
    role it raises ReplicaRestored, as a route does: an empty list would be a checkpoint saved
    without the trainer's state."""
    from service_actors import Counter

    from forge.service import ReplicaRestored

    async def respawning(svc, call):
        os.kill(await svc.pid.route(), signal.SIGKILL)
        first = asyncio.ensure_future(call())  # sees the death: the respawn starts
        deadline = time.monotonic() + 120  # a guard against a hang: a loaded machine takes its time
        while svc.healthy():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        return first

    async def main():
        probe = await Probe.options().as_service("p")
        counter = await Counter.options().as_service()
        try:
            first = await respawning(probe, probe.pid.route)
            pids = await probe.pid.fanout()
            assert pids == [await first]
            await counter.save.route(str(tmp_path / "ckpt"))
            counter.set_restore_point(str(tmp_path / "ckpt"))
            first = await respawning(counter, lambda: counter.add.route(1))
            saved = await asyncio.gather(counter.save.fanout(str(tmp_path / "later")), return_exceptions=True)
            assert isinstance(saved[0], ReplicaRestored), saved
            await asyncio.gather(first, return_exceptions=True)
        finally:
            await probe.shutdown()
            await counter.shutdown()

    asyncio.run(main())


def test_a_run_stalled_by_a_hung_replica_says_which_calls_it_waits_for():
    """A replica whose endpoint never returns (a hung engine, not a dead process) stalls the
    rollouts without any failing: the error that stops the run names the role, endpoint and
    replica with calls outstanding and the age of the oldest, not "none failed" alone."""
    from forge.buffer import ReplayBuffer
    from forge.rollout import RolloutLoops, RolloutsStopped
    from forge.types import Episode, Score

    class Held:
        async def wait_held(self, version):
            return None

    async def main():
        svc = await Probe.options(replicas=2, router="round_robin").as_service("p")
        buffer = await ReplayBuffer.options().as_actor(capacity=8, max_staleness=0)
        try:
            hung = (await svc.pid.fanout())[1]  # replica 1's process

            class Rollouts:
                async def group(self, sample):
                    await svc.hang_on.route(hung)  # every other call lands on replica 1 and stays
                    return [Episode([1, 2], [0, 1], [0.0, 0.0], score=Score(r)) for r in (0.0, 1.0)]

            cfg = SimpleNamespace(groups_per_step=8, rollout_tasks=2, max_rollout_failures=5, sample_timeout_s=3)
            loops = RolloutLoops(Rollouts(), itertools.count(), buffer, Held(), cfg)
            async with loops.running(0):
                with pytest.raises(RolloutsStopped) as e:
                    await loops.batch(0)
            return str(e.value)
        finally:
            await buffer.shutdown()
            await svc.shutdown()

    message = asyncio.run(main())
    assert "rollouts last failed with: nothing (none failed)" in message
    assert re.search(r"calls outstanding: Probe\.hang_on on replica 1 for [\d.]+ s \(the oldest of 2\)$", message)


def test_a_call_outstanding_at_shutdown_says_the_service_shut_down():
    """Shutting a service down under a call that hangs returns, and the call fails saying so: it
    is not retried on a replica that was stopped, as if two replicas had died under it."""
    from forge.service import ServiceError

    async def main():
        svc = await Probe.options().as_service("p")
        call = asyncio.ensure_future(svc.hang_on.route(await svc.pid.route()))
        await asyncio.sleep(0.5)
        await svc.shutdown()
        return await asyncio.gather(call, return_exceptions=True)

    (error,) = asyncio.run(main())
    assert isinstance(error, ServiceError) and str(error) == "Probe.hang_on: the service was shut down during the call"
