import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import psutil
import pytest
from conftest import alive
from roles import running
from service_actors import Probe


def run(coro):
    return asyncio.run(coro)


def test_least_loaded_prefers_idle_replica_and_fanout():
    async def main():
        svc = await Probe.options(replicas=2).as_service("p")
        try:
            pids = set(await svc.pid.fanout())
            assert len(pids) == 2
            busy = asyncio.ensure_future(svc.nap.route(1.5))
            await asyncio.sleep(0.3)  # the nap is in flight on one replica
            quick = [await svc.pid.route() for _ in range(6)]
            busy_pid = await busy
            assert busy_pid not in quick and len(set(quick)) == 1
        finally:
            await svc.shutdown()

    run(main())


def test_round_robin_is_even_and_sessions_stick():
    async def main():
        svc = await Probe.options(replicas=2, router="round_robin").as_service("p")
        try:
            counts = Counter([await svc.pid.route() for _ in range(10)])
            assert sorted(counts.values()) == [5, 5]
            for _ in range(2):
                async with svc.session() as s:
                    assert len({await s.pid.route() for _ in range(8)}) == 1
        finally:
            await svc.shutdown()

    run(main())


def test_endpoint_exception_is_the_callers_error():
    async def main():
        svc = await Probe.options(replicas=1).as_service("p")
        try:
            pid = await svc.pid.route()
            with pytest.raises(ValueError, match="bad input 42"):
                await svc.boom.route("bad input 42")
            assert await svc.pid.route() == pid  # same replica, still serving
            assert len(svc.healthy()) == 1
            with pytest.raises(AttributeError, match="no endpoint 'nope'"):
                _ = svc.nope
        finally:
            await svc.shutdown()

    run(main())


def test_multi_proc_replica_rank0_and_all_ranks():
    async def main():
        svc = await Probe.options(procs=2, replicas=1).as_service("p")
        actor = await Probe.options(procs=2).as_actor("a")
        try:
            assert await svc.rank.route() == 0
            assert await svc.rank.call() == [0, 1]
            assert sorted(v for _, v in (await actor.rank.call()).items()) == [0, 1]
        finally:
            await svc.shutdown()
            await actor.shutdown()

    run(main())


def test_sigkill_one_replica_during_100_calls():
    async def main():
        svc = await Probe.options(replicas=2).as_service("p")
        try:
            before = set(await svc.pid.fanout())
            victim = sorted(before)[0]
            calls = [asyncio.ensure_future(svc.nap.route(0.05)) for _ in range(100)]
            await asyncio.sleep(0.5)
            os.kill(victim, signal.SIGKILL)
            results = await asyncio.gather(*calls)
            assert len(results) == 100 and all(isinstance(p, int) for p in results)
            assert await svc.wait_healthy() == 2
            after = set(await svc.pid.fanout())
            assert victim not in after and len(after) == 2
            assert sum(await svc.was_respawned.fanout()) == 1
            assert sum(r.respawns for r in svc.replicas) == 1
        finally:
            await svc.shutdown()

    run(main())


def test_shutdown_leaves_no_processes():
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}

    async def main():
        svc = await Probe.options(procs=2, replicas=2).as_service("p")
        pids = await svc.pid.fanout()
        await svc.shutdown()
        return pids

    pids = run(main())
    for _ in range(50):  # processes may take a moment to exit after stop()
        if not any(alive(p) for p in pids):
            break
        time.sleep(0.2)
    assert not any(alive(p) for p in pids)
    new = {p.pid for p in me.children(recursive=True)} - before
    assert not [p for p in new if alive(p)]


REPL_SCRIPT = """
from service_actors import Probe
svc = Probe.options(replicas=2).as_service("repl").get()
print("ECHO", svc.echo.route(21).get())
print("FANOUT", len(svc.pid.fanout().get()))
svc.shutdown().get()
print("DONE")
"""


def test_repl_drives_a_service_synchronously():
    r = subprocess.run([sys.executable, "-i", "-q"], input=REPL_SCRIPT, capture_output=True, text=True, timeout=180)
    assert "ECHO ('repl', 21)" in r.stdout, r.stderr[-2000:]
    assert "FANOUT 2" in r.stdout and "DONE" in r.stdout


REPL_RESPAWN_SCRIPT = """
import os, signal
from service_actors import Probe
svc = Probe.options(replicas=2).as_service("repl").get()
victim = svc.pid.route().get()
os.kill(victim, signal.SIGKILL)
print("RETRIED", svc.echo.fanout(1).get())
pids = svc.pid.fanout().get()
print("BACK", len(pids), victim in pids)
svc.shutdown().get()
print("DONE")
"""


def test_repl_sees_a_respawn_through():
    """A REPL's .get() cancels the tasks left on its loop when its call returns, the dead
    replica's respawn among them: the next call starts it again and waits for it."""
    r = subprocess.run(
        [sys.executable, "-i", "-q"], input=REPL_RESPAWN_SCRIPT, capture_output=True, text=True, timeout=180
    )
    assert "RETRIED [('repl', 1), ('repl', 1)]" in r.stdout, r.stderr[-2000:]
    assert "BACK 2 False" in r.stdout and "DONE" in r.stdout, r.stdout + r.stderr[-2000:]


def test_two_host_process_job_placement():
    """`hosts=` takes a Monarch host mesh; `procs` is per host. ProcessJob runs each "host"
    as a local worker process, the way a SLURM/Kubernetes job would give real hosts."""
    from monarch.job import ProcessJob

    job = ProcessJob({"hosts": 2})
    hosts = job.state(cached_path=None).hosts

    async def main():
        actor = await Probe.options(procs=2, hosts=hosts).as_actor("a")
        svc = await Probe.options(replicas=2, hosts=hosts).as_service("s")
        spread = await Probe.options(replicas=4, hosts=hosts, spread=True).as_service("p")
        try:
            pids = [v for _, v in (await actor.pid.call()).items()]
            parents = [psutil.Process(p).ppid() for p in pids]
            assert len(set(pids)) == 4 and len(set(parents)) == 2  # 2 procs on each of 2 hosts
            assert [p for p in parents].count(parents[0]) == 2
            assert len(set(await svc.pid.fanout())) == 2
            assert await svc.echo.route(1) == ("s", 1)
            # spread: each replica on one host, in turn (each of the others spans both hosts)
            assert len(await spread.pid.call()) == 1 and len(await svc.pid.call()) == 2
            spread_parents = [psutil.Process(p).ppid() for p in await spread.pid.fanout()]
            assert spread_parents[:2] == spread_parents[2:] and len(set(spread_parents)) == 2
        finally:
            await actor.shutdown()
            await svc.shutdown()
            await spread.shutdown()
        return pids + parents

    try:
        pids = run(main())  # the actors' processes and the 2 host workers
    finally:
        job.kill()
    for _ in range(50):
        if not any(alive(p) for p in pids):
            break
        time.sleep(0.2)
    assert not any(alive(p) for p in pids)


def test_stateful_replica_is_restored_from_its_restore_point_or_stops_the_run(tmp_path):
    """A stateful role is never silently reset: without a restore point its death is a
    ServiceError naming it; with one, a new replica restores that state and the call that saw
    the death raises ReplicaRestored (not retried); past max_restores it is a ServiceError."""
    from service_actors import Counter

    from forge.service import ReplicaRestored, ServiceError

    async def kill_and_call(svc, n):
        os.kill(await svc.pid.route(), signal.SIGKILL)
        return await svc.add.route(n)

    async def main():
        svc = await Counter.options(max_restores=1).as_service()
        try:
            assert await svc.add.route(5) == 5
            with pytest.raises(ServiceError, match="Counter replica 0 died .* no checkpoint has saved yet"):
                await kill_and_call(svc, 1)
            with pytest.raises(ServiceError, match="no checkpoint has saved yet"):
                await svc.add.route(1)  # and it stays dead: the run must stop
        finally:
            await svc.shutdown()

        svc = await Counter.options(max_restores=1).as_service()
        try:
            await svc.add.route(7)
            await svc.save.route(str(tmp_path / "ckpt"))
            svc.set_restore_point(str(tmp_path / "ckpt"))
            await svc.add.route(100)  # lost with the replica
            with pytest.raises(ReplicaRestored) as e:
                await kill_and_call(svc, 1)
            assert e.value.restore_point == str(tmp_path / "ckpt") and "Killed" in str(e.value)
            assert await svc.add.route(1) == 8  # the checkpoint's 7, not 0 and not 107
            with pytest.raises(
                ServiceError, match=r"after 1 restores \(max_restores\); its last restore point is .*ckpt"
            ):
                await kill_and_call(svc, 1)
        finally:
            await svc.shutdown()

    run(main())


def test_a_spawn_that_fails_before_setup_stops_its_procs():
    """A constructor argument that cannot be sent to the procs fails the spawn itself (before
    the actor exists): the procs already spawned for it are stopped, not left running."""
    import threading

    async def main():
        with pytest.raises(Exception, match="pickle"):
            await Probe.options(replicas=2).as_service(threading.Lock())

    run(main())
    time.sleep(3)  # leaked procs come up in the background: give them the time to
    deadline = time.monotonic() + 10  # and stopped ones a moment to exit
    while running(psutil.Process(), ("probe",)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not running(psutil.Process(), ("probe",))
