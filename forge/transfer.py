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
import ipaddress
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

from forge.shm import digest_of, open_new, owned_dir, user_root

_SIZE = struct.Struct("<q")  # the answer's header: the file's size, -1 when there is no such file
_CHUNK = 8 << 20
_REQUEST_DEADLINE_S = 5.0  # for a whole request: a peer that trickles bytes frees its worker as soon
_MAX_NAME = 256
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
    d = owned_dir(user_root(), pid=os.getppid()) / "host-copies"  # apart from files the agent writes itself
    d.mkdir(exist_ok=True)
    return d


class FileServer:
    """Serves the files of one directory to readers that know its key: a request is the key,
    a space, a file name and a newline, all within 5 s (the key is read, and checked, before
    anything else); the answer the file's size (8 bytes) and its bytes (size -1: no such file,
    or a wrong key). Binds `host` ("0.0.0.0": every interface), port chosen by the kernel;
    `addr` is the IP readers are to connect to, pinned here (for "0.0.0.0", the first
    non-loopback address this host's name resolves to here) so no reader resolves a name
    later. At most `workers` connections are served at once; the others wait in the kernel's
    backlog."""

    def __init__(self, directory: str | Path, host: str = "127.0.0.1", key: str = "", workers: int = 8):
        self.directory = Path(directory)
        self.key = key or secrets.token_hex(16)
        try:
            self.sock = socket.create_server((host, 0))
            ip, port = self.sock.getsockname()[:2]
            self.addr = (_host_ip(self.sock.family) if ipaddress.ip_address(ip).is_unspecified else ip, port)
        except OSError as e:
            raise ValueError(f"cannot serve weights on {host!r} (trainer.serve_weights_on): {e}") from None
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
            with conn, contextlib.suppress(OSError):
                self._send(conn)
        finally:
            self.free.release()

    def _request(self, conn: socket.socket) -> str | None:
        """The file name asked for, read once the key is right; None if not."""
        deadline = time.monotonic() + _REQUEST_DEADLINE_S
        key = _recv_until(conn, len(self.key) + 1, deadline)  # the key's length, never the name's
        self.requests += 1
        if not hmac.compare_digest(key, f"{self.key} ".encode()):
            self.refused += 1
            conn.sendall(_SIZE.pack(-1))
            _recv_until(conn, _MAX_NAME, deadline, end=b"\n")  # closing on unread bytes resets the answer
            return None
        return _recv_until(conn, _MAX_NAME, deadline, end=b"\n").decode(errors="replace").strip()

    def _send(self, conn: socket.socket) -> None:
        name = self._request(conn)
        if name is None:
            return
        if "/" in name or not name.endswith(".safetensors"):
            conn.sendall(_SIZE.pack(-1))
            return
        conn.settimeout(60.0)  # a reader with the key that stalls does not hold a worker forever
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


def _host_ip(family: int) -> str:
    """This host's address for readers of other hosts: the first non-loopback one its name
    resolves to (a machine alone: loopback)."""
    ips = [i[4][0] for i in socket.getaddrinfo(socket.gethostname(), None, family, socket.SOCK_STREAM)]
    return next((ip for ip in ips if not ipaddress.ip_address(ip).is_loopback), ips[0])


def _recv_until(conn: socket.socket, most: int, deadline: float, end: bytes = b"") -> bytes:
    """`most` bytes (fewer if `end` comes first) that arrive before `deadline`; TimeoutError
    or ConnectionError if they do not."""
    data = b""
    while len(data) < most and not (end and data.endswith(end)):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("weights request past its deadline")
        conn.settimeout(left)
        chunk = conn.recv(most - len(data))
        if not chunk:
            raise ConnectionError("weights request cut short")
        data += chunk
    return data


def fetch_file(
    addr: tuple[str, int],
    name: str,
    dest: Path,
    key: str,
    reuse: Path | None = None,
    timeout_s: float = 60.0,
    validate: Callable[[Path], None] | None = None,
    size: int | None = None,
    digest: str | None = None,
) -> int:
    """Stream file `name` from the FileServer at `addr` (an IP: a name resolved now could lead
    anywhere; `key` opens it) into `dest`, whole or not at all: `validate(the temporary file)`
    runs, and the file's `FileDigest` must be `digest` (its version record's; hashed as it
    arrives), before it takes `dest`'s name, so no other reader can map a copy that fails
    either. A server offering other than `size` bytes is refused before any is read. Written
    into the file `reuse` when given (its tmpfs pages exist: writing runs at memcpy speed,
    where a new file pays for each page, measured 2x slower over loopback). Returns its size;
    FileNotFoundError if the server has no such file or refused the key."""
    try:
        ipaddress.ip_address(addr[0])
    except ValueError:
        raise ValueError(
            f"weights server address {addr[0]!r} is not an IP address: readers go only where the writer pinned"
        ) from None
    where = f"weights server {addr[0]}:{addr[1]}"
    tmp = dest.with_name(dest.name + f".{os.getpid()}.tmp")
    if reuse is not None:
        os.replace(reuse, tmp)  # first: a reader still on it sees its name gone
    try:
        with socket.create_connection(tuple(addr), timeout=timeout_s) as s:
            s.sendall(f"{key} {name}\n".encode())
            header = s.recv(_SIZE.size, socket.MSG_WAITALL)
            if len(header) < _SIZE.size:
                raise ConnectionError(f"{where} closed before answering for {name}")
            (offered,) = _SIZE.unpack(header)
            if offered < 0:
                raise FileNotFoundError(f"{where} has no file {name} (or refused the key)")
            if size is not None and offered != size:
                raise ValueError(f"{where} offered {offered} bytes for {name}; its version record says {size}")
            fd = os.open(tmp, os.O_RDWR | os.O_NOFOLLOW) if reuse is not None else open_new(tmp, os.O_RDWR)
            try:
                got = _receive(s, fd, offered, where, hashed=digest is not None)
            finally:
                os.close(fd)
        if validate is not None:
            validate(tmp)
        if digest is not None and got != digest:
            raise ValueError(
                f"{name} from {where} does not match the digest of its version record: not the writer's file"
            )
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, dest)
    return offered


def _receive(s: socket.socket, fd: int, size: int, where: str, hashed: bool) -> str | None:
    """Exactly `size` bytes into `fd`; their digest, hashed as they arrive, when `hashed`."""
    os.ftruncate(fd, size)
    digest = digest_of(fd, size, hashed)
    buf = memoryview(bytearray(_CHUNK))
    got = 0
    try:
        while got < size:
            n = s.recv_into(buf, min(_CHUNK, size - got))
            if n == 0:
                raise ConnectionError(f"{where} closed after {got} of {size} bytes")
            got += os.pwrite(fd, buf[:n], got)
            digest.written(got)
    except BaseException:
        digest.close()
        raise
    return digest.hexdigest()


def host_copy(
    addr: tuple[str, int],
    name: str,
    key: str,
    stale: Callable[[str], bool],
    validate: Callable[[Path], None] | None = None,
    timeout_s: float = 60.0,
    size: int | None = None,
    digest: str | None = None,
) -> tuple[Path, int]:
    """This host's copy of file `name` served at `addr`: fetched by the first reader of the
    host while the others wait for it (a lock file per writer), validated (and checked against
    `size` and `digest`), then shared. The
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
        return dest, fetch_file(addr, name, dest, key, old[0] if old else None, timeout_s, validate, size, digest)
