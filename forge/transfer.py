"""Weight files across hosts: the writer serves its /dev/shm files over TCP (sendfile, no
copy in the writer), and a reader on another host streams a version once into its host's
cache directory, where every reader of that host maps it as it would the writer's file.

Why not Monarch's RDMABuffer: without an ibverbs NIC it falls back to TCP, which moved 500 MB
here at 0.2 of a plain socket (about 1.0 s against 0.2 s); a socket with sendfile runs at the
link's speed. Standard library only.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path

from forge.shm import ROOT, owned_dir

_SIZE = struct.Struct("<q")  # the answer's header: the file's size, -1 when there is no such file
_CHUNK = 8 << 20


def host_id() -> str:
    """The host this process runs on, for weights: a Monarch job's worker (a host of the
    job) by its address, which the procs it spawns inherit; else the machine. ProcessJob's
    "hosts" share this machine's /dev/shm but count as hosts of their own here, so weights
    cross them as they would cross machines."""
    return os.environ.get("_MONARCH_WORKER_ADDR") or socket.gethostname()


def host_cache_dir() -> Path:
    """The directory this host's readers share for copies of other hosts' versions. It is
    owned by the host's agent (the parent of Monarch's procs), so it goes, swept like a run
    directory, once that agent is gone."""
    d = owned_dir(ROOT, pid=os.getppid()) / "host-copies"  # apart from files the agent writes itself
    d.mkdir(exist_ok=True)
    return d


class FileServer:
    """Serves the files of one directory: a request is a file name and a newline; the answer
    its size (8 bytes) and its bytes. Binds `host` ("0.0.0.0": every interface, advertised
    as this machine's name), port chosen by the kernel; one thread per connection."""

    def __init__(self, directory: str | Path, host: str = "127.0.0.1"):
        self.directory = Path(directory)
        try:
            self.sock = socket.create_server((host, 0))
        except OSError as e:
            raise ValueError(f"cannot serve weights on {host!r} (trainer.serve_weights_on): {e}") from None
        self.addr = (socket.gethostname() if host == "0.0.0.0" else host, self.sock.getsockname()[1])
        self.requests = 0
        threading.Thread(target=self._accept, daemon=True, name="forge-weights-server").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._send, args=(conn,), daemon=True).start()

    def _send(self, conn: socket.socket) -> None:
        conn.settimeout(60.0)  # a reader that stalls does not hold a thread forever
        with conn, contextlib.suppress(OSError):
            name = conn.makefile("rb").readline(256).decode().strip()
            self.requests += 1
            path = self.directory / name
            if "/" in name or not name.endswith(".safetensors") or not path.is_file():
                conn.sendall(_SIZE.pack(-1))
                return
            with open(path, "rb") as f:
                conn.sendall(_SIZE.pack(os.fstat(f.fileno()).st_size))
                conn.sendfile(f)  # os.sendfile, waiting on the socket's timeout

    def close(self) -> None:
        self.sock.close()


def fetch_file(addr: tuple[str, int], name: str, dest: Path, reuse: Path | None = None, timeout_s: float = 60.0) -> int:
    """Stream file `name` from the FileServer at `addr` into `dest` (whole or not at all),
    written into the file `reuse` when given (its tmpfs pages exist: writing runs at memcpy
    speed, where a new file pays for each page, measured 2x slower over loopback). Returns
    its size; FileNotFoundError if the server has no such file."""
    tmp = dest.with_name(dest.name + f".{os.getpid()}.tmp")
    if reuse is not None:
        os.replace(reuse, tmp)  # first: a reader still on it sees its name gone
    try:
        with socket.create_connection(tuple(addr), timeout=timeout_s) as s:
            s.sendall(name.encode() + b"\n")
            header = s.recv(_SIZE.size, socket.MSG_WAITALL)
            if len(header) < _SIZE.size:
                raise ConnectionError(f"weights server {addr[0]}:{addr[1]} closed before answering for {name}")
            (size,) = _SIZE.unpack(header)
            if size < 0:
                raise FileNotFoundError(f"weights server {addr[0]}:{addr[1]} has no file {name}")
            buf = memoryview(bytearray(_CHUNK))
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.ftruncate(fd, size)
                got = 0
                while got < size:
                    n = s.recv_into(buf, min(_CHUNK, size - got))
                    if n == 0:
                        raise ConnectionError(f"weights server {addr[0]}:{addr[1]} closed after {got} of {size} bytes")
                    got += os.pwrite(fd, buf[:n], got)
            finally:
                os.close(fd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, dest)
    return size


def host_copy(
    addr: tuple[str, int], name: str, stale: Callable[[str], bool], timeout_s: float = 60.0
) -> tuple[Path, int]:
    """This host's copy of file `name` served at `addr`: fetched by the first reader of the
    host while the others wait for it (a lock file per writer), then shared. The copies whose
    names `stale` says are no longer read go: the oldest is rewritten as the new one, the rest
    are removed. Returns the path and the bytes this call moved (0: another reader had it)."""
    directory = host_cache_dir()
    dest = directory / name
    writer = name.rsplit("-v", 1)[0]  # <store>-<writer token>
    with open(directory / f"{writer}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if dest.exists():
            return dest, 0
        old = sorted((p for p in directory.glob(f"{writer}-v*.safetensors") if stale(p.name)), key=os.path.getmtime)
        for p in old[1:]:
            p.unlink(missing_ok=True)
        return dest, fetch_file(addr, name, dest, old[0] if old else None, timeout_s)
