"""Actors for the service tests; a module of its own so Monarch children can import it."""

import asyncio
import os

from monarch.actor import current_rank, endpoint

from forge.actor import ForgeActor


class Probe(ForgeActor):
    def __init__(self, tag: str = "probe"):
        self.tag = tag
        self.respawned = False

    @endpoint
    async def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def echo(self, x):
        return (self.tag, x)

    @endpoint
    async def nap(self, seconds: float) -> int:
        await asyncio.sleep(seconds)
        return os.getpid()

    @endpoint
    async def hang_on(self, pid: int) -> int:
        """Never returns in process `pid` (a hung engine); elsewhere returns at once."""
        if os.getpid() == pid:
            await asyncio.Event().wait()
        return os.getpid()

    @endpoint
    async def boom(self, msg: str) -> None:
        raise ValueError(msg)

    @endpoint
    async def rank(self) -> int:
        return current_rank().rank

    @endpoint
    async def on_respawn(self, restore_point=None) -> None:
        self.respawned = True

    @endpoint
    async def was_respawned(self) -> bool:
        return self.respawned


class Recorder(ForgeActor):
    @endpoint
    async def record(self, key: str, values_by_rank: list[list[float]], reduce: str) -> None:
        from forge.metrics import record_metric

        for v in values_by_rank[current_rank().rank]:
            record_metric(key, v, reduce)

    @endpoint
    async def host(self) -> tuple[int, int]:
        """(pid, parent pid): procs on different Monarch hosts have different parents."""
        return os.getpid(), os.getppid()


class Counter(ForgeActor):
    """Stateful: a count that only a checkpoint file (the restore point) brings back."""

    stateful = True

    def __init__(self):
        self.count = 0

    @endpoint
    async def add(self, n: int) -> int:
        self.count += n
        return self.count

    @endpoint
    async def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(str(self.count))

    @endpoint
    async def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def on_respawn(self, restore_point=None) -> None:
        with open(restore_point) as f:
            self.count = int(f.read())


class Flaky(ForgeActor):
    """A role whose new replicas fail to start while the file `marker` exists."""

    def __init__(self, marker: str):
        if os.path.exists(marker):
            raise RuntimeError(f"cannot start: {marker} exists")

    @endpoint
    async def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def nap(self, seconds: float) -> int:
        await asyncio.sleep(seconds)
        return os.getpid()


class Relay(ForgeActor):
    """Calls another actor: its death is the call's error, not this replica's."""

    @endpoint
    async def relay(self, other) -> int:
        return await other.pid.call_one()

    @endpoint
    async def pid(self) -> int:
        return os.getpid()


class Noisy(ForgeActor):
    """Writes as a library does (stdout, fd 2, a library's logger) and as forge does (its logger)."""

    @endpoint
    async def speak(self) -> int:
        import logging

        print("library chatter on stdout", flush=True)
        os.write(2, b"C++ chatter on fd 2\n")
        logging.getLogger("vllm").warning("a vllm warning")
        logging.getLogger("forge").warning("forge: a reward failed in the actor")
        return os.getpid()


class Crashing(ForgeActor):
    """Starts a process that dies of a native fault (as vLLM's engine core can), like its own."""

    @endpoint
    async def start_one(self) -> tuple[int, bool]:
        import faulthandler
        import subprocess
        import sys

        subprocess.run([sys.executable, "-c", "import ctypes; ctypes.string_at(0)"], check=False)
        return os.getpid(), faulthandler.is_enabled()


class Stand(ForgeActor):
    """Stands in for any role (takes its constructor's arguments, does nothing)."""

    def __init__(self, *args, **kwargs):
        pass

    @endpoint
    async def pid(self) -> int:
        return os.getpid()


class Unready(Stand):
    """A role whose setup fails (e.g. a reward's missing verifier)."""

    @endpoint
    async def setup(self) -> None:
        raise RuntimeError("cannot start: no verifier")
