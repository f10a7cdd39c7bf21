"""The sandbox's launcher: a small single-threaded process (standard library only) that starts
each run, so a run costs a few forks of this process instead of a chain of util-linux tools.

    python -I [-S] services/sandbox_launcher.py FD [FILTER]
    # FD: a SOCK_SEQPACKET socket to the pool; FILTER: the runs' seccomp filter, hex (sandbox_seccomp.py)

Each request (JSON, with the run's stdin, stdout, stderr, report and tests file descriptors
attached) is answered with {"id", "pid"} once started and {"id", "status", "setup_error"} (a wait
status; why the sandbox could not be set up, from a pipe the program never holds, or null) once it
ended. A request {"op": "namespaces", ...} is answered with the slot's network and mount
namespaces (two fds, for the pool to start exec'd programs in with services/sandbox_exec.c) or
{"id", "error"}.
A run is three processes: the first leaves the launcher's session and unshares the namespaces;
its child is pid 1 of the new pid namespace, makes the run's minimal read-only root (the
interpreter, its libraries, the run's files, private tmpfs, /proc, a few devices; nothing else
of the host) and pivots into it, then waits; its
child sets the rlimits, drops to the slot's uid, loads the syscall filter and runs the program. When pid 1 exits (or is
killed at the timeout) the kernel kills everything left in the namespace.

The launcher runs on the sandbox's own Python with the programs' flags, so a Python program
runs in that last process, forked from an interpreter already started (as a fork server does),
as `python -I script args` would run it there: starting the interpreter is most of what a short
program costs. Other programs are exec'd at the end of the same chain where the pool has no
services/sandbox_exec.c (it starts them itself otherwise).
"""

import atexit
import builtins
import contextlib
import ctypes
import gc
import importlib.machinery
import io
import json
import os
import resource
import select
import shutil
import signal
import socket
import sys
import time
import types
from typing import NoReturn

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x08000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1,
    2,
    4,
    8,
    32,
    4096,
    16384,
    1 << 18,
)
MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}
# What a run sees of the host, read-only: the system's programs and libraries, the dynamic
# linker's cache. The interpreter's own prefixes and the run's files are added per run.
HOST_PATHS = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache", "/etc/localtime"]
DEVICES = ("null", "zero", "full", "random", "urandom")
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS = 1, 4, 22, 38
SECCOMP_MODE_FILTER = 2
SETUP_FAILED = 125  # the exit code of a run whose sandbox could not be set up (its setup pipe says why)
libc = ctypes.CDLL(None, use_errno=True)


def check(result: int, what: str) -> None:
    if result != 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


FILTER = None  # a SockFprog: the runs' seccomp filter, made once: a run only loads it


def exit_code(pid: int) -> int:
    """Wait for `pid`; its exit code, or 128 + the signal that ended it (as a shell says)."""
    _, status = os.waitpid(pid, 0)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def settle() -> None:
    """For pid 1 of a run's namespace, its program gone: every other process killed and reaped,
    its SysV objects removed and the sockets the run left in flight collected (services/sandbox_exec.c
    `remove_sysv` and `collect_sockets` say why: each outlives the run, in the slot's memory)."""
    with contextlib.suppress(OSError):
        os.kill(-1, signal.SIGKILL)  # from pid 1: every other process of the namespace
    with contextlib.suppress(ChildProcessError):
        while True:
            os.wait()
    remove_sysv()
    for _ in range(250):
        with open("/proc/net/unix") as f:
            if len(f.readlines()) <= 1:
                return
        ends = socket.socketpair()  # closing a unix socket starts the kernel's collector
        for end in ends:
            end.close()
        time.sleep(0.002)


IPC_RMID = 0
SYSV_REMOVE = {"shm": lambda i: libc.shmctl(i, IPC_RMID, None), "msg": lambda i: libc.msgctl(i, IPC_RMID, None)}
SYSV_REMOVE["sem"] = lambda i: libc.semctl(i, 0, IPC_RMID)


def remove_sysv() -> None:
    """Every SysV object of this (the run's) IPC namespace, removed: nothing is attached now, so
    their memory is freed at once, not when the namespace is (see sandbox_exec.c `remove_sysv`)."""
    for kind, remove in SYSV_REMOVE.items():
        with open(f"/proc/sysvipc/{kind}") as f:
            ids = [int(line.split()[1]) for line in f.readlines()[1:]]
        for i in ids:
            remove(i)


NETNS: dict[int, int] = {}  # slot uid -> an fd of its network namespace


def slot_netns(uid: int) -> None:
    """A network namespace for each slot, made once: creating one per run costs more than the
    rest of the sandbox together (the kernel sets up and tears down every protocol). A slot's
    runs follow one another and all their processes are gone before the next starts, so none
    finds another's sockets; the namespace has only its loopback, down."""
    if uid in NETNS:
        return
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = libc.unshare(CLONE_NEWNET)
        os.write(ready_w, b"1" if code == 0 else b"0")
        os.read(hold_r, 1)
        os._exit(0)
    try:
        if os.read(ready_r, 1) != b"1":
            raise OSError("unshare(CLONE_NEWNET) failed")
        NETNS[uid] = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    finally:
        os.write(hold_w, b"1")
        os.waitpid(pid, 0)
        for fd in (ready_r, ready_w, hold_r, hold_w):
            os.close(fd)


def bind_read_only(src: str, dst: str) -> None:
    """`src` of the host at `dst` (in the run's new root), read-only; a symlink as itself."""
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
        return
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    check(libc.mount(src.encode(), dst.encode(), None, MS_BIND | MS_REC, None), f"bind {src}")
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
    check(libc.mount(None, dst.encode(), None, flags, None), f"read-only {src}")


def visible_paths(req: dict) -> list[str]:
    """The host paths a run sees: HOST_PATHS, this interpreter's prefixes and search path (a
    Python run is this process, forked), and the run's own (its program, the harness); each
    once, outside the others."""
    ours = [sys.prefix, sys.base_prefix, sys.exec_prefix, *(p for p in sys.path if os.path.isdir(p))]
    paths = sorted({os.path.realpath(p) for p in ours} | set(HOST_PATHS) | set(req["binds"]))
    kept: list[str] = []
    for p in paths:
        if os.path.lexists(p) and not any(p.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(p)
    return kept


def enter_minimal_root(req: dict) -> None:
    """Make a slot's root: a tmpfs holding only `visible_paths` (read-only), a /dev of a few
    devices, an /etc naming its uid, and empty mount points for each run's own tmpfs and
    /proc; then pivot_root into it and detach the host's root, which then no path reaches."""
    new = req["root"]
    check(
        libc.mount(b"tmpfs", new.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,nr_inodes=4096,mode=0755"), "root"
    )
    for path in visible_paths(req):
        bind_read_only(path, new + path)
    os.makedirs(new + "/etc", exist_ok=True)
    uid = req["uid"]
    for name, text in (
        ("passwd", f"root:x:0:0::/:/bin/false\n{uid}:x:{uid}:{uid}::/tmp:/bin/false\n"),
        ("group", f"root:x:0:\n{uid}:x:{uid}:\n"),
    ):
        with open(f"{new}/etc/{name}", "w") as f:
            f.write(text)
    os.makedirs(new + "/dev")
    check(libc.mount(b"tmpfs", f"{new}/dev".encode(), b"tmpfs", MS_NOSUID | MS_NOEXEC, b"size=64k,mode=0755"), "/dev")
    for name in DEVICES:
        open(f"{new}/dev/{name}", "a").close()
        check(libc.mount(f"/dev/{name}".encode(), f"{new}/dev/{name}".encode(), None, MS_BIND, None), f"/dev/{name}")
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", f"{new}/dev/{name}")
    os.symlink("/proc/self/fd", f"{new}/dev/fd")
    for target in [t for t, _ in req["tmpfs"]] + ["/proc", "/.host"]:
        os.makedirs(new + target, exist_ok=True)
    check(libc.syscall(SYS_PIVOT_ROOT[os.uname().machine], new.encode(), f"{new}/.host".encode()), "pivot_root")
    os.chdir("/")
    check(libc.umount2(b"/.host", MNT_DETACH), "detach the host's root")
    os.rmdir("/.host")
    check(libc.mount(None, b"/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None), "read-only root")


MNTNS: dict[int, int] = {}  # slot uid -> an fd of its mount namespace, whose root is the slot's
SLOT_ERRORS: dict[int, str] = {}  # slot uid -> why its namespaces could not be made


def slot_mntns(req: dict) -> None:
    """A mount namespace with the slot's minimal root, made once: each run of the slot starts
    from a copy of it (a few mounts), where building the root per run cost more than a short
    Python program does."""
    if req["uid"] in MNTNS:
        return
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            check(libc.unshare(CLONE_NEWNS), "unshare (mount)")
            check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
            enter_minimal_root(req)
            os.write(ready_w, b"1")
        except BaseException as e:  # noqa: BLE001 - the run's setns then fails and says so
            os.write(ready_w, f"0{type(e).__name__}: {e}".encode()[:4000])
        os.read(hold_r, 1)
        os._exit(0)
    try:
        answer = os.read(ready_r, 4096)
        if answer[:1] != b"1":
            raise OSError(f"the slot's root: {answer[1:].decode(errors='replace')}")
        MNTNS[req["uid"]] = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY)
    finally:
        os.write(hold_w, b"1")
        os.waitpid(pid, 0)
        for fd in (ready_r, ready_w, hold_r, hold_w):
            os.close(fd)


def mount_run_fs(req: dict) -> None:
    """In a copy of the slot's namespace, pid 1 of the run's: its own tmpfs and /proc."""
    for target, options in req["tmpfs"]:
        check(libc.mount(b"tmpfs", target.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options.encode()), target)
    check(libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None), "mount /proc")


def run(req: dict, fds: list[int], setup: int) -> NoReturn:
    """The forked child: sets up the sandbox, then execs the program or runs it here (Python).
    A set-up failure is written to `setup`, a pipe the program never holds (closed before it
    starts, and by pid 1 once it forked), so no program can pass for a sandbox that failed."""
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")  # the launcher gone: so is the run
        for procs in req["cgroups"]:  # the slot's memory and pids limits hold over everything the run forks
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        with open("/proc/self/oom_score_adj", "w") as f:  # out of memory, the kernel kills the run first
            f.write("1000")
        os.setsid()  # its own session and process group, away from the launcher's
        if req["namespaces"]:  # before the fds are closed: its namespaces are
            check(libc.setns(NETNS[req["uid"]], CLONE_NEWNET), "setns (the slot's network namespace)")
            if req["uid"] not in MNTNS:
                raise OSError(SLOT_ERRORS.get(req["uid"], "the slot's mount namespace could not be made"))
            check(libc.setns(MNTNS[req["uid"]], CLONE_NEWNS), "setns (the slot's mount namespace)")
            os.chdir("/")
        for target, fd in enumerate(fds):  # stdin, stdout, stderr, the harness's report (3) and tests (4)
            os.dup2(fd, target)
        os.closerange(len(fds), setup)  # the launcher's fds, but for `setup` (numbered above these)
        os.closerange(setup + 1, os.sysconf("SC_OPEN_MAX"))
        if req["namespaces"]:
            check(libc.unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWPID), "unshare")
            pid = os.fork()
            if pid:
                os.close(setup)
                os._exit(exit_code(pid))
            # pid 1 of the run's namespace: its mounts, then the program as its child
            check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
            mount_run_fs(req)
            if req["copy"]:
                shutil.copytree(req["copy"], req["cwd"], dirs_exist_ok=True)
                for root, dirs, files in os.walk(req["cwd"]):
                    for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
                        os.lchown(name, req["uid"], req["uid"])
        pid = os.fork()
        if pid:
            os.close(setup)
            code = exit_code(pid)
            if req["namespaces"]:  # this is the namespace's pid 1
                settle()
            os._exit(code)
        limit(req)
        if not req["python"]:
            os.execve(req["argv"][0], req["argv"], req["env"])  # `setup` is close-on-exec
    except BaseException as e:  # noqa: BLE001 - whatever failed, the run ends with why
        os.write(setup, f"{type(e).__name__}: {e}".encode()[:4000])
        os._exit(SETUP_FAILED)
    os.close(setup)
    run_python(req["argv"], req["env"])


def limit(req: dict) -> None:
    """The program's process: its rlimits, its directory, the slot's uid, the syscall filter."""
    for name, value in req["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    os.chdir(req["cwd"])
    if req["uid"] is not None:
        os.setgroups([])
        os.setgid(req["uid"])
        os.setuid(req["uid"])
        # Dumpable again, as exec would make it: setuid() made /proc/self root's
        check(libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "dumpable")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")  # which seccomp also needs
    if FILTER is not None:  # last: the set-up above needs what it denies
        check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(FILTER), 0, 0), "seccomp")


def run_python(argv: list[str], env: dict) -> NoReturn:
    """Run the Python program `argv[0]` in this process, as `python -I argv...` runs it: a fresh
    __main__, its argv and environment, its exit status; then leave."""
    os.environ.clear()
    os.environ.update(env)
    sys.orig_argv = [*sys.orig_argv[: -len(sys.argv)], *argv]  # the interpreter and its flags, then argv
    sys.argv = list(argv)
    module = types.ModuleType("__main__")
    module.__file__, module.__builtins__, module.__cached__ = argv[0], builtins, None
    module.__loader__ = importlib.machinery.SourceFileLoader("__main__", argv[0])
    sys.modules["__main__"] = module
    sys.excepthook = without_launcher_frames
    code, interrupted = 0, False
    try:
        with io.open_code(argv[0]) as f:
            source = f.read()
        exec(compile(source, argv[0], "exec"), module.__dict__)
    except SystemExit as e:
        code = exit_status(e)
    except BaseException as e:  # noqa: BLE001 - printed and exit 1, as the interpreter does
        sys.excepthook(type(e), e, e.__traceback__)
        code, interrupted = 1, isinstance(e, KeyboardInterrupt)
    os._exit(shut_down(code, interrupted))


def shut_down(code: int, interrupted: bool) -> int:
    """What the interpreter's exit does that a program can see: its non-daemon threads joined,
    atexit, its objects finalized (files it left open flushed), stdout and stderr flushed. The
    rest of the interpreter's teardown would free the launcher's objects too, ~7 ms of copy-on-
    write faults per run, which is why the run leaves with os._exit."""
    try:
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()
        atexit._run_exitfuncs()
    except SystemExit as e:
        code = exit_status(e)
    except BaseException:  # noqa: BLE001
        pass
    sys.modules["__main__"].__dict__.clear()
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - e.g. the reader closed stdout: Python's exit code then is 120
            code = code or 120
    if interrupted:  # an uncaught KeyboardInterrupt ends Python by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def exit_status(e: SystemExit) -> int:
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


def without_launcher_frames(kind, value, tb, _launcher=__file__) -> None:
    """A traceback as the program's own process prints it: from its own first frame."""
    while tb is not None and tb.tb_frame.f_code.co_filename == _launcher:
        tb = tb.tb_next
    sys.__excepthook__(kind, value.with_traceback(tb), tb)  # it prints the exception's own traceback


def setup_error(fd: int) -> str | None:
    """What a run's set-up wrote to its pipe (None: it set up); closes the pipe."""
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 4096).decode(errors="replace") or None
    except BlockingIOError:  # a writer left (cannot be: all closed or exited); nothing written
        return None
    finally:
        os.close(fd)


def start(req: dict, fds: list[int], setup: int, sock: socket.socket) -> int:
    """Start a run, forked; its pid."""
    pid = os.fork()
    if pid == 0:
        sock.close()
        run(req, fds, setup)
    return pid


def make_namespaces(req: dict) -> None:
    """The slot's network and mount namespaces, made once (a run's setns fails with why not)."""
    try:
        slot_netns(req["uid"])
        slot_mntns(req)
    except OSError as e:
        SLOT_ERRORS[req["uid"]] = str(e)


def send_namespaces(sock: socket.socket, req: dict) -> None:
    """Answer a pool's {"op": "namespaces"}: the slot's two namespaces' fds, or why there are none."""
    make_namespaces(req)
    uid = req["uid"]
    if uid in MNTNS:
        socket.send_fds(sock, [json.dumps({"id": req["id"]}).encode()], [NETNS[uid], MNTNS[uid]])
    else:
        sock.send(json.dumps({"id": req["id"], "error": SLOT_ERRORS.get(uid, "no namespaces")}).encode())


def main(fd: int, syscall_filter: bytes = b"") -> None:
    global FILTER
    if syscall_filter:
        FILTER = SockFprog(len(syscall_filter) // 8, syscall_filter)
    parent = os.getppid()
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")  # the pool's process gone: so is this
    if os.getppid() != parent:
        return
    sock = socket.socket(fileno=fd)
    gc.freeze()  # the launcher's objects: a run's collections skip them (no copy-on-write of their pages)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through wake_w
    running: dict[int, tuple[int, int]] = {}  # pid -> request id, the read end of its setup pipe
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            while running:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                run_id, setup_r = running.pop(pid)
                sock.send(json.dumps({"id": run_id, "status": status, "setup_error": setup_error(setup_r)}).encode())
        if sock in ready:
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 5)
            if not msg:
                return  # the pool is gone
            req = json.loads(msg)
            if req.get("op") == "namespaces":
                send_namespaces(sock, req)
                continue
            if req["namespaces"]:
                make_namespaces(req)
            setup_r, setup_w = os.pipe()
            pid = start(req, fds, setup_w, sock)
            for f in (*fds, setup_w):
                os.close(f)
            running[pid] = (req["id"], setup_r)
            sock.send(json.dumps({"id": req["id"], "pid": pid}).encode())


if __name__ == "__main__":
    main(int(sys.argv[1]), bytes.fromhex(sys.argv[2] if len(sys.argv) > 2 else ""))
