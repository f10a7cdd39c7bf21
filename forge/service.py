"""Service: N replicas of a ForgeActor (each its own proc mesh) behind one handle.

    await svc.ep.route(x)        one replica (least-loaded, or round-robin)
    await svc.ep.fanout(x)       every healthy replica, a list of results
    await svc.ep.call(x)         one replica, every rank's result
    async with svc.session() as s: await s.ep.route(x)   # sticky: always the same replica

Every call returns a Monarch Future: `await` it, or `.get()` it from a REPL. An exception
raised by an endpoint reaches the caller as itself. A replica whose process dies is taken
out of rotation, the calls that were on it are retried once on a healthy replica, and it
is respawned with the same constructor arguments, then told `on_respawn()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator

from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
from monarch.actor import ActorError, ProcMesh, returns_future

from forge.actor import SpawnOptions, stop_procs

log = logging.getLogger("forge")
ROUTERS = ("least_loaded", "round_robin")


class ServiceError(RuntimeError):
    """No healthy replica could serve a call."""


@dataclass
class Replica:
    index: int
    procs: ProcMesh
    mesh: Any
    inflight: int = 0
    healthy: bool = True
    respawns: int = 0
    respawned: asyncio.Future | None = None  # set while a respawn is under way


class Service:
    def __init__(self, options: SpawnOptions, args: tuple, kwargs: dict):
        if options.router not in ROUTERS:
            raise ValueError(f"unknown router {options.router!r}; known: {', '.join(ROUTERS)}")
        self.options, self.args, self.kwargs = options, args, kwargs
        self.replicas: list[Replica] = []
        self._rr = itertools.count()
        self._closed = False

    async def start(self) -> None:
        spawned = await asyncio.gather(
            *(self.options.spawn_mesh(*self.args, **self.kwargs) for _ in range(self.options.replicas)),
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

    def _pick(self, exclude: Replica | None = None) -> Replica:
        choices = [r for r in self.healthy() if r is not exclude] or self.healthy()
        if not choices:
            raise ServiceError(f"{self.options.actor.__name__}: no healthy replica")
        turn = next(self._rr)
        if self.options.router == "round_robin":
            return choices[turn % len(choices)]
        least = min(r.inflight for r in choices)
        idle = [r for r in choices if r.inflight == least]
        return idle[turn % len(idle)]  # ties rotate, so equal load spreads evenly

    async def _invoke(self, r: Replica, name: str, args: tuple, kwargs: dict, all_ranks: bool) -> Any:
        r.inflight += 1
        try:
            values = await getattr(r.mesh, name).call(*args, **kwargs)
        except ActorError as e:
            # An endpoint that raised: the caller gets that exception, the replica lives on.
            raise e.exception from None
        finally:
            r.inflight -= 1
        ranked = [v for _, v in values.items()]
        return ranked if all_ranks else ranked[0]

    async def _call(self, name: str, args: tuple, kwargs: dict, *, replica: Replica | None = None,
                    all_ranks: bool = False) -> Any:
        r = replica if replica is not None and replica.healthy else self._pick()
        try:
            return await self._invoke(r, name, args, kwargs, all_ranks)
        except SupervisionError as first:
            respawn = self._replica_died(r)
            if not self.healthy() and respawn is not None:
                await asyncio.shield(respawn)  # the only replica: retry on its replacement
            retry = self._pick(exclude=r)
            try:
                return await self._invoke(retry, name, args, kwargs, all_ranks)
            except SupervisionError as second:
                self._replica_died(retry)
                raise ServiceError(
                    f"{self.options.actor.__name__}.{name}: replicas {r.index} and {retry.index} died "
                    f"during the call ({first}; {second})"
                ) from None
            finally:
                # A REPL's .get() cancels tasks left on its loop, so the call that saw the
                # death also sees the respawn through.
                if respawn is not None:
                    await asyncio.shield(respawn)

    async def _fanout(self, name: str, args: tuple, kwargs: dict) -> list[Any]:
        return list(await asyncio.gather(*(self._call(name, args, kwargs, replica=r) for r in self.healthy())))

    # ---- supervision ---------------------------------------------------------------

    def _replica_died(self, r: Replica) -> asyncio.Future | None:
        if self._closed:
            return None
        if r.respawned is None:
            log.warning("forge: %s replica %d died; respawning", self.options.actor.__name__, r.index)
            r.healthy = False
            r.respawned = asyncio.ensure_future(self._respawn(r))
        return r.respawned

    async def _respawn(self, r: Replica) -> None:
        with contextlib.suppress(Exception):
            await stop_procs(r.procs)
        r.procs, r.mesh = await self.options.spawn_mesh(*self.args, **self.kwargs)
        await r.mesh.on_respawn.call()
        r.respawns += 1
        r.healthy, r.respawned = True, None

    @returns_future
    async def wait_healthy(self, timeout: float = 120.0) -> int:
        """Wait until no respawn is in progress; returns the number of healthy replicas."""
        pending = [r.respawned for r in self.replicas if r.respawned is not None]
        if pending:
            await asyncio.wait_for(asyncio.gather(*pending), timeout)
        return len(self.healthy())

    # ---- public API ----------------------------------------------------------------

    def __getattr__(self, name: str) -> "ServiceEndpoint":
        if name.startswith("_") or not hasattr(self.options.actor, name):
            raise AttributeError(f"{self.options.actor.__name__} has no endpoint {name!r}")
        return ServiceEndpoint(self, name)

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator["Session"]:
        s = Session(self, self._pick())
        yield s

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
    def __init__(self, service: Service, name: str, session: "Session | None" = None):
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
    the session moves to another one once."""

    def __init__(self, service: Service, replica: Replica):
        self.service, self.replica = service, replica

    def __getattr__(self, name: str) -> ServiceEndpoint:
        return ServiceEndpoint(self.service, getattr(self.service, name).name, session=self)

    async def _call(self, name: str, args: tuple, kwargs: dict) -> Any:
        if not self.replica.healthy:
            self.replica = self.service._pick(exclude=self.replica)
        return await self.service._call(name, args, kwargs, replica=self.replica)
