"""Service: N replicas of a ForgeActor (each its own proc mesh) behind one handle.

    await svc.ep.route(x)        one replica (least-loaded, or round-robin)
    await svc.ep.fanout(x)       every healthy replica, a list of results
    await svc.ep.call(x)         one replica, every rank's result
    async with svc.session() as s: await s.ep.route(x)   # sticky: always the same replica

Every call returns a Monarch Future: `await` it, or `.get()` it from a REPL. An exception
raised by an endpoint reaches the caller as itself. A replica whose process dies is taken
out of rotation and respawned with the same constructor arguments, then told
`on_respawn(restore_point)`; a respawn that fails is tried again, backing off, up to
RESPAWN_ATTEMPTS times (then the replica is lost, and a call that finds no other names the
respawn's error). For most roles the calls that were on it are retried once on a healthy replica
(the only replica's calls wait for its replacement, up to `respawn_wait_s`; so do new calls
meanwhile); a role with `retried = False` (the agent pool: an episode must not run twice)
raises ServiceError for them instead. `replace(replica, ...)` respawns a replica that lives
but is of no more use (its event loop answers nothing). A `stateful` role's calls are not
retried: its new replica restores the state saved at the service's restore point
(`svc.set_restore_point(p)`, e.g. after each checkpoint) and the callers, those that were on
it and those made while it restores, get `ReplicaRestored(p)` to rewind their own state to the
same point; with no restore point, or after `max_restores`, they get a ServiceError that names
the dead role and the point to resume from.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, NoReturn

# Monarch exports no public name for the error a call to a dead actor raises; this is its one import.
from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
from monarch.actor import ActorError, ProcMesh, returns_future

from forge.actor import SpawnOptions, stop_procs
from forge.metrics import Reduce, record_metric

log = logging.getLogger("forge")
ROUTERS = ("least_loaded", "round_robin")
RESPAWN_ATTEMPTS = 10  # a non-stateful replica's, backing off 1 s to 60 s: about 4 min, then it is lost
_services: weakref.WeakSet[Service] = weakref.WeakSet()  # this process's, for `outstanding()`


def outstanding(limit: int = 4) -> str:
    """The calls this process's services wait for, the replicas with the oldest first, in words
    ("none"): a replica that hangs (its process alive, a call never returning) shows here alone."""
    found = sorted((c for svc in list(_services) for c in svc.outstanding()), reverse=True)
    return "; ".join(text for _, text in found[:limit]) or "none"


def last_line(error: BaseException | str) -> str:
    """The last line of an error's text: Monarch's (a traceback of the actor) says how it died."""
    text = str(error).strip()
    return text.splitlines()[-1].strip() if text else ""


class ServiceError(RuntimeError):
    """No healthy replica could serve a call, or a stateful replica could not be restored."""


class DependencyError(RuntimeError):
    """An endpoint failed because an actor it called died: an error of this call, not the
    death of the replica that served it."""


class ReplicaRestored(RuntimeError):
    """A stateful replica died during the call and a new one restored the state saved at
    `restore_point`; the call was not retried. Rewind the caller's state to that point."""

    def __init__(self, role: str, restore_point: Any, cause: str, seconds: float):
        super().__init__(f"{role} died ({cause}); a new replica restored {restore_point} in {seconds:.1f} s")
        self.role, self.restore_point, self.seconds = role, restore_point, seconds


@dataclass
class Replica:
    index: int
    procs: ProcMesh
    mesh: Any
    calls: list[tuple[float, str]] = field(default_factory=list)  # (start, endpoint) of each call on it
    healthy: bool = True
    respawns: int = 0
    # Set while a respawn is under way; done: it gave up (cancelled: its loop stopped, see `_revive`).
    respawned: asyncio.Future | None = None
    error: str | None = None  # why its last respawn failed


class Service:
    """N replicas of a ForgeActor behind one handle (`Actor.options(replicas=N).as_service(...)`
    makes one): each endpoint is an attribute with `route` (one replica), `fanout` (every
    healthy replica) and `call` (one replica, every rank); `session()` pins calls to one
    replica; dead replicas are respawned (the module's docstring has the contract)."""

    def __init__(self, options: SpawnOptions, args: tuple, kwargs: dict):
        if options.router not in ROUTERS:
            raise ValueError(f"unknown router {options.router!r}; known: {', '.join(ROUTERS)}")
        self.options, self.args, self.kwargs = options, args, kwargs
        self.replicas: list[Replica] = []
        self._rr = itertools.count()
        self._closed = False
        self.restore_point: Any = None
        self._lost: str | None = None  # why a stateful replica is gone for good
        _services.add(self)

    def set_restore_point(self, point: Any) -> None:
        """Where a respawned replica restores its state from (`on_respawn(point)`), e.g. the
        newest checkpoint; stateful roles cannot be recovered before one is set."""
        self.restore_point = point

    async def start(self) -> None:
        spawned = await asyncio.gather(
            *(self.options.for_replica(i).spawn_mesh(*self.args, **self.kwargs) for i in range(self.options.replicas)),
            return_exceptions=True,
        )
        self.replicas = [Replica(i, *s) for i, s in enumerate(spawned) if not isinstance(s, BaseException)]
        errors = [s for s in spawned if isinstance(s, BaseException)]
        if errors:
            await self.shutdown()
            raise errors[0]

    # ---- routing -------------------------------------------------------------------

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy]

    def _pick(self, exclude: Replica | None = None, name: str = "") -> Replica:
        choices = [r for r in self.healthy() if r is not exclude] or self.healthy()
        if not choices:
            raise ServiceError(self._lost or self._unavailable(name))
        turn = next(self._rr)
        if self.options.router == "round_robin":
            return choices[turn % len(choices)]
        least = min(len(r.calls) for r in choices)
        idle = [r for r in choices if len(r.calls) == least]
        return idle[turn % len(idle)]  # ties rotate, so equal load spreads evenly

    def _unavailable(self, name: str) -> str:
        """Why no replica serves endpoint `name`: with the error of each failed respawn."""
        why = [f"replica {r.index} could not be respawned ({r.error})" for r in self.replicas if r.error]
        role = f"{self.options.actor.__name__}.{name}" if name else self.options.actor.__name__
        return "; ".join([f"{role}: no healthy replica", *why])

    async def _ready(self, exclude: Replica | None = None, name: str = "") -> Replica:
        """A healthy replica (see `_pick`); while none is but some are respawning, wait for
        one, up to `respawn_wait_s`. A stateful role's caller is told of the restore instead:
        its state went with the dead replica, as the state of the calls that were on it did."""
        restoring = [r for r in self.replicas if r.respawned is not None and not r.respawned.done()]
        if self.options.actor.stateful and restoring and not self.healthy():
            await self._restore(restoring[0], "seen by an earlier call")
        deadline = time.monotonic() + self.options.respawn_wait_s
        while not self.healthy() and not self._lost and not self._closed:
            pending = [r.respawned for r in self.replicas if r.respawned is not None and not r.respawned.done()]
            if not pending or time.monotonic() >= deadline:
                break
            await asyncio.wait(pending, timeout=deadline - time.monotonic())
        return self._pick(exclude, name)

    def outstanding(self) -> list[tuple[float, str]]:
        """(age, in words) of the oldest call not yet returned of each replica with one."""
        now, role, found = time.monotonic(), self.options.actor.__name__, []
        for r in self.replicas:
            if r.calls:
                start, name = r.calls[0]  # appended as they start: the first is the oldest
                age = now - start
                found.append(
                    (age, f"{role}.{name} on replica {r.index} for {age:.1f} s (the oldest of {len(r.calls)})")
                )
        return found

    async def _invoke(self, r: Replica, name: str, args: tuple, kwargs: dict, all_ranks: bool) -> Any:
        call = (time.monotonic(), name)
        r.calls.append(call)
        try:
            values = await getattr(r.mesh, name).call(*args, **kwargs)
        except ActorError as e:
            # An endpoint that raised: the caller gets that exception, the replica lives on.
            if isinstance(e.exception, SupervisionError):
                raise DependencyError(
                    f"{self.options.actor.__name__}.{name}: an actor it called died: {e.exception}"
                ) from None
            raise e.exception from None
        finally:
            r.calls.remove(call)
        ranked = [v for _, v in values.items()]
        return ranked if all_ranks else ranked[0]

    async def _call(
        self,
        name: str,
        args: tuple,
        kwargs: dict,
        *,
        replica: Replica | None = None,
        all_ranks: bool = False,
        pin: Session | None = None,
    ) -> Any:
        await self._revive()
        r = replica if replica is not None and replica.healthy else await self._ready(name=name)
        try:
            return await self._invoke(r, name, args, kwargs, all_ranks)
        except SupervisionError as first:
            if self._closed:  # its replica was stopped by `shutdown`, not dead: nothing to retry on
                raise ServiceError(
                    f"{self.options.actor.__name__}.{name}: the service was shut down during the call"
                ) from None
            if self.options.actor.stateful:
                await self._restore(r, first)
            self._replica_died(r)  # the respawn runs on; this call does not wait for it
            if not self.options.actor.retried:
                raise ServiceError(
                    f"{self.options.actor.__name__}.{name}: replica {r.index} died during the call ({first})"
                ) from None
            retry = await self._ready(exclude=r, name=name)  # the only replica: its replacement
            if pin is not None:
                pin.replica = retry  # the session's later calls go where this one went
            try:
                return await self._invoke(retry, name, args, kwargs, all_ranks)
            except SupervisionError as second:
                self._replica_died(retry)
                raise ServiceError(
                    f"{self.options.actor.__name__}.{name}: replicas {r.index} and {retry.index} died "
                    f"during the call ({first}; {second})"
                ) from None

    async def _fanout(self, name: str, args: tuple, kwargs: dict) -> list[Any]:
        await self._revive()  # first: a replica it brings back is one of those called
        if not self.healthy():  # every one respawning: wait for one, as a route does (stateful: restored)
            await self._ready(name=name)
        return list(await asyncio.gather(*(self._call(name, args, kwargs, replica=r) for r in self.healthy())))

    # ---- supervision ---------------------------------------------------------------

    async def _restore(self, r: Replica, cause: BaseException | str) -> NoReturn:
        """A stateful replica died: restore a new one from the restore point, then tell the
        caller (ReplicaRestored); or say why it cannot be (ServiceError)."""
        role = f"{self.options.actor.__name__} replica {r.index}"
        point, start = self.restore_point, time.monotonic()
        cause = last_line(cause)
        if r.respawned is None:  # the first call to see this death decides
            if point is None:
                self._lost = f"{role} died ({cause}) and holds state that no checkpoint has saved yet"
            elif r.respawns >= self.options.max_restores:
                self._lost = (
                    f"{role} died ({cause}) after {r.respawns} restores (max_restores); "
                    f"its last restore point is {point}"
                )
            if self._lost:
                r.healthy = False
                raise ServiceError(self._lost)
        try:
            await asyncio.shield(self._replica_died(r))
        except Exception as e:
            self._lost = f"{role} died ({cause}) and could not be restored from {point}: {type(e).__name__}: {e}"
            raise ServiceError(self._lost) from None
        raise ReplicaRestored(role, point, cause, time.monotonic() - start)

    def replace(self, r: Replica, why: str, respawns: int) -> None:
        """Respawn replica `r`, alive but of no more use (`why`: its event loop answers nothing),
        unless it has been respawned since it was seen with `respawns`; its calls in flight fail
        as if it had died."""
        if r.healthy and r.respawns == respawns and not self._closed:
            self._replica_died(r, why)  # the respawn stops its procs first

    def _replica_died(self, r: Replica, why: str = "died") -> asyncio.Future | None:
        if self._closed:
            return None
        if r.respawned is None:
            how = f"restoring it from {self.restore_point}" if self.options.actor.stateful else "respawning"
            log.warning("forge: %s replica %d %s; %s", self.options.actor.__name__, r.index, why, how)
            r.healthy = False
            r.respawned = asyncio.ensure_future(self._respawn(r))
        return r.respawned

    async def _revive(self) -> None:
        """Start again the respawns that their loop cancelled as it stopped (a REPL's `.get()`
        cancels the tasks it leaves, as `asyncio.run` does at its end), and see them through:
        until the next call nothing runs them. A stateful one's callers wait in `_ready`."""
        stopped = [r for r in self.replicas if r.respawned is not None and r.respawned.cancelled()]
        if not stopped or self._closed or self._lost:
            return
        for r in stopped:
            r.respawned = asyncio.ensure_future(self._respawn(r))
        if not self.options.actor.stateful:
            await asyncio.wait([r.respawned for r in stopped], timeout=self.options.respawn_wait_s)

    async def _respawn(self, r: Replica) -> None:
        """A new replica in `r`'s place. One that fails to come up is tried again, backing off,
        up to RESPAWN_ATTEMPTS times; then it stays down, its error in `r.error` (a stateful
        one's failure ends its role at once: the caller says why)."""
        delay = 1.0
        for attempt in range(1, RESPAWN_ATTEMPTS + 1):
            try:
                await self._spawn_again(r)
                break
            except Exception as e:
                if self.options.actor.stateful or self._closed:
                    raise
                record_metric("service/respawn_failures", 1, Reduce.SUM)
                r.error = f"{type(e).__name__}: {last_line(e)}; {attempt} of {RESPAWN_ATTEMPTS} attempts"
                if attempt == RESPAWN_ATTEMPTS:
                    log.error("forge: %s replica %d is lost: %s", self.options.actor.__name__, r.index, r.error)
                    return
                log.warning(
                    "forge: %s replica %d could not be respawned (%s); trying again in %.0f s",
                    self.options.actor.__name__,
                    r.index,
                    r.error,
                    delay,
                )
                await asyncio.sleep(delay)
                delay = min(2 * delay, 60.0)
        record_metric("service/respawns", 1, Reduce.SUM)
        r.healthy, r.respawned, r.error = True, None, None

    async def _spawn_again(self, r: Replica) -> None:
        with contextlib.suppress(Exception):
            await stop_procs(r.procs)
        r.respawns += 1
        r.procs, r.mesh = await self.options.for_replica(r.index).spawn_mesh(*self.args, **self.kwargs)
        try:
            await r.mesh.on_respawn.call(self.restore_point)
        except BaseException as e:
            with contextlib.suppress(Exception):
                await stop_procs(r.procs)
            raise (e.exception if isinstance(e, ActorError) else e) from None

    @returns_future
    async def wait_healthy(self, timeout: float = 120.0) -> int:
        """Wait until no respawn is in progress; returns the number of healthy replicas. A
        TimeoutError after `timeout` leaves the respawns running (their callers await them)."""
        await self._revive()
        pending = [r.respawned for r in self.replicas if r.respawned is not None]
        if pending and (await asyncio.wait(pending, timeout=timeout))[1]:
            raise TimeoutError(f"{self.options.actor.__name__}: replicas still respawning after {timeout} s")
        return len(self.healthy())

    # ---- public API ----------------------------------------------------------------

    def __getattr__(self, name: str) -> ServiceEndpoint:
        if name.startswith("_") or not hasattr(self.options.actor, name):
            raise AttributeError(f"{self.options.actor.__name__} has no endpoint {name!r}")
        return ServiceEndpoint(self, name)

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[Session]:
        yield self.pinned()

    def pinned(self) -> Session:
        """A Session without a with-block (one that lives as long as something else, e.g. a
        gateway session): its calls go to the least-loaded replica of now (while every replica
        is respawning, its first call waits for one)."""
        if not self.healthy() and self.replicas and not self._lost:
            return Session(self, self.replicas[0])
        return Session(self, self._pick())

    @returns_future
    async def shutdown(self) -> None:
        self._closed = True
        for r in self.replicas:
            if r.respawned is not None:
                r.respawned.cancel()
        for r in self.replicas:
            with contextlib.suppress(Exception):
                await stop_procs(r.procs)
        self.replicas = []


class ServiceEndpoint:
    def __init__(self, service: Service, name: str, session: Session | None = None):
        self.service, self.name, self.session = service, name, session

    @returns_future
    async def route(self, *args: Any, **kwargs: Any) -> Any:
        if self.session is not None:
            return await self.session._call(self.name, args, kwargs)
        return await self.service._call(self.name, args, kwargs)

    @returns_future
    async def call(self, *args: Any, **kwargs: Any) -> list[Any]:
        """One replica, the result of every rank in it (rank order)."""
        return await self.service._call(self.name, args, kwargs, all_ranks=True)

    @returns_future
    async def fanout(self, *args: Any, **kwargs: Any) -> list[Any]:
        return await self.service._fanout(self.name, args, kwargs)


class Session:
    """Calls pinned to one replica (multi-turn keeps its KV cache). If that replica dies,
    the session moves to the replica that served the retried call."""

    def __init__(self, service: Service, replica: Replica):
        self.service, self.replica = service, replica

    def __getattr__(self, name: str) -> ServiceEndpoint:
        return ServiceEndpoint(self.service, getattr(self.service, name).name, session=self)

    async def _call(self, name: str, args: tuple, kwargs: dict) -> Any:
        if not self.replica.healthy:
            self.replica = await self.service._ready(exclude=self.replica, name=name)
        return await self.service._call(name, args, kwargs, replica=self.replica, pin=self)
