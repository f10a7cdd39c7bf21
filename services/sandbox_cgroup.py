"""A cgroup per sandbox slot, so a run is bounded as a whole: its memory (its processes and the
pages of its tmpfs), its number of processes and its CPU, however many processes it forks. On
cgroup v1 (the `memory`, `pids` and `cpu` hierarchies) where the host has those, else on cgroup v2.

The slots' cgroups are made below this process's own cgroup, so its limits hold over them too:

    cgroups = SlotCgroups.make(os.getpid())             # a string: why the host has none to use
    join = cgroups.slot(uid)                             # the cgroup.procs files a run's first process joins
    cgroups.limit(uid, memory_bytes, pids, cpu_cores)
    cgroups.oom_kills(uid)                               # how many of its processes the kernel killed
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
CPU_PERIOD_US = 100_000  # the CFS period the quota is of


def _own_cgroups(proc_cgroup: str) -> dict[str, str]:
    """Controller (or "" for v2) -> this process's cgroup path, from /proc/self/cgroup."""
    found = {}
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            found[c] = path
    return found


class SlotCgroups:
    """The slots' cgroups under `base` (one directory per hierarchy: v1 memory, pids and cpu, or
    the one v2 directory)."""

    def __init__(self, dirs: dict[str, Path], v2: bool):
        self.dirs, self.v2 = dirs, v2  # "memory"/"pids"/"cpu" -> the base directory in that hierarchy
        self.limits: dict[int, tuple] = {}  # uid -> the limits its cgroups have
        self.events: dict[int, int] = {}  # uid -> an fd of its memory cgroup's events
        self.procs: dict[int, list[int]] = {}  # uid -> fds of its cgroup.procs files

    @property
    def cpu(self) -> bool:
        """Whether the host's cgroups bound a slot's CPU (a host may lack the cpu controller)."""
        return "cpu" in self.dirs

    @classmethod
    def make(cls, pid: int, root: Path = CGROUP_ROOT, proc_cgroup: str | None = None) -> SlotCgroups | str:
        """The slots' base cgroups of sandbox process `pid`, made (those of sandboxes gone are
        removed first); or why none can be (a string naming what is missing)."""
        own = _own_cgroups(proc_cgroup if proc_cgroup is not None else Path("/proc/self/cgroup").read_text())
        v1 = {c: root / c / own[c].lstrip("/") for c in ("memory", "pids", "cpu") if c in own}
        v1 = {c: d for c, d in v1.items() if (root / c / "cgroup.procs").exists()}
        controllers = root / "cgroup.controllers"
        v2 = set(controllers.read_text().split()) if controllers.exists() and "" in own else set()
        if {"memory", "pids"} <= v1.keys():
            cgroups = cls(v1, v2=False)
        elif {"memory", "pids"} <= v2:
            base = root / own[""].lstrip("/")
            cgroups = cls({c: base for c in ("memory", "pids", "cpu") if c in v2}, v2=True)
        else:
            return f"no cgroup memory and pids controllers under {root}"
        try:
            cgroups._make_base(pid)
        except OSError as e:
            return f"cannot make cgroups under {root}: {e}"
        return cgroups

    def _make_base(self, pid: int) -> None:
        parents = set(self.dirs.values())
        enable = " ".join(f"+{c}" for c in self.dirs)
        if self.v2:  # a v2 cgroup's children get a controller only once their parent enables it
            (self.dirs["memory"] / "cgroup.subtree_control").write_text(enable)
        for parent in parents:
            for gone in parent.glob("forge-sandbox-*"):
                if not Path(f"/proc/{gone.name.rsplit('-', 1)[1]}").exists():
                    SlotCgroups({"memory": gone}, self.v2).remove()
        self.dirs = {c: d / f"forge-sandbox-{pid}" for c, d in self.dirs.items()}
        for d in set(self.dirs.values()):
            d.mkdir(exist_ok=True)
        if self.v2:
            (self.dirs["memory"] / "cgroup.subtree_control").write_text(enable)

    def slot(self, uid: int) -> list[str]:
        """The slot's cgroups, made: the cgroup.procs files its runs' first process joins."""
        procs = []
        for d in sorted(set(self.dirs.values())):
            if uid not in self.limits:
                (d / str(uid)).mkdir(exist_ok=True)
            procs.append(str(d / str(uid) / "cgroup.procs"))
        return procs

    def procs_fds(self, uid: int) -> list[int]:
        """The slot's cgroup.procs files, open for writing (kept: a run's first process joins by
        writing its pid to these, where opening their long paths cost it more than the write)."""
        if uid not in self.procs:
            self.procs[uid] = [os.open(p, os.O_WRONLY | os.O_CLOEXEC) for p in self.slot(uid)]
        return self.procs[uid]

    def limit(self, uid: int, memory_bytes: int, pids: int, cpu_cores: float = 1.0) -> None:
        """A run's limits: `memory_bytes` (no swap beyond it), `pids` processes at once and
        `cpu_cores` of CPU time per wall second, all its processes together."""
        if self.limits.get(uid) == (memory_bytes, pids, cpu_cores):
            return  # as the slot's last run had them: writing them again costs every run
        self.slot(uid)
        memory, tasks = self.dirs["memory"] / str(uid), self.dirs["pids"] / str(uid)
        if self.v2:
            (memory / "memory.max").write_text(str(memory_bytes))
            with contextlib.suppress(OSError):  # no swap accounting: nothing to bound
                (memory / "memory.swap.max").write_text("0")
        else:
            # v1 refuses a memory limit above memsw's, and a memsw limit below memory's: order matters.
            memsw = memory / "memory.memsw.limit_in_bytes"
            current = int((memory / "memory.limit_in_bytes").read_text())
            if memory_bytes > current and memsw.exists():
                memsw.write_text(str(memory_bytes))
            (memory / "memory.limit_in_bytes").write_text(str(memory_bytes))
            if memsw.exists():
                memsw.write_text(str(memory_bytes))
        (tasks / "pids.max").write_text(str(pids))
        if self.cpu:
            self._limit_cpu(self.dirs["cpu"] / str(uid), max(1000, round(cpu_cores * CPU_PERIOD_US)))
        self.limits[uid] = (memory_bytes, pids, cpu_cores)

    def _limit_cpu(self, cpu: Path, quota_us: int) -> None:
        if self.v2:
            (cpu / "cpu.max").write_text(f"{quota_us} {CPU_PERIOD_US}")
        else:
            (cpu / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
            (cpu / "cpu.cfs_quota_us").write_text(str(quota_us))

    def oom_kills(self, uid: int) -> int:
        """How many of the slot's processes the kernel killed for its memory limit, so far."""
        name = "memory.events" if self.v2 else "memory.oom_control"
        with contextlib.suppress(OSError, ValueError):
            if uid not in self.events:  # kept open: a cgroup file's lookup and open cost more than its read
                self.events[uid] = os.open(self.dirs["memory"] / str(uid) / name, os.O_RDONLY | os.O_CLOEXEC)
            for line in os.pread(self.events[uid], 4096, 0).decode().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def remove(self) -> None:
        """Remove the slots' cgroups (their processes are gone), then the base."""
        for fd in [*self.events.values(), *(fd for fds in self.procs.values() for fd in fds)]:
            os.close(fd)
        self.events.clear()
        self.procs.clear()
        for d in set(self.dirs.values()):
            for child in d.glob("*/"):
                if child.is_dir():
                    with contextlib.suppress(OSError):
                        os.rmdir(child)
            with contextlib.suppress(OSError):
                os.rmdir(d)
