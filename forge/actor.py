"""ForgeActor: a Monarch actor that knows how to spawn itself as an actor mesh or a service.

    trainer = await Trainer.options(procs=2).as_actor(cfg)          # one mesh of 2 procs
    gen = await Generator.options(replicas=2).as_service(model=p)   # 2 replicas behind a Service
    ...
    await trainer.shutdown(); await gen.shutdown()

Both spawn calls return Monarch Futures, so a REPL can write `.get()` instead of `await`.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import functools
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import monarch.actor
from monarch.actor import Actor, ActorError, HostMesh, MeshFailure, ProcMesh, endpoint, returns_future, this_host

from forge import logs, metrics

log = logging.getLogger("forge")


def _on_unhandled_fault(failure: MeshFailure) -> None:
    # Monarch's default hook exits the controller when any mesh dies. forge's services
    # detect dead replicas on their own calls and respawn them, so the run goes on.
    log.warning("forge: a mesh failed: %s", failure)


monarch.actor.unhandled_fault_hook = _on_unhandled_fault


def _bootstrap(env: dict[str, str], title: str | None, log_to: logs.Destination | None) -> None:
    if log_to is not None:  # first: what the libraries print from now on goes to the file
        logs.process_to_file(log_to, (title or "proc").removeprefix("forge:"))
    os.environ.update(env)
    # A native fault (SIGSEGV, SIGILL in a kernel) writes where it was in Python to the log, here
    # and in the processes this one starts (vLLM's engine core), where it said only that it died.
    faulthandler.enable()
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")
    if title:  # `ps` (and a chaos test) can tell the roles apart
        import setproctitle

        setproctitle.setproctitle(title)


def spawn_procs(
    procs: int, hosts: HostMesh | None = None, env: dict[str, str] | None = None, title: str | None = None
) -> ProcMesh:
    """`procs` processes on each host of `hosts` (this host by default), with `env` set in each
    and `title` as their process title; their output goes to forge.logs' directory."""
    host = hosts if hosts is not None else this_host()
    bootstrap = functools.partial(_bootstrap, dict(env or {}), title, logs.destination())
    mesh = host.spawn_procs(per_host={"procs": procs}, bootstrap=bootstrap)
    metrics.register_procs(mesh)
    return mesh


async def stop_procs(procs: ProcMesh) -> None:
    metrics.unregister_procs(procs)
    await procs.stop()


class ForgeActor(Actor):
    """Base class of every forge role. Endpoints are `async` (Monarch refuses a class that
    mixes sync and async endpoints)."""

    # True: each proc gets torch.distributed's env (RANK, WORLD_SIZE, MASTER_ADDR, ...) first.
    distributed: bool = False
    # True: a replica holds state the run cannot lose (the trainer's weights and optimizer). Its
    # service does not retry a call that saw it die: it restores a new replica from the restore
    # point it was given (`Service.set_restore_point`) and raises ReplicaRestored, or stops the
    # run with ServiceError when there is none. False: respawn and retry (frozen or stateless roles).
    stateful: bool = False
    # False: a call that saw its replica die is not run again on another (its effects must not
    # repeat: an agent's episode, whose first run already spoke to the gateway); it fails with
    # ServiceError, and the replica is respawned for the calls after it.
    retried: bool = True

    @classmethod
    def options(
        cls,
        procs: int = 1,
        replicas: int = 1,
        hosts: HostMesh | None = None,
        env: dict[str, str] | None = None,
        router: str = "least_loaded",
        max_restores: int = 3,
        spread: bool = False,
        respawn_wait_s: float = 300.0,
    ) -> SpawnOptions:
        return SpawnOptions(
            cls,
            procs=procs,
            replicas=replicas,
            hosts=hosts,
            env=dict(env or {}),
            router=router,
            max_restores=max_restores,
            spread=spread,
            respawn_wait_s=respawn_wait_s,
        )

    @classmethod
    def check_args(cls, *args: Any, **kwargs: Any) -> None:
        """Raise on bad constructor arguments; runs in the caller before anything is spawned."""

    @endpoint
    async def setup(self) -> None:
        """Heavy or async start-up (an engine, a model); runs once after spawn, before any call."""

    @endpoint
    async def on_respawn(self, restore_point: Any = None) -> None:
        """Called on a replica the service respawned after a crash, with the service's restore
        point: a `stateful` role loads its state from it; others need nothing (the generator
        loads the latest weights in `setup`)."""


@dataclass
class SpawnOptions:
    actor: type[ForgeActor]
    procs: int = 1
    replicas: int = 1
    hosts: HostMesh | None = None
    env: dict[str, str] = field(default_factory=dict)
    router: str = "least_loaded"
    max_restores: int = 3  # stateful roles: restores per replica before the run stops
    respawn_wait_s: float = 300.0  # how long a call waits for a replica while every one is respawning
    # False: every replica spans all hosts of `hosts` (`procs` on each: one FSDP mesh across them);
    # True: replica i runs on host i % len(hosts) alone (generators, a few to each host).
    spread: bool = False

    def __post_init__(self) -> None:
        if self.procs < 1 or self.replicas < 1:
            raise ValueError(f"{self.actor.__name__}.options: procs and replicas must be >= 1")

    def for_replica(self, index: int) -> SpawnOptions:
        """The options replica `index` spawns with: its own host when `spread`."""
        if not self.spread or self.hosts is None:
            return self
        (label, n), *_ = self.hosts.sizes.items()
        return dataclasses.replace(self, hosts=self.hosts.slice(**{label: index % n}), spread=False)

    async def spawn_mesh(self, *args: Any, **kwargs: Any) -> tuple[ProcMesh, Any]:
        """Spawn the procs and the actor on them, then run its `setup()`; an exception raised
        by the constructor or by setup reaches the caller as itself, and the procs are stopped."""
        self.actor.check_args(*args, **kwargs)
        procs = spawn_procs(self.procs, self.hosts, self.env, title=f"forge:{self.actor.__name__.lower()}")
        try:  # from here on a failure (an argument that cannot be pickled, a cancellation) stops the procs
            if self.actor.distributed:
                from monarch.spmd import setup_torch_elastic_env_async

                await setup_torch_elastic_env_async(procs)
            mesh = procs.spawn(self.actor.__name__.lower(), self.actor, *args, **kwargs)
            await procs.initialized
            await mesh.setup.call()
        except ActorError as e:
            await stop_procs(procs)
            raise e.exception from None
        except BaseException:
            await stop_procs(procs)
            raise
        return procs, mesh

    @returns_future
    async def as_actor(self, *args: Any, **kwargs: Any) -> ActorHandle:
        if self.replicas != 1:
            raise ValueError(f"{self.actor.__name__}: as_actor() spawns one mesh; use as_service() for replicas")
        return ActorHandle(*await self.spawn_mesh(*args, **kwargs))

    @returns_future
    async def as_service(self, *args: Any, **kwargs: Any):
        from forge.service import Service

        service = Service(self, args, kwargs)
        await service.start()
        return service


class ActorHandle:
    """The actor mesh (endpoints as attributes: `h.train_step.call(...)`) plus shutdown()."""

    def __init__(self, procs: ProcMesh, mesh: Any):
        self.procs, self.mesh = procs, mesh

    def __getattr__(self, name: str) -> Any:
        return getattr(self.mesh, name)

    @returns_future
    async def shutdown(self) -> None:
        await stop_procs(self.procs)
