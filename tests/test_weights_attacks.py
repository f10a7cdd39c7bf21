"""Attacks on the weights server and on /dev/shm: a network peer without the run's key, idle
connections, an accept that fails, a torn copy, another local user's symlinks and directories,
and jobs in another pid namespace that share /dev/shm."""

import asyncio
import contextlib
import errno
import fcntl
import os
import re
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from forge import shm, transfer
from forge.transfer import FileServer, fetch_delta, fetch_file, host_cache_dir, host_copy, wire_key

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def served(tmp_path):
    weights = tmp_path / "served"
    weights.mkdir()
    shm.write_safetensors({"w": torch.arange(1000.0)}, weights / "policy-abc-v1.safetensors")
    server = FileServer(weights, key="the-run-key")
    yield server
    server.close()


def raw_request(addr, line: bytes) -> tuple[int, bytes]:
    with socket.create_connection(addr, timeout=10) as s:
        s.sendall(line)
        (size,) = struct.unpack("<q", s.recv(8, socket.MSG_WAITALL))
        rest = b""
        while chunk := s.recv(1 << 16):
            rest += chunk
    return size, rest


def test_a_peer_without_the_run_key_gets_no_weights(served, tmp_path):
    """The request of a peer that knows the protocol but not the key (the version record's)
    is refused: no size, no bytes."""
    for line in (b"policy-abc-v1.safetensors " * 3 + b"\n", b"0" * 64 + b" policy-abc-v1.safetensors\n"):
        assert raw_request(served.addr, line) == (-1, b"")
    with pytest.raises(FileNotFoundError, match="has no file policy-abc-v1.safetensors .or refused the key"):
        fetch_file(served.addr, "policy-abc-v1.safetensors", tmp_path / "stolen", "guess")
    assert not (tmp_path / "stolen").exists() and served.refused == 3
    the_key = b"the-run-key".ljust(65) + b"policy-abc-v1.safetensors\n"  # as long as the key readers send
    assert raw_request(served.addr, the_key) == (-1, b"")  # the run's key itself never travels
    size, body = raw_request(served.addr, f"{wire_key('the-run-key')} policy-abc-v1.safetensors\n".encode())
    assert size == len(body) == os.path.getsize(served.directory / "policy-abc-v1.safetensors")


def _server_threads() -> int:
    return sum(t.name.startswith("forge-weights") for t in threading.enumerate())


def test_idle_connections_take_no_more_than_the_worker_pool(served, tmp_path):
    """64 connections that send nothing hold at most the server's workers (one thread each
    before), and are dropped after the request timeout; a reader with the key is then served."""
    before = _server_threads()
    idle = [socket.create_connection(served.addr) for _ in range(64)]
    try:
        time.sleep(0.5)
        assert _server_threads() - before <= 8
    finally:
        for s in idle:
            s.close()
    assert fetch_file(served.addr, "policy-abc-v1.safetensors", tmp_path / "got", "the-run-key") > 0


EMFILE_SCRIPT = """
import resource, socket, sys, time
from pathlib import Path
from forge.transfer import FileServer, fetch_file
server = FileServer(Path(sys.argv[1]), key="k")
early = socket.socket()
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (1, hard))  # no new fd: the server's accept fails
early.connect(server.addr)
time.sleep(0.5)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
print(fetch_file(server.addr, "policy-abc-v1.safetensors", Path(sys.argv[2]), "k", timeout_s=10))
"""


def test_the_accept_loop_survives_running_out_of_file_descriptors(served, tmp_path):
    """EMFILE in accept (a process out of fds for a moment) once ended the server's accept
    loop for good, and weight sync with it; the server now retries."""
    out = subprocess.run(
        [sys.executable, "-c", EMFILE_SCRIPT, str(served.directory), str(tmp_path / "got")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout) == os.path.getsize(served.directory / "policy-abc-v1.safetensors")
    assert "accept failed" in out.stderr


@pytest.mark.parametrize("then", ["stalls", "closes"])
def test_a_server_that_stalls_or_hangs_up_mid_file_costs_a_reader_its_timeout_and_no_file(tmp_path, then):
    """A server (or a link) that offers a file, sends half of it, then goes quiet or hangs up: the
    reader gives up after its timeout (not the whole file's), or at once, and keeps no copy."""
    listener = socket.create_server(("127.0.0.1", 0))
    size, done = 4 << 20, threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(1024)
            conn.sendall(struct.pack("<q", size) + b"\0" * (size // 2))
            if then == "stalls":
                done.wait(10)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    start = time.monotonic()
    error = TimeoutError if then == "stalls" else ConnectionError
    with pytest.raises(error, match="no weights bytes for 0.5 s" if then == "stalls" else "closed after 2097152 of"):
        fetch_file(listener.getsockname(), "policy-abc-v1.safetensors", tmp_path / "copy", "k", timeout_s=0.5)
    assert time.monotonic() - start < 3 and not list(tmp_path.iterdir())
    done.set()
    t.join()
    listener.close()


@pytest.mark.parametrize("what", ["file", "delta"])
def test_a_server_that_trickles_bytes_costs_a_reader_a_bounded_time(tmp_path, what):
    """A server at the pinned address (a man in the middle) or a degraded link that sends a
    byte within each wait: `timeout_s` bounds each wait, the transfer's deadline (a least
    average rate) the whole; the reader keeps no copy."""
    listener = socket.create_server(("127.0.0.1", 0))
    size, done = 1 << 20, threading.Event()

    def trickle() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(1024)
            conn.sendall(struct.pack("<q", size))
            for _ in range(50):  # 10 bytes a second, for 5 s (a day for the megabyte)
                if done.wait(0.1):
                    return
                with contextlib.suppress(OSError):
                    conn.sendall(b"\0")

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    start, addr, name = time.monotonic(), listener.getsockname(), "policy-abc-v1.safetensors"
    try:
        with pytest.raises(TimeoutError, match=r"sent \d+ of 1048576 bytes by the transfer's deadline: slower than"):
            if what == "file":
                fetch_file(addr, name, tmp_path / "copy", "k", timeout_s=0.5)
            else:
                base = tmp_path / "policy-abc-v0.safetensors"
                base.write_bytes(b"\0" * (2 << 20))
                fetch_delta(addr, name, base, tmp_path / "copy", "k", "its digest", timeout_s=0.5)
        assert time.monotonic() - start < 0.5 + size / transfer._MIN_RATE + 1.0
        assert not (tmp_path / "copy").exists()
    finally:
        done.set()
        t.join()
        listener.close()


def test_a_reader_waits_for_another_readers_fetch_a_bounded_time(monkeypatch, caplog):
    """Readers of one writer on a host take turns (a lock file): one whose turn never comes
    (the holder hung) gives up, saying who holds it, and a spare's allocation is skipped."""
    cache, outcome = host_cache_dir(), {}
    monkeypatch.setattr(transfer, "_TIMEOUT_S", 0.2)

    def read() -> None:
        try:
            host_copy(("127.0.0.1", 9), "policy-lk-v1.safetensors", "k", lambda n: False, timeout_s=0.2)
        except OSError as e:  # TimeoutError, or once it has the lock: nothing at port 9
            outcome["read"] = e

    def spare() -> None:
        outcome["reserved"] = transfer.reserve("policy-lk", 4096)

    with open(os.open(cache / "policy-lk.lock", os.O_RDWR | os.O_CREAT, 0o600)) as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)  # another reader of the host, fetching, hung
        waiting = [threading.Thread(target=read), threading.Thread(target=spare)]
        with caplog.at_level("WARNING", logger="forge"):
            for t in waiting:
                t.start()
            for t in waiting:
                t.join(5)
    try:
        for t in waiting:
            t.join(5)
        assert isinstance(outcome["read"], TimeoutError), outcome
        assert re.search(r"another reader of this host has held \S+policy-lk.lock for over 1 s", str(outcome["read"]))
        assert outcome["reserved"] is False and "no spare ahead of policy-lk's versions" in caplog.text
    finally:
        for p in cache.glob("policy-lk-*"):
            p.unlink()


def test_a_host_copy_that_fails_validation_never_takes_its_name(tmp_path):
    """A copy is validated before it is renamed to the name the host's other readers map:
    a torn file (or one the writer reused meanwhile) is deleted, never shared."""
    weights = tmp_path / "served"
    weights.mkdir()
    torn = weights / "policy-tok-v1.safetensors"
    shm.write_safetensors({"w": torch.arange(1000.0)}, torn)
    os.truncate(torn, os.path.getsize(torn) - 100)
    server = FileServer(weights, key="k")
    try:
        with pytest.raises(ValueError, match="is not a whole safetensors file"):
            host_copy(server.addr, torn.name, "k", stale=lambda name: False, validate=shm.check_safetensors)
        assert not list(host_cache_dir().glob("policy-tok-v1*"))
    finally:
        server.close()


def settled() -> None:
    """The spare a fetch leaves to allocate in the background is allocated."""
    deadline = time.monotonic() + 10
    while any(t.name.startswith("forge-reserve-") for t in threading.enumerate()):
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_the_files_of_readers_killed_mid_fetch_go_with_the_next_fetch(served):
    """A reader killed mid-fetch (a replica SIGKILLed or OOM-killed, then respawned) leaves
    `<file>.<pid>.tmp`, model-sized in tmpfs, that no later fetch's pid names: the writer's next
    fetch on the host (under its lock: no other fetch of that writer is live) writes the copy
    into one and removes the rest. Another writer's are not its to remove."""
    cache = host_cache_dir()
    dead = [cache / f"policy-abc-v1.safetensors.{pid}.tmp" for pid in (999_999_991, 999_999_992)]
    dead.append(cache / "policy-abc-spare.safetensors.999999993.tmp")
    others = cache / "policy-abc-x-v1.safetensors.999999994.tmp"  # writer "policy-abc-x"'s: maybe live
    for p in dead + [others]:
        p.write_bytes(b"\0" * 4096)
    inodes = {p.stat().st_ino for p in dead}
    try:
        copy, _ = host_copy(served.addr, "policy-abc-v1.safetensors", "the-run-key", lambda n: False)
        settled()
        assert copy.read_bytes() == (served.directory / copy.name).read_bytes() and copy.stat().st_ino in inodes
        left = sorted(p.name for p in cache.glob("policy-abc-*"))
        assert left == sorted([others.name, "policy-abc-spare.safetensors", copy.name])
    finally:
        for p in cache.glob("policy-abc-*"):
            p.unlink()


def test_shm_root_never_goes_through_a_symlink(tmp_path, monkeypatch):
    """Another local user plants /dev/shm/forge-<uid> as a symlink to a directory of the
    victim's choosing (or a directory others can enter): forge writes nothing through it, and
    takes a private directory of a secret name instead."""
    shared, target = tmp_path / "shm", tmp_path / "victim"
    shared.mkdir(mode=0o1777)
    target.mkdir()
    root = shared / f"forge-{os.geteuid()}"
    root.symlink_to(target)
    monkeypatch.setattr(shm, "ROOT", root)
    monkeypatch.setattr(shm, "_NAME_FILE", tmp_path / "home" / "shm-name")
    for planted in ("symlink", "open directory"):
        monkeypatch.setattr(shm, "_USER_ROOT", None)
        monkeypatch.setattr(shm, "_RUN_DIR", None)
        d = shm.run_dir()
        assert d.parent.name == f"{root.name}-{shm._NAME_FILE.read_text()}" and d.parent.parent == shared
        assert oct(os.stat(d.parent).st_mode & 0o777) == "0o700" and not list(target.iterdir())
        shm.remove_run_dir()
        if planted == "symlink":
            root.unlink()
            root.mkdir(mode=0o755)
    assert os.stat(shm._NAME_FILE).st_mode & 0o777 == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_shm_root_of_another_owner_is_refused(tmp_path, monkeypatch):
    shared = tmp_path / "forge"
    shared.mkdir(mode=0o1777)
    root = shared / str(os.geteuid())
    root.mkdir(mode=0o700)
    os.chown(root, 12345, 12345)
    monkeypatch.setattr(shm, "_SHARED", shared)
    assert shm._checked(shared, private=False) == shared
    with pytest.raises(shm.UnsafeDirectoryError, match="owned by uid 12345"):
        shm.private_root(root)


def test_weight_files_are_private_and_never_written_through_a_symlink(tmp_path):
    """A symlink planted where forge writes a new file (a temporary name) is replaced, not
    followed; the file is 0600."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    planted = tmp_path / "policy-abc-v1.safetensors.tmp"
    planted.symlink_to(victim)
    shm.write_safetensors({"w": torch.ones(4)}, planted)
    assert victim.read_text() == "precious" and not planted.is_symlink()
    assert os.stat(planted).st_mode & 0o777 == 0o600


HOLD_SCRIPT = """
import fcntl, os, sys, time
fd = os.open(os.path.join(sys.argv[1], ".owner"), os.O_RDONLY | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_SH)
print("held", flush=True)
time.sleep(60)
"""


def test_run_directories_live_while_their_owner_holds_the_lock(tmp_path):
    """Liveness is an flock the owner holds, not a pid: the directory of a live owner whose pid
    means nothing here (a job in another pid namespace sharing /dev/shm) is kept; those whose
    owners exited (a zombie too) go, as do lock-less ones past the grace period; a new one
    being made is kept."""
    mine = shm.owned_dir(tmp_path)
    other_namespace, zombie, stale, fresh = (tmp_path / n for n in ("run-4000000-5", "run-3-7", "run-9-9", "run-8-8"))
    for d in (other_namespace, zombie, stale, fresh):
        d.mkdir()
        (d / "policy-abc-v3.safetensors").write_bytes(b"x" * 100)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_SCRIPT, str(other_namespace)], stdout=subprocess.PIPE)
    dead = subprocess.Popen([sys.executable, "-c", HOLD_SCRIPT.replace("60", "0"), str(zombie)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == dead.stdout.readline() == b"held\n"
        time.sleep(0.5)  # `dead` has exited; not waited for, it stays a zombie
        old = time.time() - 3600
        os.utime(stale, (old, old))
        assert sorted(shm.sweep_dead_runs(tmp_path)) == sorted([zombie, stale])
        assert mine.is_dir() and other_namespace.is_dir() and fresh.is_dir()
    finally:
        holder.kill()
        holder.wait()
        dead.wait()
    assert other_namespace in shm.sweep_dead_runs(tmp_path)


def test_run_directories_of_the_earlier_layouts_are_swept(tmp_path, monkeypatch):
    """/dev/shm/forge/run-<pid>-<start> and /dev/shm/forge/<uid>/run-* (forge's layouts before
    a root per user): a dead run's go with their weight files, a live one's stay."""
    shared = tmp_path / "forge"
    shared.mkdir(mode=0o1777)
    (shared / str(os.geteuid())).mkdir(mode=0o700)
    monkeypatch.setattr(shm, "_SHARED", shared)
    live = shared / f"run-{os.getpid()}-{shm._start_time(os.getpid())}"
    dead, dead_too = shared / "run-4000000-5", shared / str(os.geteuid()) / "run-4000000-5"
    for d in (live, dead, dead_too):
        d.mkdir()
        (d / "policy-abc-v3.safetensors").write_bytes(b"x" * 100)
    old = time.time() - 3600
    os.utime(dead_too, (old, old))  # no lock file, past the grace period
    shm._sweep_earlier_layouts()
    assert live.is_dir() and not dead.exists() and not dead_too.exists()


def test_a_peer_without_the_key_that_trickles_bytes_holds_a_worker_only_until_the_deadline(served, tmp_path):
    """8 peers without the key send a byte a second, each well within a receive's timeout:
    they held all 8 workers for as long as they went on, and a reader with the key got no
    answer. A request now has one deadline in all, and its key is read (and checked) first."""
    stop = threading.Event()

    def trickle() -> None:
        with socket.create_connection(served.addr) as s:
            for _ in range(30):
                try:
                    s.sendall(b"x")
                except OSError:
                    return  # the server dropped it
                if stop.wait(1.0):
                    return

    threads = [threading.Thread(target=trickle, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    try:
        start = time.monotonic()
        assert fetch_file(served.addr, "policy-abc-v1.safetensors", tmp_path / "got", "the-run-key", timeout_s=12) > 0
        assert time.monotonic() - start < 8
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_a_reader_takes_only_the_writers_bytes_from_the_address_its_record_pins(tmp_path, monkeypatch):
    """A version's record named the writer's host, which readers resolved themselves: poisoned
    name resolution sent them (and the run's key) to another server, whose well-formed file
    went live. The record now pins the IP the server bound and the file's size and digest: a
    poisoned name reaches nobody else; a man in the middle at the pinned address is refused
    whether it sends other bytes of the same size or more bytes than the record says."""
    from forge.store import WeightStore, start_store, stop_store

    real_getaddrinfo = socket.getaddrinfo
    evil_dir = tmp_path / "evil"
    evil_dir.mkdir()

    async def main():
        procs = await start_store()
        ws = WeightStore("pin", serve_on="0.0.0.0")
        evil = None
        try:
            true = {"w": torch.arange(1000.0)}
            for v in (1, 2, 3):
                await ws.publish(v, {k: t + v for k, t in true.items()})
            port = ws._server.addr[1]
            recs = {v: await ws.record(v) for v in (1, 2, 3)}
            name = lambda v: Path(recs[v]["path"]).name  # noqa: E731
            shm.write_safetensors({"w": torch.zeros(1000)}, evil_dir / name(1))  # other weights, same size
            shm.write_safetensors({"w": torch.zeros(1000)}, evil_dir / name(2))
            shm.write_safetensors({"w": torch.zeros(100_000)}, evil_dir / name(3))  # more bytes
            evil = FileServer(evil_dir, key=ws._secret)  # it takes whatever key a reader sends
            monkeypatch.setenv("_MONARCH_WORKER_ADDR", "ipc:///forge-test/reader-host")

            def poisoned_name(host, p, *args, **kwargs):  # the writer's host name now leads elsewhere
                if p == port and host == socket.gethostname():
                    return real_getaddrinfo("127.0.0.1", evil.addr[1], *args, **kwargs)
                return real_getaddrinfo(host, p, *args, **kwargs)

            monkeypatch.setattr(socket, "getaddrinfo", poisoned_name)
            got = await ws.fetch(1)
            assert torch.equal(got["w"], true["w"] + 1) and evil.requests == 0

            def in_the_middle(host, p, *args, **kwargs):  # any address of the writer's
                if p == port:
                    return real_getaddrinfo("127.0.0.1", evil.addr[1], *args, **kwargs)
                return real_getaddrinfo(host, p, *args, **kwargs)

            monkeypatch.setattr(socket, "getaddrinfo", in_the_middle)
            with pytest.raises(ValueError, match=f"{name(2)} from weights server .* does not match the digest"):
                await ws.fetch(2)
            with pytest.raises(ValueError, match=f"offered 400[0-9]* bytes for {name(3)}; its version record says"):
                await ws.fetch(3)
            assert not [p for p in host_cache_dir().glob(f"pin-{ws._token}-v*") if "v1" not in p.name]
        finally:
            monkeypatch.setattr(socket, "getaddrinfo", real_getaddrinfo)
            if evil is not None:
                evil.close()
            await ws.clear()
            await stop_store(procs)

    asyncio.run(main())


@pytest.fixture
def shared_base():
    """A directory like /dev/shm: every user makes names in it and removes only its own."""
    base = Path(tempfile.mkdtemp(prefix="forge-test-base-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    base.chmod(0o1777)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def fresh_shm(shared_base, tmp_path, monkeypatch):
    """forge's /dev/shm names in `shared_base`, its secret suffix's file under tmp_path, and
    nothing cached: what a new process of this user's finds."""
    monkeypatch.setattr(shm, "_SHARED", shared_base / "forge")
    monkeypatch.setattr(shm, "ROOT", shared_base / f"forge-{os.geteuid()}")
    monkeypatch.setattr(shm, "_NAME_FILE", tmp_path / "home" / ".cache" / "forge" / "shm-name", raising=False)
    monkeypatch.setattr(shm, "_USER_ROOT", None, raising=False)
    monkeypatch.setattr(shm, "_RUN_DIR", None)
    return shared_base


@pytest.fixture
def no_records(monkeypatch):
    """WeightStore.publish without torchstore: its records go nowhere (its files are tested)."""
    from forge import store

    async def nowhere(*args, **kwargs) -> None:
        return None

    monkeypatch.setattr(store.torchstore, "put", nowhere)
    return store


def as_user(uid: int, fn) -> None:
    """Run `fn` in a child process of user `uid` (no privileges: needs root to switch)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgid(uid)
            os.setuid(uid)
            fn()
            code = 0
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
def test_another_user_can_neither_block_nor_own_my_shm_root(shared_base, fresh_shm, monkeypatch):
    """Another local user (uid 65534) takes, before this user first runs forge, every name
    forge's /dev/shm directories had or have: the parent shared by users (the first user to
    run forge owned it) with this user's directory in it, and the per-user name. forge locked
    this user out then; now it makes a private directory of this user's elsewhere, in nothing
    the squatter owns, and every process of this user finds the same one."""
    uid = os.geteuid()

    def squat() -> None:
        for d in (shared_base / "forge", shared_base / "forge" / str(uid), shared_base / f"forge-{uid}"):
            d.mkdir()
            d.chmod(0o1777)

    as_user(65534, squat)
    d = shm.run_dir()
    try:
        for p in (d, *d.parents[: len(d.parents) - len(shared_base.parents) - 1]):
            st = os.lstat(p)
            assert stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o022, p
        assert os.lstat(d.parent).st_mode & 0o777 == 0o700 and d.parent.parent == shared_base
        monkeypatch.setattr(shm, "_USER_ROOT", None, raising=False)  # another process of this user's
        assert shm.user_root() == d.parent
    finally:
        shm.remove_run_dir()


def test_a_reader_with_the_key_that_reads_slowly_holds_a_worker_only_until_the_transfer_deadline(tmp_path, monkeypatch):
    """A peer that saw a request's key on the wire (or a reader on a choked link) reads just
    fast enough that each of the server's waits ends in time: the send had no bound in all and
    held a worker for as long as the file took at that pace, the next reader none. A send now
    has a deadline at the least average rate readers hold servers to, and the next reader is
    served."""
    monkeypatch.setattr(transfer, "_SEND_WAIT_S", 5.0)
    monkeypatch.setattr(transfer, "_MIN_RATE", 16 << 20)  # 32 MB: 2 s at the least rate, 50 s at this reader's
    weights, name = tmp_path / "served", "policy-abc-v1.safetensors"
    weights.mkdir()
    shm.write_safetensors({"w": torch.zeros(8 << 20)}, weights / name)
    server, stop = FileServer(weights, key="k", workers=1), threading.Event()

    def slow() -> None:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
            s.connect(server.addr)
            s.sendall(f"{wire_key('k')} {name}\n".encode())
            while not stop.wait(0.1):  # 640 KB/s: each of the server's waits well within its timeout
                with contextlib.suppress(OSError):
                    if s.recv(1 << 16):
                        continue
                return

    reader = threading.Thread(target=slow, daemon=True)
    reader.start()
    time.sleep(0.5)  # it holds the one worker
    try:
        got = fetch_file(server.addr, name, tmp_path / "got", "k", timeout_s=12)
        assert got == os.path.getsize(weights / name)
    finally:
        stop.set()
        reader.join()
        server.close()


@pytest.mark.parametrize("server", ["refuses", "never answers"])
def test_a_server_that_refuses_or_never_answers_is_named_in_the_readers_error(tmp_path, server):
    """A reader whose server is gone (connection refused) or never answers said only
    "[Errno 111] Connection refused" or "timed out": which server, and for which file, was
    lost on the way to the generator's log. Its error names both, as the same kind of error."""
    listener = socket.create_server(("127.0.0.1", 0))
    addr = listener.getsockname()
    if server == "refuses":
        listener.close()  # nothing listens there now; "never answers": the kernel accepts, nobody reads
    error = ConnectionRefusedError if server == "refuses" else TimeoutError
    try:
        with pytest.raises(error, match=rf"weights server 127\.0\.0\.1:{addr[1]} .*policy-abc-v1\.safetensors"):
            fetch_file(addr, "policy-abc-v1.safetensors", tmp_path / "copy", "k", timeout_s=0.5)
        assert not list(tmp_path.iterdir())
    finally:
        listener.close()


def test_another_user_on_the_writers_loopback_port_gets_no_reader(tmp_path):
    """On loopback versions carry no digest: the pinned port is the writer's. Once the writer's
    server is gone (its process died, a restore is under way), another local user may take that
    port and serve a well-formed file of the right size: a reader refuses a port another user
    listens on, before it sends anything."""
    if os.geteuid() != 0:
        pytest.skip("switching to another user needs root")
    directory = tmp_path / "served"
    directory.mkdir()
    shm.write_safetensors({"w": torch.ones(1000)}, directory / "policy-v1.safetensors")
    server = FileServer(directory, key="the-run-key")
    addr = server.addr
    server.close()
    shm.write_safetensors({"w": torch.full((1000,), 666.0)}, tmp_path / "evil.safetensors")  # other weights
    body = (tmp_path / "evil.safetensors").read_bytes()
    ready_r, ready_w = os.pipe()

    def squat() -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(tuple(addr))
        s.listen()
        os.write(ready_w, b"x")
        while True:
            c, _ = s.accept()
            c.recv(4096)
            c.sendall(struct.pack("<q", len(body)) + body)
            c.close()

    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(65534)
            os.setuid(65534)
            squat()
        finally:
            os._exit(0)
    try:
        os.read(ready_r, 1)
        with pytest.raises(ConnectionError, match="another user's \\(uid 65534\\)"):
            fetch_file(addr, "policy-v1.safetensors", tmp_path / "got.safetensors", "the-run-key", size=len(body))
        assert not (tmp_path / "got.safetensors").exists()
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def test_a_run_directory_another_sweep_removes_first_is_passed_over(tmp_path, monkeypatch):
    """The procs of one mesh start together and each sweeps: a dead run's directory that
    another sweep removes while this one looks at it is not an error (it stopped a trainer's
    setup), and neither is this run's own directory swept before its lock file is made."""
    gone = tmp_path / "run-4000000-5"
    gone.mkdir()
    real_open, swept = os.open, set()

    def open_after_another_sweep(path, *args, **kwargs):
        if Path(path).parent == gone and gone not in swept:
            swept.add(gone)
            shutil.rmtree(gone)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_after_another_sweep)
    assert shm.sweep_dead_runs(tmp_path) == []
    gone = tmp_path / f"run-{os.getpid()}-{shm._start_time(os.getpid())}"
    assert shm.owned_dir(tmp_path) == gone and (gone / ".owner").is_file()


def test_idle_peers_without_the_key_cannot_keep_a_reader_out(served, tmp_path):
    """200 connections that send nothing, each remade as soon as the server drops it: they
    held the 8 workers and the kernel's backlog behind them, so a reader with the key waited
    past its timeout and weight sync stopped. The server now reads each key without a worker,
    a peer's connections beyond its share are dropped oldest first, and the reader gets in."""
    stop = threading.Event()

    def keep_idle(n: int) -> None:
        conns: list[socket.socket] = []
        while not stop.is_set():
            for s in [s for s in conns if _dropped(s)]:
                conns.remove(s)
                s.close()
            while len(conns) < n:
                s = socket.socket()
                s.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    s.connect(served.addr)
                conns.append(s)
            stop.wait(0.05)
        for s in conns:
            s.close()

    before = _server_threads()
    attacker = threading.Thread(target=keep_idle, args=(200,), daemon=True)
    attacker.start()
    try:
        time.sleep(1.0)
        start = time.monotonic()
        got = fetch_file(served.addr, "policy-abc-v1.safetensors", tmp_path / "got", "the-run-key", timeout_s=8)
        assert got == os.path.getsize(served.directory / "policy-abc-v1.safetensors")
        assert time.monotonic() - start < 5
        assert _server_threads() - before <= 8  # at most the workers, however many peers
        time.sleep(3.0)  # the churn goes on: the accept loop lives through it
    finally:
        stop.set()
        attacker.join()
    assert fetch_file(served.addr, "policy-abc-v1.safetensors", tmp_path / "again", "the-run-key", timeout_s=5) > 0


def _dropped(s: socket.socket) -> bool:
    """Whether the server closed `s` (a connection still being made is not dropped)."""
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError as e:
        return e.errno != errno.ENOTCONN


def test_a_server_closed_at_once_ends_its_accept_loop_quietly(tmp_path, monkeypatch):
    """A server closed before its accept loop ran (a store that fails to start): the loop found
    the socket closed and raised in its thread."""
    errors = []
    monkeypatch.setattr(threading, "excepthook", lambda a: errors.append(a.exc_value))
    for _ in range(100):
        FileServer(tmp_path).close()
    time.sleep(1.5)
    assert errors == []


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
def test_a_run_directory_another_user_remade_mid_run_is_not_written_to(fresh_shm, no_records):
    """The user's /dev/shm directories vanish mid-run (systemd-logind's RemoveIPC at a logout, a
    cleanup) and another local user remakes the run directory's path, its own: the writer went
    on publishing there (mkdir, exist_ok), where that user could swap the file that same-host
    readers map unchecked. A publish now takes a new directory of this user's."""
    ws = no_records.WeightStore("p")
    try:
        asyncio.run(ws.publish(1, {"w": torch.ones(4)}))
        first = Path(ws.shm_dir)
        shutil.rmtree(shm.ROOT)

        def remake() -> None:
            os.umask(0)
            first.mkdir(parents=True)

        as_user(65534, remake)
        asyncio.run(ws.publish(2, {"w": torch.full((4,), 2.0)}))
        written = Path(ws.shm_dir)
        assert written != first and (written / ws._path(2).name).is_file() and not list(first.iterdir())
        for d in (written, written.parent):
            st = os.lstat(d)
            assert st.st_uid == os.geteuid() and not st.st_mode & 0o022, d
    finally:
        ws._server and ws._server.close()
        shm.remove_run_dir()


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
def test_a_user_whose_suffixed_shm_root_was_taken_too_gets_a_new_one(fresh_shm, monkeypatch):
    """The suffix of the name forge falls back to is no secret once that directory exists (every
    user lists /dev/shm): after /dev/shm is cleared (a reboot), another user who took both names
    locked this user out of forge for good. A taken suffixed name now gets a new suffix."""
    uid = os.geteuid()
    as_user(65534, lambda: shm.ROOT.mkdir(mode=0o755))
    first = shm.user_root()
    first.rmdir()  # /dev/shm cleared
    as_user(65534, lambda: first.mkdir(mode=0o755))
    monkeypatch.setattr(shm, "_USER_ROOT", None, raising=False)  # a later run
    again = shm.user_root()
    st = os.lstat(again)
    assert again not in (first, shm.ROOT) and st.st_uid == uid and st.st_mode & 0o777 == 0o700
    monkeypatch.setattr(shm, "_USER_ROOT", None, raising=False)  # and the run after it finds the same
    assert shm.user_root() == again


CHURN_SCRIPT = """
import errno, socket, sys
addr, conns = (sys.argv[1], int(sys.argv[2])), []
print("up", flush=True)
while True:
    for s in list(conns):
        try:
            if s.recv(1) == b"":
                conns.remove(s)
                s.close()
        except BlockingIOError:
            pass
        except OSError as e:
            if e.errno != errno.ENOTCONN:
                conns.remove(s)
                s.close()
    while len(conns) < 64:
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(addr)
        except BlockingIOError:
            pass
        conns.append(s)
"""


def test_a_reader_whose_request_comes_late_is_not_pushed_out_by_idle_churn(served):
    """A peer without the key keeps 64 idle connections from the reader's address, remade as
    fast as they are dropped; a reader's request that comes 50-200 ms after its connection (a
    segment sent again) was pushed out, unanswered, when the server let one address wait on 16."""
    size = os.path.getsize(served.directory / "policy-abc-v1.safetensors")
    attacker = subprocess.Popen(
        [sys.executable, "-c", CHURN_SCRIPT, *map(str, served.addr)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert attacker.stdout.readline() == "up\n"
        time.sleep(1.0)
        for delay in (0.05, 0.2, 0.2):
            with socket.create_connection(served.addr, timeout=10) as s:
                time.sleep(delay)
                s.sendall(f"{wire_key('the-run-key')} policy-abc-v1.safetensors\n".encode())
                head = s.recv(8, socket.MSG_WAITALL)
            assert len(head) == 8 and struct.unpack("<q", head)[0] == size, delay
    finally:
        attacker.kill()
        attacker.wait()


def test_a_request_queued_for_a_busy_worker_keeps_its_time_to_arrive(tmp_path):
    """A reader whose request comes in two segments waits over 5 s for the only worker: its
    deadline ran from its connection, and it was dropped unanswered once a worker took it."""
    shm.write_safetensors({"w": torch.zeros(16 << 20)}, tmp_path / "big.safetensors")  # 64 MB
    shm.write_safetensors({"w": torch.arange(10.0)}, tmp_path / "small.safetensors")
    server, key = FileServer(tmp_path, key="k", workers=1), wire_key("k")
    hog = socket.create_connection(server.addr)  # takes the worker and reads nothing for 6 s
    hog.sendall(f"{key} big.safetensors\n".encode())
    time.sleep(0.3)
    try:
        with socket.create_connection(server.addr, timeout=30) as s:
            s.sendall(f"{key} ".encode())
            time.sleep(0.2)
            s.sendall(b"small.safetensors\n")
            time.sleep(6.0)
            threading.Thread(target=_drain, args=(hog,), daemon=True).start()
            head = s.recv(8, socket.MSG_WAITALL)
        assert len(head) == 8 and struct.unpack("<q", head)[0] == os.path.getsize(tmp_path / "small.safetensors")
    finally:
        hog.close()
        server.close()


def _drain(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while s.recv(1 << 20):
            pass


def test_a_directory_given_to_the_store_is_the_one_it_writes(tmp_path, no_records):
    """Only forge's own run directory is taken again where it is no longer safe: a directory the
    user gave (not made yet, or shared with the user's group) is written as given."""
    shared = tmp_path / "group"
    shared.mkdir(mode=0o775)
    shared.chmod(0o775)
    for given in (tmp_path / "not-made-yet", shared):
        ws = no_records.WeightStore("p", shm_dir=str(given))
        try:
            asyncio.run(ws.publish(1, {"w": torch.ones(4)}))
            assert ws.shm_dir == str(given) and ws._path(1).parent == given and ws._path(1).is_file()
        finally:
            ws._server.close()


def test_a_gate_made_while_the_process_has_almost_no_fds_still_lets_one_wait(monkeypatch):
    """The accept loop's gate sized itself from the fd limit when it started: started while a
    process was out of fds (the limit at 1, as the EMFILE test sets it), it let none wait and
    every connection raised in the loop."""
    monkeypatch.setattr(transfer.resource, "getrlimit", lambda what: (1, 1))
    gate, conn = transfer._Gate(), socket.socket()
    try:
        assert gate.admit(conn, "127.0.0.1") == [] and list(gate.waiting) == [conn]
    finally:
        conn.close()
