"""Sandbox service: runs untrusted code (a policy's program, its unit tests) in isolated,
resource-limited processes, many at once.

    sandbox = await Sandbox.options(replicas=2).as_service(SandboxConfig(workers=8))
    r = await sandbox.run.route("print(input()[::-1])", stdin="abc")   # SandboxFusion's fields
    r.status, r.stdout                                                # "ok", "cba\\n"

Each run gets:
- its own user id: one per worker slot, held through a lock file, so RLIMIT_NPROC counts only
  that slot's processes (root, which runs everything on these machines, ignores the limit);
- rlimits: address space (`memory_limit_MB`, and what its threads reserve where a cgroup
  bounds it), CPU seconds, processes, file size, open files;
- a cgroup per slot: its memory, its processes and its CPU (`cpu_cores`) as a whole;
- a seccomp filter (services/sandbox_seccomp.py): an allow-list of what programs and their tools
  use; no namespaces, keyrings, ptrace, mounts, bpf, perf, modules or io_uring;
- a scrubbed environment and a fresh working directory;
- where the kernel allows it (root or CAP_SYS_ADMIN), its slot's network namespace, its own IPC
  namespace, and pid and mount namespaces of its own (a Python program's) or its slot server's,
  emptied between runs (an exec'd program's): no network (its own loopback, down), a /proc that shows only its own processes,
  and private size-limited tmpfs on /tmp (the working directory), /var/tmp and /dev/shm. Its
  first process in the namespace (pid 1) waits for the program; when the program exits, every
  process left in it is killed (by the kernel as pid 1 exits, or by pid 1 where it serves the
  slot's next run), and the timeout kills pid 1 and so the namespace, daemons and setsid()
  escapes included. Without namespaces only the uid, the rlimits and a sweep of the slot's uid hold (or,
  not root, the rlimits and the process group), and the service logs a warning.
A small launcher process (services/sandbox_launcher.py) starts the runs by forking itself, a
few forks per run instead of a chain of util-linux tools. It runs on the sandbox's Python, so a
Python program runs in a process forked from an interpreter already started (a fork server),
which saves the interpreter's start-up, most of what a short program costs (every run then
has the same hash seed; `fresh_interpreter` execs a new interpreter per run instead). Programs
the sandbox execs (bash, a binary) start from services/sandbox_exec.c, compiled on start and
spawned by this process, set up alike in each slot's namespaces (which the launcher makes
once): with namespaces, one per slot serves the slot's runs one after another (_SlotServer);
where the host has no C compiler, they start from the launcher's forks.

The result's status: `ok`, `error` (non-zero exit), `timeout` (wall or CPU limit), `oom` (the
memory limit), `killed` (a signal). Bad input (an unknown language, a file outside the working
directory, bad base64) raises ValueError; a sandbox that cannot start a run raises SandboxError.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import fcntl
import hashlib
import itertools
import json
import logging
import math
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from monarch.actor import concurrent_endpoint, endpoint

from forge.actor import ForgeActor
from forge.shm import open_new, owned_dir
from services.sandbox_cgroup import SlotCgroups
from services.sandbox_seccomp import syscall_filter
from services.schema import SandboxConfig

log = logging.getLogger("forge")

LANGUAGES = {"python": "main.py", "bash": "main.sh"}
# What a program prints when the address-space limit stops an allocation (Python, libc, C++).
_OOM_MARKERS = (b"MemoryError", b"Cannot allocate memory", b"std::bad_alloc", b"out of memory")
# What a thread reserves of its process's address space: its stack (8 MB) and a malloc arena (64 MB).
_THREAD_RESERVE_MB = 72
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}


class SandboxError(RuntimeError):
    """The sandbox could not run the program (not the program's fault): an infrastructure failure."""


@dataclass
class RunResult:
    """What one run did. `exit_code` is None when a signal ended it (`signal` names it)."""

    status: str  # ok | error | timeout | oom | killed
    exit_code: int | None
    stdout: str
    stderr: str
    wall_s: float
    signal: str | None = None
    truncated: bool = False  # stdout or stderr passed max_output_bytes
    tests_passed: int = 0
    tests_total: int = 0
    # With tests: the program's own exit code (its process; `exit_code` is the grader's, which a
    # failed test also makes 1), negative for a signal; None when the grader could not tell.
    program_exit: int | None = None

    @property
    def pass_fraction(self) -> float:
        return self.tests_passed / self.tests_total if self.tests_total else float(self.status == "ok")


@dataclass
class _Request:
    code: str
    language: str
    stdin: bytes
    files: dict[str, bytes] = field(default_factory=dict)
    tests: list[str] = field(default_factory=list)
    timeout: float = 10.0
    memory_mb: int = 512


def default_python() -> str:
    """The sandbox's Python when the config names none: python3 on the sandbox's PATH (forge's
    own may live where the slot's uid cannot read, e.g. under /root), else this one."""
    return shutil.which("python3", path=_ENV["PATH"]) or sys.executable


@dataclass
class _Started:
    pid: int  # the run's first process (its session leader; its child is pid 1 of the namespace)
    exited: asyncio.Future  # (its exit code as a shell gives it (negative: killed itself), its set-up error)

    @property
    def returncode(self) -> int:
        return self.exited.result()[0]

    @property
    def setup_error(self) -> str | None:
        """Why the sandbox could not be set up, from the launcher's own channel (never the program's)."""
        return self.exited.result()[1]


class _Launcher:
    """The pool's side of services/sandbox_launcher.py: requests out (with the run's file
    descriptors), started / exited messages back, matched by id."""

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.waiting: dict[int, tuple[asyncio.Future, asyncio.Future]] = {}
        self.asked: dict[int, asyncio.Future] = {}  # namespaces requests
        self.ids = itertools.count()
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, python: list[str], seccomp: bytes | None) -> None:
        """Start the launcher on `python` (the interpreter and the programs' flags), with the
        runs' syscall filter."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *python,
                str(Path(__file__).with_name("sandbox_launcher.py")),
                str(theirs.fileno()),
                (seccomp or b"").hex(),
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # so its forked Pythons buffer stdout as a program's own would (not a tty)
                env=_ENV,
            )
        finally:
            theirs.close()
        ours.setblocking(False)
        self.sock = ours
        asyncio.get_running_loop().add_reader(ours.fileno(), self._receive)

    def _send(self, request: dict, fds: list[int]) -> int:
        """Send `request` (with `fds`) to the launcher; its id, which the answers carry."""
        if self.sock is None:
            raise SandboxError("sandbox: the launcher is not running")
        run_id = next(self.ids)
        try:
            socket.send_fds(self.sock, [json.dumps({**request, "id": run_id}).encode()], fds)
        except OSError as e:
            raise SandboxError(f"sandbox: the launcher does not answer: {e}") from e
        return run_id

    async def spawn(self, spec: dict, fds: list[int]) -> _Started:
        loop = asyncio.get_running_loop()
        started, exited = loop.create_future(), loop.create_future()
        self.waiting[self._send(spec, fds)] = (started, exited)  # answered on this loop, after this
        return _Started(await started, exited)

    async def namespaces(self, spec: dict) -> list[int]:
        """A slot's network and mount namespaces (fds, the caller's to close), made by the launcher."""
        asked = asyncio.get_running_loop().create_future()
        self.asked[self._send({**spec, "op": "namespaces"}, [])] = asked
        return await asked

    def _receive(self) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 2)
        except BlockingIOError:
            return
        if not data:  # the launcher died: every run waiting on it fails, as does every later one
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None
            for f in [*self.asked.values(), *(f for pair in self.waiting.values() for f in pair)]:
                if not f.done():
                    f.set_exception(SandboxError("sandbox: the launcher process died"))
            self.waiting.clear()
            self.asked.clear()
            return
        msg = json.loads(data)
        if msg["id"] in self.asked:
            asked = self.asked.pop(msg["id"])
            if "error" in msg:
                asked.set_exception(SandboxError(f"sandbox: could not set up the run: {msg['error']}"))
            else:
                asked.set_result(fds)
            return
        started, exited = self.waiting[msg["id"]]
        if "pid" in msg:
            started.set_result(msg["pid"])
        else:
            del self.waiting[msg["id"]]
            exited.set_result((os.waitstatus_to_exitcode(msg["status"]), msg["setup_error"]))

    async def stop(self) -> None:
        if self.sock is not None:
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            await self.proc.wait()


class Sandbox(ForgeActor):
    """Runs programs in isolated, limited processes: `run(code, language, stdin, files, tests,
    run_timeout, memory_limit_MB)` -> RunResult. Up to `workers` runs at once per replica."""

    @classmethod
    def check_args(cls, cfg: SandboxConfig | None = None) -> None:
        (cfg or SandboxConfig()).validate()

    def __init__(self, cfg: SandboxConfig | None = None):
        self.pool = SandboxPool(cfg)

    @endpoint
    async def setup(self) -> None:
        await self.pool.start()

    @endpoint
    async def isolation(self) -> dict[str, bool]:
        pool = self.pool
        return {
            "namespaces": pool.namespaces,
            "own_uid": pool.root,
            "cgroups": pool.cgroups is not None and pool.cgroups.cpu,
            "syscall_filter": pool.seccomp is not None,
        }

    async def __cleanup__(self, exc: Exception | None) -> None:
        await self.pool.stop()

    @concurrent_endpoint(instrument=False)  # no telemetry span per run: ~0.1 ms of a short run's ~3 ms of CPU
    async def run(
        self,
        code: str,
        language: str = "python",
        stdin: str = "",
        files: dict[str, str] | None = None,
        tests: list[str] | None = None,
        run_timeout: float | None = None,
        memory_limit_MB: int | None = None,
    ) -> RunResult:
        """Run `code` (SandboxFusion's request fields; `files`: path -> base64 content) and, for
        Python, each of `tests` after it. Returns when every process of the run is gone."""
        return await self.pool.run(code, language, stdin, files, tests, run_timeout, memory_limit_MB)


class SandboxPool:
    """The runs, from this process: a Sandbox replica holds one, and so does the reward service
    when a reward runs code (no hop to another service per sample)."""

    def __init__(self, cfg: SandboxConfig | None = None):
        self.cfg = cfg or SandboxConfig()
        self.cfg.validate()
        python = self.cfg.python or default_python()
        # a path: a fresh interpreter per run is exec'd, with no PATH search
        self.python = [shutil.which(python) or python, "-I"] + ([] if self.cfg.site_packages else ["-S"])
        self.seccomp = syscall_filter()
        self.root = os.geteuid() == 0
        base = Path("/run/forge-sandbox") if self.root else Path(f"/tmp/forge-sandbox-{os.geteuid()}")
        self.dir = owned_dir(base, mode=0o711)  # slots' directories below are 0700, each its own uid
        self.slots: asyncio.Queue[int] = asyncio.Queue()
        self.locks: list[int] = []
        self.uids: list[int] = []  # the slots'
        self.namespaces = False
        self.runs = 0
        self.launcher = _Launcher()
        self.cgroups: SlotCgroups | None = None
        self.oom_kills: dict[int, int] = {}  # slot uid -> the kernel's oom kills in its cgroup, after its last run
        self.harness = self.dir / "forge_harness.py"  # runs a program, then its tests
        self.exec_helper: Path | None = None  # starts exec'd programs' runs (services/sandbox_exec.c)
        self.slot_namespaces: dict[int, list[int]] = {}  # slot uid -> its network and mount namespaces' fds
        self.servers: dict[int, _SlotServer] = {}  # slot uid -> its exec'd programs' server (namespaces only)

    async def start(self) -> None:
        # in the base directory, shared by this host's sandboxes (each has its own below it)
        self.exec_helper = await asyncio.to_thread(_build_exec_helper, self.dir.parent)
        try:
            await self.launcher.start(self.python, self.seccomp)
        except OSError as e:
            raise SandboxError(f"sandbox: could not start its launcher: {e}") from e
        self.harness.write_text(Path(__file__).with_name("sandbox_harness.py").read_text())
        self.harness.chmod(0o644)
        (self.dir / "root").mkdir(mode=0o755, exist_ok=True)
        self.uids = self._take_uids(self.cfg.workers)
        for uid in self.uids:
            self.slots.put_nowait(uid)
        made = SlotCgroups.make(os.getpid()) if self.root else "not root"
        self.cgroups = made if isinstance(made, SlotCgroups) else None
        self.namespaces = self.root  # probed with a run; the fallback if it fails
        self.namespaces = self.namespaces and await self._probe_namespaces()
        missing = [
            *([] if self.root else ["root (a uid per slot)"]),
            *([] if self.namespaces else ["namespaces (no network, a private /proc and /tmp)"]),
            *([] if self.cgroups else [f"a cgroup per slot ({made})"]),
            *([] if not self.cgroups or self.cgroups.cpu else ["a CPU bound per slot (no cgroup cpu controller)"]),
            *([] if self.seccomp else [f"a syscall filter (no syscall numbers for {os.uname().machine})"]),
        ]
        if missing and self.cfg.isolation == "auto":
            await self.stop()
            raise SandboxError(
                f"sandbox: cannot isolate untrusted programs here: missing {'; '.join(missing)}. "
                "Run forge as root on a host with namespaces and cgroups, or set sandbox.isolation: "
                "unsafe_local for trusted code only"
            )
        if missing:
            log.warning("forge: sandbox.isolation=unsafe_local: runs without %s", "; ".join(missing))
        slots, host = self.cfg.workers * self.cfg.memory_limit_MB, _host_memory_mb()
        if slots > host:  # each slot's limit holds, but memory pressure above them kills another's run
            log.warning(
                "forge: sandbox: its slots may hold %d MB (workers %d x memory_limit_MB %d), more than this "
                "host's %d MB: out of memory, the kernel kills the largest run of any slot, another episode's",
                slots,
                self.cfg.workers,
                self.cfg.memory_limit_MB,
                host,
            )

    async def stop(self) -> None:
        """Stop the launcher and the slots' servers, remove the programs kept in the slots'
        directories and the slots' cgroups."""
        await self.launcher.stop()
        for server in self.servers.values():
            await server.stop()
        self.servers.clear()
        for uid in self.uids:
            for name in LANGUAGES.values():
                (self.dir / str(uid) / name).unlink(missing_ok=True)
        for fd in (fd for fds in self.slot_namespaces.values() for fd in fds):
            os.close(fd)
        self.slot_namespaces.clear()
        if self.cgroups is not None:
            self.cgroups.remove()

    async def run(
        self,
        code: str,
        language: str = "python",
        stdin: str = "",
        files: dict[str, str] | None = None,
        tests: list[str] | None = None,
        run_timeout: float | None = None,
        memory_limit_MB: int | None = None,
    ) -> RunResult:
        """Sandbox.run, in this process."""
        req = self._request(code, language, stdin, files, tests, run_timeout, memory_limit_MB)
        uid = await self.slots.get()
        try:
            return await self._run(req, uid)
        finally:
            self.slots.put_nowait(uid)

    # ---- a request ------------------------------------------------------------------

    def _request(self, code, language, stdin, files, tests, run_timeout, memory_limit_MB) -> _Request:
        if not isinstance(code, str):
            raise ValueError(f"sandbox: 'code' must be a string, got {type(code).__name__}")
        if language not in LANGUAGES:
            raise ValueError(f"sandbox: unknown 'language' {language!r}; known: {', '.join(LANGUAGES)}")
        if tests and language != "python":
            raise ValueError(f"sandbox: 'tests' are Python statements; language is {language!r}")
        timeout = self.cfg.run_timeout if run_timeout is None else float(run_timeout)
        memory = self.cfg.memory_limit_MB if memory_limit_MB is None else int(memory_limit_MB)
        if timeout <= 0 or memory <= 0:
            raise ValueError(f"sandbox: 'run_timeout' and 'memory_limit_MB' must be > 0, got {timeout}, {memory}")
        decoded = {}
        for name, content in (files or {}).items():
            path = PurePosixPath(name)
            if path.is_absolute() or ".." in path.parts or not path.parts or name.startswith(".forge_"):
                raise ValueError(f"sandbox: file {name!r} is not a relative path inside the working directory")
            try:
                decoded[str(path)] = base64.b64decode(content or "", validate=True)
            except (binascii.Error, TypeError) as e:
                raise ValueError(f"sandbox: file {name!r}: content is not base64 ({e})") from None
        return _Request(code, language, (stdin or "").encode(), decoded, list(tests or []), timeout, memory)

    # ---- a run ----------------------------------------------------------------------

    async def _run(self, req: _Request, uid: int) -> RunResult:
        self.runs += 1
        work = self.dir / str(uid)  # the slot's: a directory made and removed per run costs ~3 ms
        ours, theirs = [], []  # read here / given to the run (stdin, stdout, stderr, report, tests)
        try:
            argv = self._write_files(work, req, uid)
            if req.stdin:
                (work / ".stdin").write_bytes(req.stdin)
            theirs.append(os.open(work / ".stdin" if req.stdin else os.devnull, os.O_RDONLY))
            for _ in range(3 if req.tests else 2):
                r, w = os.pipe()
                ours.append(r)
                theirs.append(w)
            if req.tests:  # never a file, which some mode might let the program's uid read
                theirs.append(_memfd(json.dumps(req.tests).encode()))
            else:
                theirs.append(os.open(os.devnull, os.O_WRONLY))
            start = time.perf_counter()
            if self.launcher.sock is None:  # it died (its runs then failed): a new one for this run
                await self.launcher.start(self.python, self.seccomp)
            if self.cgroups is not None:
                self.cgroups.limit(uid, req.memory_mb << 20, self.cfg.max_processes, self.cfg.cpu_cores)
            run = await self._started(self._spec(work, req, uid, argv), theirs, uid)
            for fd in theirs:
                os.close(fd)
            theirs = []
            out, err, timed_out, truncated = await self._wait(run, ours[0], ours[1], req, uid)
            wall = time.perf_counter() - start
            report = _read_report(ours[2]) if req.tests else None
        except OSError as e:
            raise SandboxError(f"sandbox: could not run in {work}: {e}") from e
        finally:
            for fd in ours + theirs:
                os.close(fd)
            _empty(work, keep=LANGUAGES[req.language] if self.namespaces else None)
        if run.setup_error is not None:
            raise SandboxError(f"sandbox: could not set up the run: {run.setup_error}")
        oom = False
        if self.cgroups is not None:  # the kernel's kills so far: any new one was this run's
            kills = self.cgroups.oom_kills(uid)
            oom, self.oom_kills[uid] = kills > self.oom_kills.get(uid, 0), kills
        return self._result(run.returncode, out, err, wall, timed_out, truncated, req, report, oom)

    async def _started(self, spec: dict, fds: list[int], uid: int) -> _Started:
        """Start a run. An exec'd program's helper is spawned here, nothing awaited (no round trip
        through the launcher's Python); a run the launcher starts is carried through if the caller
        gives up meanwhile (its answer is on its way): then it is killed, and gone before the slot
        is free."""
        run = self._spawned(spec, fds)
        if run is not None:
            return run
        starting = asyncio.ensure_future(self._start(spec, fds))
        try:
            return await asyncio.shield(starting)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await self._ended(await starting, uid)
            raise

    def _execs(self, spec: dict) -> bool:
        """Whether the helper starts this run (it copies no files; Python programs are forked)."""
        return self.exec_helper is not None and not spec["python"] and not spec["copy"]

    def _spawned(self, spec: dict, fds: list[int]) -> _Started | None:
        """The run, from its slot's server or the helper spawned here; None where it needs one of
        the launcher's round trips first (or its forks)."""
        if not self._execs(spec):
            return None
        uid = spec["uid"]
        if spec["namespaces"]:
            server = self.servers.get(uid)
            if server is None or not server.alive:
                return None
            try:
                return server.run(spec, fds)
            except OSError:  # it died since: _start starts another
                return None
        cgroups = self.cgroups.procs_fds(uid) if self.cgroups is not None else []
        try:
            return _spawn_exec(self.exec_helper, self.seccomp, spec, fds, cgroups)
        except OSError:  # the helper could not be started (e.g. removed): the launcher's forks
            return None

    async def _start(self, spec: dict, fds: list[int]) -> _Started:
        """A run of the launcher's: for an exec'd program with namespaces, its slot's server
        started (in the slot's namespaces, which the launcher makes once); else the launcher's fork."""
        if self._execs(spec) and spec["namespaces"]:
            uid = spec["uid"]
            if uid not in self.slot_namespaces:
                self.slot_namespaces[uid] = await self.launcher.namespaces(spec)
            old = self.servers.pop(uid, None)
            if old is not None:
                await old.stop()
            cgroups = self.cgroups.procs_fds(uid) if self.cgroups is not None else []
            try:
                self.servers[uid] = await _SlotServer.start(
                    self.exec_helper, self.seccomp, spec, self.slot_namespaces[uid], cgroups
                )
            except OSError:  # the helper could not be started (e.g. removed): the launcher's forks
                return await self.launcher.spawn(spec, fds)
            return self.servers[uid].run(spec, fds)
        return await self.launcher.spawn(spec, fds)

    def _write_files(self, work: Path, req: _Request, uid: int) -> list[str]:
        """The run's directory; returns the argv (for Python, the script's). With namespaces the program stays
        here, readable by the slot's group and written by no one but root, and the request's
        files (owned by the slot's uid) are copied into the private /tmp, the working directory.
        Without, this directory is the working directory, the slot's uid owns it all.
        With namespaces, the program's file stays between runs (rewritten in place: creating a
        file costs a journaled inode on a disk's file system), no other run's beside it."""
        own = work / "files" if self.namespaces else work  # what the program's uid owns
        main = work / LANGUAGES[req.language]
        try:
            work.mkdir(mode=0o750, exist_ok=True)
            if self.namespaces:
                for other in set(LANGUAGES.values()) - {main.name}:
                    (work / other).unlink(missing_ok=True)
                _rewrite(main, req.code.encode())
            else:
                _write_new(main, req.code.encode())
            for name, content in req.files.items():
                (own / name).parent.mkdir(parents=True, exist_ok=True)
                _write_new(own / name, content)
            if self.root:  # lchown: a symlink left in the slot's directory is never followed as root
                owned = [own, *own.rglob("*")] if req.files or own == work else []
                for path, mode in ((work, 0o750), (main, 0o640)):
                    os.lchown(path, uid if path in owned else 0, uid)
                    os.chmod(path, mode)
                for path in owned:
                    os.lchown(path, uid, uid)
        except OSError as e:
            raise SandboxError(f"sandbox: could not write the working directory {work}: {e}") from e
        if req.language == "bash":
            return ["/bin/bash", str(main)]
        script = [str(self.harness), "3", "4", str(main)] if req.tests else [str(main)]  # report fd 3, tests fd 4
        # a Python script: the launcher runs it in a forked interpreter, or execs a fresh one
        return [*self.python, *script] if self.cfg.fresh_interpreter else script

    def _spec(self, work: Path, req: _Request, uid: int, argv: list[str]) -> dict:
        """What the launcher needs for one run: namespaces and the private tmpfs, rlimits, the
        slot's uid, the working directory, the program's argv and environment."""
        c = self.cfg
        tmp_opts = f"size={c.tmpfs_MB}m,nr_inodes={c.tmpfs_inodes},mode=0700,uid={uid},gid={uid}"
        small = "size=16m,nr_inodes=1024,mode=1777"
        return {
            "namespaces": self.namespaces,
            "cgroups": self.cgroups.slot(uid) if self.cgroups is not None else [],
            "root": str(self.dir / "root"),  # the mount point of the run's own root (namespaces only)
            "binds": [str(work), str(self.harness)],  # of the host, what the run sees besides the system's
            "tmpfs": [["/tmp", tmp_opts], ["/var/tmp", small], ["/dev/shm", small]],
            "copy": str(work / "files") if self.namespaces and req.files else None,
            "cwd": "/tmp" if self.namespaces else str(work),
            "uid": uid if self.root else None,
            "rlimits": {
                "RLIMIT_AS": self._address_space(req.memory_mb) << 20,
                "RLIMIT_CPU": math.ceil(req.timeout) + 1,  # a backstop: the wall-time timeout comes first
                "RLIMIT_NPROC": c.max_processes,
                "RLIMIT_NOFILE": c.max_open_files,
                "RLIMIT_FSIZE": c.max_file_MB << 20,
                # Pinned, not the host's (a run could raise its soft limit to the host's hard one):
                # no core dumps (a host's core_pattern may pipe them to a root helper), no real-time
                # priority (a real-time task escapes the cgroup's CPU share) or higher nice, and
                # POSIX message queues at Linux's default bytes.
                "RLIMIT_CORE": 0,
                "RLIMIT_RTPRIO": 0,
                "RLIMIT_NICE": 0,
                "RLIMIT_MSGQUEUE": 819200,
            },
            "argv": argv,
            "python": req.language == "python" and not self.cfg.fresh_interpreter,
            "env": {**_ENV, "HOME": "/tmp" if self.namespaces else str(work), "TMPDIR": "/tmp"},
        }

    def _address_space(self, memory_mb: int) -> int:
        """A run's processes' address-space limit, in MB. Where its cgroup bounds the memory the
        run uses, this leaves room for what each thread reserves and never touches (its stack, a
        malloc arena: 72 MB), or a program of a few threads could not start them; without one, it
        is the run's only memory bound."""
        return memory_mb + self.cfg.max_processes * _THREAD_RESERVE_MB if self.cgroups is not None else memory_mb

    async def _wait(self, run: _Started, stdout: int, stderr: int, req: _Request, uid: int) -> tuple:
        """Read both outputs (capped), wait for the exit or kill at the timeout."""
        cap = self.cfg.max_output_bytes
        io = asyncio.gather(_read(stdout, cap), _read(stderr, cap))
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.shield(run.exited), req.timeout)
        except TimeoutError:
            timed_out = True
        finally:  # also when the caller gave up (cancelled): nothing of the run survives it
            if not run.exited.done() or run.exited.exception() is not None or not self.namespaces:
                await self._ended(run, uid)
            else:
                await run.exited
        try:  # with namespaces every pipe is closed by now; without, a leftover may hold one
            (out, t_out), (err, t_err) = await asyncio.wait_for(io, 5.0)
        except TimeoutError:
            io.cancel()
            (out, t_out), (err, t_err) = (b"", False), (b"", False)
        return out, err, timed_out, t_out or t_err

    async def _ended(self, run: _Started, uid: int) -> None:
        """Kill the run and wait for its end; as root, until no process of its uid is left."""
        self._kill(run.pid, uid)
        try:
            await run.exited
        finally:
            if self.root:  # SIGKILL is delivered, not done: wait till they are gone
                await _gone(uid)

    def _kill(self, pid: int, uid: int) -> None:
        """Kill the run's processes. With namespaces, kill pid 1 of the namespace (the child of
        the run's first process): the kernel kills the rest, and the first process exits once
        they are all gone. Otherwise (or before pid 1 exists), the first process, its group, and
        every process of the slot's uid (setsid() leaves the group, not the uid)."""
        try:
            children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        except OSError:
            children = []
        if self.namespaces and children:
            for c in children:
                _signal(c, signal.SIGKILL)
            return
        for p in [*children, pid]:
            _signal(p, signal.SIGKILL)
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        if self.root:
            for p in _pids_of_uid(uid):
                _signal(p, signal.SIGKILL)

    def _result(
        self,
        rc: int,
        out: bytes,
        err: bytes,
        wall: float,
        timed_out: bool,
        truncated: bool,
        req: _Request,
        report: dict | None,
        oom_killed: bool = False,
    ) -> RunResult:
        # The launcher reports a program a signal ended as 128 + the signal (as a shell does); a
        # negative code is the run's first process, killed at the timeout.
        sig = -rc if rc < 0 else rc - 128 if rc > 128 else None
        if oom_killed:  # the kernel killed a process of the run for the run's memory limit
            status = "oom"
        elif timed_out or sig == signal.SIGXCPU:
            status = "timeout"
        elif rc != 0 and any(m in err for m in _OOM_MARKERS):
            status = "oom"
        elif sig is not None:
            status = "killed"
        else:
            status = "ok" if rc == 0 else "error"
        return RunResult(
            status=status,
            exit_code=None if sig is not None else rc,
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            wall_s=wall,
            signal=_signal_name(sig),
            truncated=truncated,
            tests_passed=_passed(report, len(req.tests)),
            tests_total=len(req.tests),
            program_exit=_program_exit(report),
        )

    # ---- set-up -----------------------------------------------------------------------

    def _take_uids(self, n: int) -> list[int]:
        """`n` uids no other sandbox on this host holds, each held by a lock file while this
        process lives (an exit or a crash releases them)."""
        locks = self.dir.parent / "uids"
        locks.mkdir(exist_ok=True)
        uids = []
        for uid in range(self.cfg.uid_base, self.cfg.uid_base + 65536):
            if len(uids) == n:
                break
            fd = os.open(locks / str(uid), os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.locks.append(fd)
            uids.append(uid)
        return uids

    async def _probe_namespaces(self) -> bool:
        uid = await self.slots.get()
        try:
            result = await self._run(_Request("", "bash", b"", timeout=30, memory_mb=256), uid)
            if result.status != "ok":
                raise SandboxError(result.stderr.strip()[-300:])
        except SandboxError as e:
            log.warning("forge: sandbox: namespaces failed: %s", e)
            return False
        finally:
            self.slots.put_nowait(uid)
        return True


# A static program of its own system calls, no C library (services/sandbox_exec.c says why).
_FREESTANDING = ["-O2", "-static", "-nostdlib", "-ffreestanding", "-fno-stack-protector", "-fno-pie", "-no-pie"]


# What the helper's processes start with: default signal handlers, nothing blocked.
_SIGNALS = set(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP}


def _spawn_exec(helper: Path, seccomp: bytes | None, spec: dict, fds: list[int], cgroups: list[int]) -> _Started:
    """Start a run of an exec'd program without namespaces from the helper (services/sandbox_exec.c
    says how): fds 0-4 the run's (4 of them, or 5 with tests)."""
    return _spawn_helper(helper, [*_helper_spec(spec, cgroups, seccomp), *spec["argv"]], spec["env"], fds, [], cgroups)


def _spawn_helper(
    helper: Path, args: list[str], env: dict, fds: list[int], namespaces: list[int], cgroups: list[int]
) -> _Started:
    """The helper spawned with `args`: `fds` at 0 and up, its set-up pipe at 5, the slot's
    namespaces at 6 and 7, its cgroup.procs files from 8. Its exit is seen on a pidfd."""
    targets = [*range(len(fds)), 5, *range(6, 6 + len(namespaces)), *range(8, 8 + len(cgroups))]
    setup_r, setup_w = os.pipe()
    high: list[int] = []
    try:
        for fd in [*fds, setup_w, *namespaces, *cgroups]:
            # above any number the child's fds take, so no dup2 below overwrites a source still to come
            high.append(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 64))
        pid = os.posix_spawn(
            str(helper),
            [str(helper), *args],
            env,
            file_actions=[(os.POSIX_SPAWN_DUP2, fd, i) for fd, i in zip(high, targets)],
            setsid=True,
            setsigmask=(),
            setsigdef=_SIGNALS,
        )
    except OSError:
        os.close(setup_r)
        raise
    finally:
        for fd in [*high, setup_w]:
            os.close(fd)
    loop = asyncio.get_running_loop()
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as e:  # started, but not to be watched: it ends here (not started again elsewhere)
        _signal(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(setup_r)
        raise SandboxError(f"sandbox: could not watch the run's process: {e}") from e
    exited = loop.create_future()

    def reap() -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        try:
            status = os.waitpid(pid, 0)[1]
            exited.set_result((os.waitstatus_to_exitcode(status), _setup_error(setup_r)))
        except OSError as e:  # another waiter took its status: the run's result is unknown
            os.close(setup_r)
            exited.set_exception(SandboxError(f"sandbox: lost the run's exit status: {e}"))

    loop.add_reader(pidfd, reap)
    return _Started(pid, exited)


def _helper_spec(spec: dict, cgroups: list[int], seccomp: bytes | None) -> list[str]:
    """The helper's SPEC words for a run or a server (services/sandbox_exec.c lists them)."""
    uid = spec["uid"] if spec["uid"] is not None else -1
    rlimits = [] if spec.get("serve") else _rlimits(spec)
    return [
        *(str(int(spec["namespaces"])), str(uid), spec["cwd"], str(len(cgroups))),
        *(str(len(spec["tmpfs"])), *(x for pair in spec["tmpfs"] for x in pair)),
        *(str(len(rlimits) // 2), *rlimits, seccomp.hex() if seccomp else "-", "--"),
    ]


def _rlimits(spec: dict) -> list[str]:
    return [str(x) for name, v in spec["rlimits"].items() for x in (getattr(resource, name), v)]


class _SlotServer:
    """A slot's runs of exec'd programs, from one helper process (`sandbox_exec serve`) that keeps
    the slot's pid and mount namespaces between them: a run is a fork there, where making the
    namespaces and the run's mounts each time cost more than the rest of the run's set-up. The
    helper kills what a run leaves, renews the tmpfs it changed and numbers the next run's pids
    from 2 again, so a run meets nothing of the one before."""

    def __init__(self, pid: int, sock: socket.socket, reaped: asyncio.Future):
        self.pid, self.sock, self.reaped = pid, sock, reaped  # reaped: the helper's exit, seen on a pidfd
        self.answer: asyncio.Future | None = None  # the run in it: its exit code and set-up error

    @classmethod
    async def start(
        cls, helper: Path, seccomp: bytes | None, spec: dict, namespaces: list[int], cgroups: list[int]
    ) -> _SlotServer:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        try:
            with open(os.devnull, "rb") as null:
                started = _spawn_helper(
                    helper, ["serve", *_helper_spec({**spec, "serve": True}, cgroups, seccomp)], spec["env"],
                    [null.fileno()] * 3 + [theirs.fileno()], namespaces, cgroups,
                )  # fmt: skip
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        server = cls(started.pid, ours, started.exited)
        try:
            ready = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(ours, 16), 30)
        except (TimeoutError, OSError):
            ready = b""
        except BaseException:
            await server.stop()
            raise
        if ready != b"R":
            await server.stop()
            code, why = await started.exited
            raise SandboxError(f"sandbox: could not set up the run: {why or f'its server exited with {code}'}")
        return server

    @property
    def alive(self) -> bool:
        return not self.reaped.done() and self.sock.fileno() >= 0

    def run(self, spec: dict, fds: list[int]) -> _Started:
        """Start a run in the server (`fds`: its 0-3 or 0-4); its exit comes back on the socket."""
        rlimits = _rlimits(spec)
        words = [spec["cwd"], str(len(rlimits) // 2), *rlimits, *spec["argv"]]
        setup_r, setup_w = os.pipe()
        try:
            socket.send_fds(self.sock, [b"".join(w.encode() + b"\0" for w in words)], [*fds, setup_w])
        except BaseException:
            os.close(setup_r)
            raise
        finally:
            os.close(setup_w)
        self.answer = asyncio.ensure_future(self._answer(setup_r))
        return _Started(self.pid, self.answer)

    async def _answer(self, setup_r: int) -> tuple[int, str | None]:
        try:
            answer = await asyncio.get_running_loop().sock_recv(self.sock, 16)
        except OSError:
            answer = b""
        if len(answer) != 4:  # the server is gone (killed at the run's timeout, out of memory): so is the run
            self.sock.close()
            return 128 + signal.SIGKILL, _setup_error(setup_r)
        return int.from_bytes(answer, sys.byteorder, signed=True), _setup_error(setup_r)

    async def stop(self) -> None:
        """Kill the server and everything in its namespaces; wait for its exit (and its run's)."""
        if not self.reaped.done():  # else its pid may be another process's by now
            _signal(self.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            await self.reaped
            if self.answer is not None:
                await asyncio.wait_for(self.answer, 5)
        self.sock.close()


def _setup_error(fd: int) -> str | None:
    """What a run's set-up wrote to its pipe (None: it set up); closes the pipe."""
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 4096).decode(errors="replace") or None
    except BlockingIOError:
        return None
    finally:
        os.close(fd)


def _build_exec_helper(directory: Path) -> Path | None:
    """services/sandbox_exec.c compiled into `directory` (once per version of its source), or None
    where the host has no C compiler (exec'd programs then start from the launcher's forks)."""
    source = Path(__file__).with_name("sandbox_exec.c")
    target = directory / f"sandbox_exec-{hashlib.sha256(source.read_bytes()).hexdigest()[:16]}"
    if target.exists():
        return target
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("forge: sandbox: no C compiler; exec'd programs start from the launcher's forks (slower)")
        return None
    partial = directory / f".{target.name}.{os.getpid()}"
    try:
        built = subprocess.run([cc, *_FREESTANDING, "-o", str(partial), str(source)], capture_output=True, text=True)
    except OSError as e:  # CC names nothing runnable
        log.warning("forge: sandbox: could not run the C compiler %s (exec'd programs start slower): %s", cc, e)
        return None
    if built.returncode == 0:
        partial.chmod(0o755)
        os.replace(partial, target)
        for old in directory.glob("sandbox_exec-*"):  # other versions' (a launcher that still names one falls back)
            if old != target:
                old.unlink(missing_ok=True)
        return target
    log.warning("forge: sandbox: could not compile %s (exec'd programs start slower): %s", source, built.stderr[-500:])
    return None


async def _read(fd: int, cap: int) -> tuple[bytes, bool]:
    """Up to `cap` bytes of a pipe; the rest is read (so the writer never blocks) and dropped."""
    loop = asyncio.get_running_loop()
    ended = loop.create_future()
    kept, dropped = bytearray(), False

    def ready() -> None:
        nonlocal dropped
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            loop.remove_reader(fd)
            ended.set_result(None)
            return
        room = cap - len(kept)
        kept.extend(chunk[:room])
        dropped |= len(chunk) > room

    os.set_blocking(fd, False)
    loop.add_reader(fd, ready)
    try:
        await ended
    finally:
        loop.remove_reader(fd)
    return bytes(kept), dropped


def _passed(report: dict | None, total: int) -> int:
    """The harness's count, checked: an int in [0, total], else 0."""
    passed = (report or {}).get("passed") if isinstance(report, dict) else None
    return passed if type(passed) is int and 0 <= passed <= total else 0


def _program_exit(report: dict | None) -> int | None:
    code = report.get("program_exit") if isinstance(report, dict) else None
    return code if type(code) is int else None


def _host_memory_mb() -> int:
    """This host's memory (MemTotal), in MB."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) >> 10 for line in f if line.startswith("MemTotal:"))


def _read_report(fd: int) -> dict | None:
    os.set_blocking(fd, False)
    try:
        return json.loads(os.read(fd, 4096) or b"null")
    except (OSError, ValueError):
        return None  # the program ended the process before the harness could report


def _signal_name(sig: int | None) -> str | None:
    try:
        return signal.Signals(sig).name if sig is not None else None
    except ValueError:
        return f"signal {sig}"


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def _memfd(data: bytes) -> int:
    """A file descriptor of `data`, read from its start, in memory and in no directory."""
    fd = os.memfd_create("forge-tests", os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _write_new(path: Path, data: bytes) -> None:
    """Write `path` afresh, never through a symlink: whatever had its name is removed first."""
    with open(open_new(path), "wb") as f:
        f.write(data)


def _rewrite(path: Path, data: bytes) -> None:
    """Write `path` in place where it is root's own file, one link, else afresh (never through a
    symlink or into another name's file)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:  # a symlink
        return _write_new(path, data)
    try:
        st = os.fstat(fd)
        if st.st_nlink != 1 or st.st_uid != os.geteuid():
            return _write_new(path, data)
        # over the old bytes, then cut to length: ext4 flushes a file truncated to 0 when closed
        view, done = memoryview(data), 0
        while done < len(data):
            done += os.pwrite(fd, view[done:], done)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)
    return None


def _empty(directory: Path, keep: str | None = None) -> None:
    """Remove what a run left in its slot's directory (but the file named `keep`)."""
    with os.scandir(directory) as entries:
        for e in entries:
            if e.name == keep:
                continue
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(e.path, ignore_errors=True)
            else:
                os.unlink(e.path)


async def _gone(uid: int, timeout: float = 5.0) -> None:
    """Until no process of `uid` is left (killed ones take a moment to exit)."""
    deadline = time.monotonic() + timeout
    while (pids := _pids_of_uid(uid)) and time.monotonic() < deadline:
        for p in pids:
            _signal(p, signal.SIGKILL)
        await asyncio.sleep(0.01)


def _pids_of_uid(uid: int) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and d.stat().st_uid == uid:
                pids.append(int(d.name))
        except OSError:
            pass
    return pids
