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
import hmac
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from forge.shm import open_new, owned_dir, private_root

_SIZE = struct.Struct("<q")  # the answer's header: the file's size, -1 when there is no such file
_CHUNK = 8 << 20
_REQUEST_TIMEOUT_S = 5.0
log = logging.getLogger("forge")


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
    d = owned_dir(private_root(), pid=os.getppid()) / "host-copies"  # apart from files the agent writes itself
    d.mkdir(exist_ok=True)
    return d


class FileServer:
    """Serves the files of one directory to readers that know its key: a request is the key,
    a space, a file name and a newline; the answer the file's size (8 bytes) and its bytes
    (size -1: no such file, or a wrong key). Binds `host` ("0.0.0.0": every interface,
    advertised as this machine's name), port chosen by the kernel. At most `workers`
    connections are served at once; the others wait in the kernel's backlog."""

    def __init__(self, directory: str | Path, host: str = "127.0.0.1", key: str = "", workers: int = 8):
        self.directory = Path(directory)
        self.key = key or secrets.token_hex(16)
        try:
            self.sock = socket.create_server((host, 0))
        except OSError as e:
            raise ValueError(f"cannot serve weights on {host!r} (trainer.serve_weights_on): {e}") from None
        self.addr = (socket.gethostname() if host == "0.0.0.0" else host, self.sock.getsockname()[1])
        self.requests, self.refused, self.closed = 0, 0, False
        self.free = threading.BoundedSemaphore(workers)
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="forge-weights-send")
        threading.Thread(target=self._accept, daemon=True, name="forge-weights-server").start()

    def _accept(self) -> None:
        while True:
            self.free.acquire()  # a worker is free before a connection is taken
            try:
                conn, _ = self.sock.accept()
            except OSError as e:
                self.free.release()
                if self.closed:
                    return
                # e.g. EMFILE: the connection waits in the backlog; weight sync must not stop
                log.warning("forge: weights server: accept failed (%s); retrying", e)
                time.sleep(0.1)
                continue
            self.pool.submit(self._serve, conn)

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._send(conn)
        finally:
            self.free.release()

    def _send(self, conn: socket.socket) -> None:
        conn.settimeout(_REQUEST_TIMEOUT_S)  # a client that sends nothing frees its worker soon
        with conn, contextlib.suppress(OSError):
            key, _, name = conn.makefile("rb").readline(256).decode(errors="replace").strip().partition(" ")
            self.requests += 1
            if not hmac.compare_digest(key.encode(), self.key.encode()):
                self.refused += 1
                conn.sendall(_SIZE.pack(-1))
                return
            conn.settimeout(60.0)  # a reader that stalls does not hold a worker forever
            if "/" in name or not name.endswith(".safetensors"):
                conn.sendall(_SIZE.pack(-1))
                return
            try:
                fd = os.open(self.directory / name, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                conn.sendall(_SIZE.pack(-1))
                return
            with open(fd, "rb") as f:
                conn.sendall(_SIZE.pack(os.fstat(f.fileno()).st_size))
                conn.sendfile(f)  # os.sendfile, waiting on the socket's timeout

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept loop (close alone does not)
        self.sock.close()
        self.pool.shutdown(wait=False)


def fetch_file(
    addr: tuple[str, int],
    name: str,
    dest: Path,
    key: str,
    reuse: Path | None = None,
    timeout_s: float = 60.0,
    validate: Callable[[Path], None] | None = None,
) -> int:
    """Stream file `name` from the FileServer at `addr` (which `key` opens) into `dest`, whole
    or not at all: `validate(the temporary file)` runs before it takes `dest`'s name, so no
    other reader can map a copy that fails it. Written into the file `reuse` when given (its
    tmpfs pages exist: writing runs at memcpy speed, where a new file pays for each page,
    measured 2x slower over loopback). Returns its size; FileNotFoundError if the server has
    no such file or refused the key."""
    tmp = dest.with_name(dest.name + f".{os.getpid()}.tmp")
    if reuse is not None:
        os.replace(reuse, tmp)  # first: a reader still on it sees its name gone
    try:
        with socket.create_connection(tuple(addr), timeout=timeout_s) as s:
            s.sendall(f"{key} {name}\n".encode())
            header = s.recv(_SIZE.size, socket.MSG_WAITALL)
            if len(header) < _SIZE.size:
                raise ConnectionError(f"weights server {addr[0]}:{addr[1]} closed before answering for {name}")
            (size,) = _SIZE.unpack(header)
            if size < 0:
                raise FileNotFoundError(f"weights server {addr[0]}:{addr[1]} has no file {name} (or refused the key)")
            fd = os.open(tmp, os.O_WRONLY | os.O_NOFOLLOW) if reuse is not None else open_new(tmp)
            try:
                _receive(s, fd, size, addr)
            finally:
                os.close(fd)
        if validate is not None:
            validate(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, dest)
    return size


def _receive(s: socket.socket, fd: int, size: int, addr: tuple[str, int]) -> None:
    os.ftruncate(fd, size)
    buf = memoryview(bytearray(_CHUNK))
    got = 0
    while got < size:
        n = s.recv_into(buf, min(_CHUNK, size - got))
        if n == 0:
            raise ConnectionError(f"weights server {addr[0]}:{addr[1]} closed after {got} of {size} bytes")
        got += os.pwrite(fd, buf[:n], got)


def host_copy(
    addr: tuple[str, int],
    name: str,
    key: str,
    stale: Callable[[str], bool],
    validate: Callable[[Path], None] | None = None,
    timeout_s: float = 60.0,
) -> tuple[Path, int]:
    """This host's copy of file `name` served at `addr`: fetched by the first reader of the
    host while the others wait for it (a lock file per writer), validated, then shared. The
    copies whose names `stale` says are no longer read go: the oldest is rewritten as the new
    one, the rest are removed. Returns the path and the bytes this call moved (0: another
    reader had it)."""
    directory = host_cache_dir()
    dest = directory / name
    writer = name.rsplit("-v", 1)[0]  # <store>-<writer token>
    with open(os.open(directory / f"{writer}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if dest.exists():
            return dest, 0
        old = sorted((p for p in directory.glob(f"{writer}-v*.safetensors") if stale(p.name)), key=os.path.getmtime)
        for p in old[1:]:
            p.unlink(missing_ok=True)
        return dest, fetch_file(addr, name, dest, key, old[0] if old else None, timeout_s, validate)
