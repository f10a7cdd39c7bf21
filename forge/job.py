"""Where a run's roles live: Monarch's job layer (`monarch.job`), chosen by the config's `job`
section. forge only names the job kind and its host meshes; Monarch launches and connects them.

    job:
      kind: slurm                            # local (default: this host) | process | slurm | kubernetes
      meshes: {trainer: 2, generator: 8}     # host meshes by name, and the hosts in each
      args: {partition: gpu, gpus_per_node: 8, time_limit: "12:00:00"}   # the job class's own arguments
      placement: {trainer: trainer, generator: generator, store: trainer}  # role -> mesh; others: this host

`process` runs each "host" as a local worker process (Monarch's ProcessJob): the way to try a
multi-host layout on one machine.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any

from forge.config import ConfigError
from forge.shm import sweep_dead_runs

KINDS = {
    "local": None,
    "process": "monarch.job:ProcessJob",
    "slurm": "monarch.job:SlurmJob",
    "kubernetes": "monarch.job.kubernetes:KubernetesJob",
}
ROLES = ("trainer", "generator", "reference", "rewards", "store", "envs")


def _job_class(kind: str) -> type:
    module, name = KINDS[kind].split(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, RuntimeError) as e:  # KubernetesJob raises RuntimeError without its package
        raise ConfigError(f"config key 'job.kind': {kind} needs a package (pip install 'forge[{kind}]'): {e}") from None


@dataclass
class JobConfig:
    """The `job` section: a Monarch job kind, its host meshes, and which role runs on which mesh."""

    kind: str = "local"
    meshes: dict[str, int] = field(default_factory=dict)
    args: dict[str, Any] = field(default_factory=dict)  # the job class's constructor arguments
    # kubernetes: each mesh's `KubernetesJob.add_mesh` arguments (label_selector, port, ...)
    mesh_args: dict[str, Any] = field(default_factory=dict)
    placement: dict[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"config key 'job.kind': {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.kind == "local":
            for key in ("meshes", "args", "mesh_args", "placement"):
                if getattr(self, key):
                    raise ConfigError(f"config key 'job.{key}': a local job runs every role on this host; set job.kind")
            return
        if not self.meshes or any(not isinstance(n, int) or n < 1 for n in self.meshes.values()):
            raise ConfigError(
                f"config key 'job.meshes': name each host mesh with its host count >= 1, got {self.meshes}"
            )
        for role, mesh in self.placement.items():
            if role not in ROLES:
                raise ConfigError(f"config key 'job.placement.{role}': not a role; roles: {', '.join(ROLES)}")
            if mesh not in self.meshes:
                raise ConfigError(
                    f"config key 'job.placement.{role}': no mesh {mesh!r} in job.meshes ({', '.join(self.meshes)})"
                )
        # The job classes' own signatures say which arguments exist: a misspelt one fails here,
        # before anything is submitted (constructing a job would also reconfigure Monarch's transport).
        cls = _job_class(self.kind)
        if self.kind == "kubernetes":
            _bind("args", cls, self.args)
            _bind("mesh_args", cls.add_mesh, {"self": None, "name": "m", "num_replicas": 1, **self.mesh_args})
        elif self.mesh_args:
            raise ConfigError("config key 'job.mesh_args': only a kubernetes job takes per-mesh arguments")
        else:
            _bind("args", cls, {"meshes": dict(self.meshes), **self.args})


def _bind(key: str, fn: Any, kwargs: dict[str, Any]) -> None:
    try:
        inspect.signature(fn).bind(**kwargs)
    except TypeError as e:
        raise ConfigError(f"config key 'job.{key}': {fn.__qualname__}: {e}") from None


class Job:
    """A started job: the host mesh of each role (None: this host), and `stop()`."""

    def __init__(self, cfg: JobConfig):
        self.cfg, self.job, self.meshes = cfg, None, {}
        if cfg.kind == "local":
            return
        cls = _job_class(cfg.kind)
        if cfg.kind == "kubernetes":
            self.job = cls(**cfg.args)
            for name, hosts in cfg.meshes.items():
                self.job.add_mesh(name, hosts, **cfg.mesh_args)
        else:
            self.job = cls(dict(cfg.meshes), **cfg.args)
        try:
            state = self.job.state(cached_path=None)
            self.meshes = {name: getattr(state, name) for name in cfg.meshes}
        except BaseException:
            self.stop()
            raise

    def hosts(self, role: str) -> Any:
        """The host mesh `role` is placed on, or None for this host."""
        mesh = self.cfg.placement.get(role)
        return self.meshes[mesh] if mesh else None

    def stop(self) -> None:
        if self.job is not None:
            self.job.kill()
            self.job = None
            sweep_dead_runs()  # the directories its hosts had here in /dev/shm (weight copies)
