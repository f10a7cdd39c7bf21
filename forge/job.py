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

from typing import Any

from forge.schema import JobConfig, job_class
from forge.shm import sweep_dead_runs


class Job:
    """A started job: the host mesh of each role (None: this host), and `stop()`."""

    def __init__(self, cfg: JobConfig):
        self.cfg, self.job, self.meshes = cfg, None, {}
        if cfg.kind == "local":
            return
        cls = job_class(cfg.kind)
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
