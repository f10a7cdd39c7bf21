"""Attacks on the weights server and on /dev/shm: a network peer without the run's key, idle
connections, an accept that fails, a torn copy, another local user's symlinks and directories,
and jobs in another pid namespace that share /dev/shm."""

import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from forge import shm
from forge.transfer import FileServer, fetch_file, host_cache_dir, host_copy

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
    for line in (b"policy-abc-v1.safetensors\n", b"wrong-key policy-abc-v1.safetensors\n"):
        assert raw_request(served.addr, line) == (-1, b"")
    with pytest.raises(FileNotFoundError, match="has no file policy-abc-v1.safetensors .or refused the key"):
        fetch_file(served.addr, "policy-abc-v1.safetensors", tmp_path / "stolen", "guess")
    assert not (tmp_path / "stolen").exists() and served.refused == 3
    size, body = raw_request(served.addr, b"the-run-key policy-abc-v1.safetensors\n")
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


def test_shm_root_refuses_another_users_symlink(tmp_path, monkeypatch):
    """Another local user plants /dev/shm/forge/<uid> as a symlink to a directory of the
    victim's choosing: forge refuses to write weights through it, naming it."""
    shared, target = tmp_path / "forge", tmp_path / "victim"
    shared.mkdir(mode=0o1777)
    target.mkdir()
    root = shared / str(os.geteuid())
    root.symlink_to(target)
    monkeypatch.setattr(shm, "_SHARED", shared)
    monkeypatch.setattr(shm, "ROOT", root)
    monkeypatch.setattr(shm, "_RUN_DIR", None)
    with pytest.raises(shm.UnsafeDirectoryError, match=f"{root} is a symlink"):
        shm.run_dir()
    assert not list(target.iterdir())
    root.unlink()
    root.mkdir(mode=0o755)  # a directory others can enter
    with pytest.raises(shm.UnsafeDirectoryError, match="mode drwxr-xr-x"):
        shm.run_dir()
    root.chmod(0o700)
    d = shm.run_dir()
    assert d.parent == root and oct(os.stat(root).st_mode & 0o777) == "0o700"
    shm.remove_run_dir()


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


def test_run_directories_of_the_earlier_layout_are_swept(tmp_path, monkeypatch):
    """/dev/shm/forge/run-<pid>-<start> (before directories per user): a dead process's goes
    with its weight files, a live one's stays."""
    shared = tmp_path / "forge"
    shared.mkdir(mode=0o1777)
    monkeypatch.setattr(shm, "_SHARED", shared)
    live = shared / f"run-{os.getpid()}-{shm._start_time(os.getpid())}"
    dead = shared / "run-4000000-5"
    for d in (live, dead):
        d.mkdir()
        (d / "policy-abc-v3.safetensors").write_bytes(b"x" * 100)
    shm.private_root(shared / str(os.geteuid()))
    assert live.is_dir() and not dead.exists()
