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
import hashlib
import hmac
import ipaddress
import logging
import math
import os
import resource
import secrets
import select
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from forge import delta
from forge.shm import FileDigest, digest_of, open_new, owned_dir, user_root

_SIZE = struct.Struct("<q")  # the answer's header: the file's size, -1 when there is no such file
_PIPE = 1 << 20  # bytes per splice: the largest pipe an unprivileged user may ask for
_REQUEST_DEADLINE_S = 5.0  # for a request's key from its connection, then for the rest at its worker
_MAX_NAME = 256
# Connections whose keys are read at once, at most (a quarter of the process's fds; a quarter of
# that from one address: see _Gate), and the kernel's queue of connections not yet taken.
_GATE_MAX = 1024
_BACKLOG = 1024
_TIMEOUT_S = 60.0  # a reader's longest wait for a server's next bytes, by default
# The slowest a transfer may average: `timeout_s` bounds each wait, this the whole, so a server
# (or link) trickling a byte per wait cannot hold a reader, and through the host's writer lock its
# other readers, for ever. A link this slow already takes minutes per GB; real ones run 100x faster.
_MIN_RATE = 2 << 20  # bytes per second
_LOCK_POLL_S = 0.02  # between tries of a busy writer lock: small beside a fetch
# The server's longest wait for a reader to take its next bytes; a send as a whole is cut off as a
# reader's receive is (this wait plus the size at _MIN_RATE), so a reader that takes a trickle
# within each wait (a peer that saw a request's key) frees its worker then.
_SEND_WAIT_S = 60.0
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
    a space, a file name and a newline: the key within 5 s of the connection (read, and checked,
    before anything else), the rest within 5 s of a worker taking it; the answer the file's size (8 bytes) and its bytes (size -1: no such file,
    or a wrong key). Binds `host` ("0.0.0.0": every interface), port chosen by the kernel;
    `addr` is the IP readers are to connect to, pinned here (for "0.0.0.0", the first
    non-loopback address this host's name resolves to here) so no reader resolves a name
    later. Every connection is taken at once and its key read by the accept loop; only a
    connection with the key goes to one of `workers` threads (the others queue for one)."""

    def __init__(self, directory: str | Path, host: str = "127.0.0.1", key: str = "", workers: int = 8):
        self.directory = Path(directory)
        self.key = key or secrets.token_hex(16)
        try:
            self.sock = socket.create_server((host, 0), backlog=_BACKLOG)
            ip, port = self.sock.getsockname()[:2]
            self.addr = (_host_ip(self.sock.family) if ipaddress.ip_address(ip).is_unspecified else ip, port)
        except OSError as e:
            raise ValueError(f"cannot serve weights on {host!r} (trainer.serve_weights_on): {e}") from None
        self.sock.setblocking(False)
        self.requests, self.refused, self.closed = 0, 0, False
        self._deltas: dict[tuple[str, str], bytes | None] = {}
        self._deltas_lock = threading.Lock()
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="forge-weights-send")
        # Made here, not in the loop's thread: when that runs, the process may be out of fds.
        selector, gate = selectors.DefaultSelector(), _Gate()
        selector.register(self.sock, selectors.EVENT_READ)
        threading.Thread(target=self._accept, args=(selector, gate), daemon=True, name="forge-weights-server").start()

    def _accept(self, selector: selectors.BaseSelector, gate: _Gate) -> None:
        """Takes connections and reads their keys, without a worker: a peer without the key (one
        that sends nothing, or trickles) holds a socket until its deadline, never a worker or
        the kernel's backlog, so readers with the key get in however many such peers come."""
        with selector:
            try:
                self._gate_loop(selector, gate)
            finally:
                for conn in list(gate.waiting):
                    _close(selector, gate.leave(conn))

    def _gate_loop(self, selector: selectors.BaseSelector, gate: _Gate) -> None:
        while not self.closed:
            for conn in gate.expired():
                _close(selector, conn)
            try:
                ready = selector.select(gate.wait())
            except OSError:
                return  # closed
            # Reads first: a connection taken in this batch may push out one whose read is in it.
            for event, _ in sorted(ready, key=lambda e: e[0].fileobj is self.sock):
                try:
                    if event.fileobj is self.sock:
                        self._take(selector, gate)
                    elif event.fileobj in gate.waiting:
                        self._read_key(selector, gate, event.fileobj)
                except Exception:  # one connection's surprise must not end the server, and weight sync
                    log.exception("forge: weights server: a connection failed")

    def _take(self, selector: selectors.BaseSelector, gate: _Gate) -> None:
        try:
            conn, peer = self.sock.accept()
        except BlockingIOError:
            return
        except OSError as e:
            if not self.closed:  # e.g. EMFILE: the connection waits in the backlog; weight sync must not stop
                log.warning("forge: weights server: accept failed (%s); retrying", e)
                time.sleep(0.1)
            return
        conn.setblocking(False)
        selector.register(conn, selectors.EVENT_READ)
        for out in gate.admit(conn, peer[0]):
            _close(selector, out)

    def _read_key(self, selector: selectors.BaseSelector, gate: _Gate, conn: socket.socket) -> None:
        """The connection's next bytes: once its key is whole, a worker serves it, or it is
        refused (answered -1, then dropped at the end of its request)."""
        opening = f"{wire_key(self.key)} ".encode()  # what a request with the key starts with
        try:
            chunk = conn.recv(len(opening) + _MAX_NAME)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        request = gate.read(conn, chunk)
        if request.refused or len(request.data) < len(opening):
            if not chunk or len(request.data) > len(opening) + _MAX_NAME or (request.refused and b"\n" in chunk):
                _close(selector, gate.leave(conn))  # closing before the newline would reset the -1
            return
        self.requests += 1
        if hmac.compare_digest(bytes(request.data[: len(opening)]), opening):
            selector.unregister(gate.leave(conn))
            self.pool.submit(self._serve, conn, bytes(request.data[len(opening) :]))
            return
        self.refused += 1
        request.refused = True
        with contextlib.suppress(OSError):
            conn.send(_SIZE.pack(-1))
        if b"\n" in request.data:
            _close(selector, gate.leave(conn))

    def _serve(self, conn: socket.socket, head: bytes) -> None:
        with conn, contextlib.suppress(OSError):
            conn.setblocking(True)
            # The rest of the request gets its own deadline: it may have queued for a worker.
            name = _recv_until(conn, _MAX_NAME, time.monotonic() + _REQUEST_DEADLINE_S, end=b"\n", data=head)
            self._send(conn, name.decode(errors="replace").strip())

    def _send(self, conn: socket.socket, request: str) -> None:
        name, _, base = request.partition(" ")
        if not all(_servable(n) for n in (name, base or name)):
            conn.sendall(_SIZE.pack(-1))
            return
        conn.settimeout(_SEND_WAIT_S)  # a reader with the key that stalls does not hold a worker forever
        if base:
            payload = self._delta(base, name)
            answer = _SIZE.pack(-1 if payload is None else len(payload)) + (payload or b"")
            conn.settimeout(_SEND_WAIT_S + len(answer) / _MIN_RATE)  # sendall's timeout bounds the whole
            conn.sendall(answer)
            return
        try:
            fd = os.open(self.directory / name, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            conn.sendall(_SIZE.pack(-1))
            return
        with open(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            conn.sendall(_SIZE.pack(size))
            _sendfile(conn, f.fileno(), size, _deadline(_SEND_WAIT_S, size))

    def _delta(self, base: str, target: str) -> bytes | None:
        """The delta from file `base` to file `target`, made once for every host that asks
        (None: either file is gone, or a delta would not be smaller)."""
        with self._deltas_lock:
            if (base, target) not in self._deltas:
                try:
                    made = delta.make(self.directory / base, self.directory / target, self.key)
                except OSError:
                    made = None
                # A file is renamed away before it is rewritten: both names still there, both read whole.
                intact = (self.directory / base).exists() and (self.directory / target).exists()
                self._deltas = {k: v for k, v in self._deltas.items() if k[1] == target}  # older versions' go
                self._deltas[base, target] = made if intact else None
            return self._deltas[base, target]

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept loop (close alone does not)
        self.sock.close()
        self.pool.shutdown(wait=False)


@dataclass
class _Request:
    deadline: float
    peer: str
    data: bytearray = field(default_factory=bytearray)
    refused: bool = False


class _Gate:
    """The connections whose keys are being read, oldest first. Each has the request deadline;
    past `most` in all, or a quarter of that from one address, the oldest goes: peers without
    the key hold sockets (fds of the trainer's process) only so far, and a reader, who sends
    its key at once, gets in unless that many connections come after it within its round trip."""

    def __init__(self) -> None:
        self.waiting: dict[socket.socket, _Request] = {}
        self.most = max(min(_GATE_MAX, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4), 1)
        self.per_peer = max(self.most // 4, 1)

    def admit(self, conn: socket.socket, peer: str) -> list[socket.socket]:
        """`conn` let in; the connections it pushes out."""
        out = []
        mine = [c for c, r in self.waiting.items() if r.peer == peer]
        if len(mine) >= self.per_peer:
            out.append(self.leave(mine[0]))
        if len(self.waiting) >= self.most:
            out.append(self.leave(next(iter(self.waiting))))
        self.waiting[conn] = _Request(time.monotonic() + _REQUEST_DEADLINE_S, peer)
        return out

    def read(self, conn: socket.socket, chunk: bytes) -> _Request:
        request = self.waiting[conn]
        request.data += chunk
        return request

    def leave(self, conn: socket.socket) -> socket.socket:
        del self.waiting[conn]
        return conn

    def expired(self) -> list[socket.socket]:
        now = time.monotonic()
        return [self.leave(c) for c, r in list(self.waiting.items()) if r.deadline <= now]

    def wait(self) -> float:
        """Seconds until the next deadline (at most 1: the loop checks `closed` that often)."""
        first = min((r.deadline for r in self.waiting.values()), default=math.inf)
        return min(max(first - time.monotonic(), 0.0), 1.0)


def _close(selector: selectors.BaseSelector, conn: socket.socket) -> None:
    with contextlib.suppress(KeyError, ValueError):
        selector.unregister(conn)
    conn.close()


def wire_key(key: str) -> str:
    """What a reader sends to open the server: derived from the run's key, which never travels,
    so whoever sees a request (a server at the wrong address) still cannot tag a delta."""
    return hmac.new(key.encode(), b"forge-weights-request", hashlib.sha256).hexdigest()


def _servable(name: str) -> bool:
    return "/" not in name and name.endswith(".safetensors")


def _where(addr: tuple[str, int]) -> str:
    return f"weights server {addr[0]}:{addr[1]}"


def _named(e: OSError, what: str) -> OSError:
    """`e` as the same kind of error, saying what failed (a bare "timed out" names nothing)."""
    return type(e)(e.errno, f"{what}: {e.strerror}") if e.errno else type(e)(f"{what}: {e}")


def _sendfile(conn: socket.socket, fd: int, size: int, deadline: float) -> None:
    """`size` bytes of file `fd` to `conn` (non-blocking: it has a timeout), each wait at most
    _SEND_WAIT_S, all by `deadline`; TimeoutError if not. A file that shrank ends it early: the
    reader finds the answer short."""
    sent = 0
    while sent < size:
        left = deadline - time.monotonic()
        if left <= 0 or not _ready(conn, select.POLLOUT, min(_SEND_WAIT_S, left)):
            raise TimeoutError(f"a weights reader took {sent} of {size} bytes by the send's deadline")
        try:
            n = os.sendfile(conn.fileno(), fd, sent, size - sent)
        except BlockingIOError:
            continue
        if n == 0:
            return
        sent += n


def _host_ip(family: int) -> str:
    """This host's address for readers of other hosts: the first non-loopback one its name
    resolves to (a machine alone: loopback)."""
    ips = [i[4][0] for i in socket.getaddrinfo(socket.gethostname(), None, family, socket.SOCK_STREAM)]
    return next((ip for ip in ips if not ipaddress.ip_address(ip).is_loopback), ips[0])


def _recv_until(conn: socket.socket, most: int, deadline: float, end: bytes = b"", data: bytes = b"") -> bytes:
    """`most` bytes (fewer if `end` comes first), `data` first, then those that arrive before
    `deadline`; TimeoutError or ConnectionError if they do not."""
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


def _ask(addr: tuple[str, int], request: str, key: str, timeout_s: float) -> tuple[socket.socket, int]:
    """A connection to the FileServer at `addr` (an IP: a name resolved now could lead anywhere)
    that has answered `request` (`key` opens it): the socket and the size it offers; closed and
    FileNotFoundError if the server has nothing for it (or refused the key)."""
    try:
        ipaddress.ip_address(addr[0])
    except ValueError:
        raise ValueError(
            f"weights server address {addr[0]!r} is not an IP address: readers go only where the writer pinned"
        ) from None
    where = _where(addr)
    owner = _loopback_owner(addr)
    if owner is not None and owner != os.geteuid():
        raise ConnectionError(
            f"{where} is another user's (uid {owner}) for {request}: the writer's server is gone and its port taken"
        )
    try:
        s = socket.create_connection(tuple(addr), timeout=timeout_s)
    except OSError as e:
        raise _named(e, f"{where} could not be reached for {request}") from None
    try:
        try:
            s.sendall(f"{wire_key(key)} {request}\n".encode())
            header = s.recv(_SIZE.size, socket.MSG_WAITALL)
        except OSError as e:
            raise _named(e, f"{where} did not answer for {request}") from None
        if len(header) < _SIZE.size:
            raise ConnectionError(f"{where} closed before answering for {request}")
        (offered,) = _SIZE.unpack(header)
        if offered < 0:
            raise FileNotFoundError(f"{where} has no file {request} (or refused the key)")
    except BaseException:
        s.close()
        raise
    return s, offered


def _loopback_owner(addr: tuple[str, int]) -> int | None:
    """The uid of the socket listening on loopback `addr`'s port (Linux's /proc/net/tcp*), None
    beyond loopback or where there is none to read. On loopback, versions carry no digest: the
    port is the writer's, unless its server is gone and another local user took the port."""
    if not ipaddress.ip_address(addr[0]).is_loopback:
        return None
    port = f":{addr[1]:04X}"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[1].endswith(port) and fields[3] == "0A":  # 0A: listening
                    return int(fields[7])
    return None


def fetch_file(
    addr: tuple[str, int],
    name: str,
    dest: Path,
    key: str,
    reuse: Path | None = None,
    timeout_s: float = _TIMEOUT_S,
    validate: Callable[[Path], None] | None = None,
    size: int | None = None,
    digest: str | None = None,
) -> int:
    """Stream file `name` from the FileServer at `addr` (`key` opens it) into `dest`, whole or
    not at all: `validate(the temporary file)` runs, and the file's `FileDigest` must be
    `digest` (its version record's; hashed as it arrives), before it takes `dest`'s name, so
    no other reader can map a copy that fails either. A server offering other than `size` bytes
    is refused before any is read. Written into the file `reuse` when given (its tmpfs pages
    exist: writing runs at memcpy speed, where a new file pays for each page, measured 2x
    slower over loopback). Returns its size; FileNotFoundError if the server has no such file
    or refused the key."""
    where = _where(addr)

    def receive(fd: int) -> str | None:
        s, offered = _ask(addr, name, key, timeout_s)
        with s:
            if size is not None and offered != size:
                raise ValueError(f"{where} offered {offered} bytes for {name}; its version record says {size}")
            return _receive(s, fd, offered, where, digest is not None, _deadline(timeout_s, offered))

    return _into(dest, reuse, receive, validate, digest, f"{name} from {where}")


def fetch_delta(
    addr: tuple[str, int],
    name: str,
    base: Path,
    dest: Path,
    key: str,
    digest: str,
    reuse: Path | None = None,
    timeout_s: float = _TIMEOUT_S,
    validate: Callable[[Path], None] | None = None,
) -> int:
    """File `name` into `dest` as `base` (a copy this host holds of an older version) changed
    by the delta the FileServer at `addr` makes between the two (`forge.delta`): applied only
    if the delta carries `key`'s tag and names `base` and `name`, and taking `dest`'s name only
    once the result's `FileDigest` is `digest` and `validate` passes, as a whole fetch would.
    Returns the delta's size; FileNotFoundError if the server has no delta to offer (no such
    base any more, or a delta would not be smaller), DeltaError or ValueError if it is refused."""
    where = _where(addr)
    s, offered = _ask(addr, f"{name} {base.name}", key, timeout_s)
    with s:
        if offered > os.path.getsize(base):
            raise delta.DeltaError(f"{where} offered a delta of {offered} bytes, more than the file it changes")
        payload = _recv_exactly(s, offered, where, _deadline(timeout_s, offered))

    def write(fd: int) -> str:
        os.ftruncate(fd, os.path.getsize(base))  # the size the digest maps
        hashed = FileDigest(fd, os.path.getsize(base))
        try:
            delta.apply(payload, key, base, name, fd, hashed.written)
        except BaseException:
            hashed.close()
            raise
        return hashed.hexdigest()

    _into(dest, reuse, write, validate, digest, f"{name} from {where} (a delta from {base.name})")
    return offered


def _into(
    dest: Path,
    reuse: Path | None,
    write: Callable[[int], str | None],
    validate: Callable[[Path], None] | None,
    digest: str | None,
    what: str,
) -> int:
    """`write(fd)` a temporary file (the file `reuse`, or a new one) that takes `dest`'s name
    only once `validate` passes and the digest `write` returns is `digest` (where given); the
    temporary file goes on any error. Returns the file's size."""
    tmp = dest.with_name(dest.name + f".{os.getpid()}.tmp")
    if reuse is not None:
        os.replace(reuse, tmp)  # first: a reader still on it sees its name gone
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_NOFOLLOW) if reuse is not None else open_new(tmp, os.O_RDWR)
        try:
            got = write(fd)
        finally:
            os.close(fd)
        if validate is not None:
            validate(tmp)
        if digest is not None and got != digest:
            raise ValueError(f"{what} does not match the digest of its version record: not the writer's file")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, dest)
    return os.path.getsize(dest)


def _deadline(timeout_s: float, size: int) -> float:
    """When a transfer of `size` bytes starting now is cut off: at _MIN_RATE, plus one wait."""
    return time.monotonic() + timeout_s + size / _MIN_RATE


def _past(where: str, got: int, size: int) -> TimeoutError:
    rate = f"{_MIN_RATE / 2**20:g} MB/s"
    return TimeoutError(f"{where} sent {got} of {size} bytes by the transfer's deadline: slower than {rate}")


def _recv_exactly(s: socket.socket, size: int, where: str, deadline: float) -> bytearray:
    """`size` bytes from `s`, each wait at most its timeout, all by `deadline`."""
    payload, got, timeout = bytearray(size), 0, s.gettimeout()
    while got < size:  # a socket with a timeout returns what has come, MSG_WAITALL or not
        left = deadline - time.monotonic()
        if left <= 0:
            raise _past(where, got, size)
        s.settimeout(left if timeout is None else min(timeout, left))
        try:
            n = s.recv_into(memoryview(payload)[got:])
        except TimeoutError:
            if time.monotonic() < deadline:
                raise  # no bytes for its timeout
            raise _past(where, got, size) from None
        if n == 0:
            raise ConnectionError(f"{where} closed after {got} of the delta's {size} bytes")
        got += n
    return payload


def _receive(s: socket.socket, fd: int, size: int, where: str, hashed: bool, deadline: float) -> str | None:
    """Exactly `size` bytes into `fd`, by `deadline`; their digest, hashed as they arrive, when
    `hashed`. Spliced (socket -> pipe -> file): the kernel copies each byte once, into the file's
    pages, where a receive into a buffer and a write from it copy twice (measured 1.8x slower)."""
    os.ftruncate(fd, size)
    digest = digest_of(fd, size, hashed)
    r, w = os.pipe()
    try:
        with contextlib.suppress(OSError):  # a smaller pipe only costs more calls
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, _PIPE)
        got = 0
        while got < size:
            n = _splice_in(s, w, min(_PIPE, size - got), deadline)
            if n is None:
                raise _past(where, got, size)
            if n == 0:
                raise ConnectionError(f"{where} closed after {got} of {size} bytes")
            while n:
                moved = os.splice(r, fd, n, offset_dst=got)
                got, n = got + moved, n - moved
            digest.written(got)
    except BaseException:
        digest.close()
        raise
    finally:
        os.close(r)
        os.close(w)
    return digest.hexdigest()


def _splice_in(s: socket.socket, pipe: int, most: int, deadline: float) -> int | None:
    """Up to `most` bytes from `s` into `pipe`, waiting at most `s`'s timeout for the first (its
    fd is non-blocking: Python's timeout is a poll around each call); None once `deadline` is past."""
    while True:
        try:
            return os.splice(s.fileno(), pipe, most, flags=os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK)
        except BlockingIOError:
            timeout, left = s.gettimeout(), deadline - time.monotonic()
            if timeout is not None and timeout < left:
                if not _readable(s, timeout):
                    raise TimeoutError(f"no weights bytes for {timeout} s") from None
            elif left <= 0 or not _readable(s, left):
                return None


def _readable(s: socket.socket, wait_s: float) -> bool:
    """Whether `s` has bytes to read within `wait_s`."""
    return _ready(s, select.POLLIN, wait_s)


def _ready(s: socket.socket, event: int, wait_s: float) -> bool:
    """Whether `s` is ready for `event` (POLLIN, POLLOUT) within `wait_s`."""
    waiting = select.poll()  # not select.select: a generator's process holds fds past its 1024
    waiting.register(s, event)
    return bool(waiting.poll(1000 * wait_s))


def host_copy(
    addr: tuple[str, int],
    name: str,
    key: str,
    stale: Callable[[str], bool],
    validate: Callable[[Path], None] | None = None,
    timeout_s: float = _TIMEOUT_S,
    size: int | None = None,
    digest: str | None = None,
    deltas: bool = False,
) -> tuple[Path, int]:
    """This host's copy of file `name` served at `addr`: fetched by the first reader of the
    host while the others wait for it (a lock file per writer), validated (and checked against
    `size` and `digest`), then shared. With `deltas` (and a `digest` to check the result
    against), a host holding an older version's copy fetches the difference from it first
    (`fetch_delta`), the whole file where the server has no delta or it is refused. The
    copies whose names `stale` says are no longer read, and the files of readers killed
    mid-fetch, go: the oldest is rewritten as the new one, the rest are removed; with none, the
    writer's spare (`reserve`) is written. Returns the path and the bytes this call moved (0:
    another reader had it)."""
    directory = host_cache_dir()
    dest = directory / name
    writer = name.rsplit("-v", 1)[0]  # <store>-<writer token>
    with _writer_lock(directory, writer, _lock_wait_s(timeout_s, size)):
        if dest.exists():
            return dest, 0
        held = _copies(directory, writer)
        older = [p for p in held if version_of(p.name) < version_of(name)]
        base = older[-1] if older and deltas and digest else None
        old = sorted((p for p in held if stale(p.name) and p != base), key=os.path.getmtime)
        old += _leftovers(directory, writer)  # a killed reader's: no later fetch would remove them
        for p in old[1:]:
            p.unlink(missing_ok=True)
        spare = _spare(directory, writer)
        reuse = old[0] if old else (spare if spare.exists() else None)
        moved = _fetch(addr, name, dest, key, base, reuse, timeout_s, validate, size, digest)
        if len(_copies(directory, writer)) >= 2:  # the next version rewrites the older copy
            spare.unlink(missing_ok=True)
        else:  # the next version finds no stale copy either
            args = (writer, os.path.getsize(dest))
            threading.Thread(target=reserve, args=args, name=f"forge-reserve-{writer}", daemon=True).start()
        return dest, moved


def _fetch(addr, name, dest, key, base, reuse, timeout_s, validate, size, digest) -> int:
    """A delta from `base` where there is one (and it is accepted), else the whole file."""
    if base is not None:
        try:
            return fetch_delta(addr, name, base, dest, key, digest, reuse, timeout_s, validate)
        except FileNotFoundError:
            pass  # no delta to offer: the whole file
        except (ValueError, OSError) as e:  # DeltaError is a ValueError; a cut or stalled connection an OSError
            log.warning("forge: weights: a delta for %s was refused (%s); fetching the whole file", name, e)
        reuse = reuse if reuse is not None and reuse.exists() else None  # an attempt that wrote it removed it
    return fetch_file(addr, name, dest, key, reuse, timeout_s, validate, size, digest)


def reserve(writer: str, size: int) -> bool:
    """Allocate this host's spare file for `writer`'s versions (`size` bytes of tmpfs pages)
    now, off the path of any version: a version written into a new file pays for each page as
    it arrives, at about half the link's speed. Skipped while the host holds two copies (the
    next version rewrites the older) or a spare of that size already. Returns whether it
    allocated one; where it cannot (a full /dev/shm, a fetch holding the writer's lock too
    long), it says so and the run goes on: a version then goes into a new file, which may
    itself fail, with its own error."""
    directory = host_cache_dir()
    try:
        with _writer_lock(directory, writer, _lock_wait_s(_TIMEOUT_S, size)):
            return _allocate(directory, writer, size)
    except TimeoutError as e:
        log.warning("forge: weights: no spare ahead of %s's versions in %s (%s)", writer, directory, e)
        return False


def _allocate(directory: Path, writer: str, size: int) -> bool:
    spare = _spare(directory, writer)
    if len(_copies(directory, writer)) >= 2 or (spare.exists() and spare.stat().st_size == size):
        return False
    tmp = spare.with_name(spare.name + f".{os.getpid()}.tmp")
    fd = open_new(tmp, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        log.warning(
            "forge: weights: no room for %d bytes ahead of %s's versions in %s (%s)", size, writer, directory, e
        )
        return False
    finally:
        os.close(fd)
    os.replace(tmp, spare)
    return True


def _lock_wait_s(timeout_s: float, size: int | None) -> float:
    """How long a reader waits for another's fetch of the same writer: the longest that takes (a
    delta, then the whole file; each a connection, an answer and a transfer, each cut off)."""
    return 2 * (3 * timeout_s + (size or 0) / _MIN_RATE)


@contextlib.contextmanager
def _writer_lock(directory: Path, writer: str, wait_s: float) -> Iterator[None]:
    """The host's readers of one writer, one at a time (a lock file per writer); TimeoutError
    after `wait_s`: a holder's transfers are cut off at their deadlines, but nothing in flock's
    own wait would ever end one that hung elsewhere."""
    path = directory / f"{writer}.lock"
    with open(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)) as lock:
        deadline = time.monotonic() + wait_s
        while not _try_lock(lock.fileno()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"another reader of this host has held {path} for over {wait_s:.0f} s")
            time.sleep(_LOCK_POLL_S)
        yield


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _copies(directory: Path, writer: str) -> list[Path]:
    """The host's copies of `writer`'s versions, oldest version first."""
    return sorted(directory.glob(f"{writer}-v*.safetensors"), key=lambda p: version_of(p.name))


def _spare(directory: Path, writer: str) -> Path:
    return directory / f"{writer}-spare.safetensors"


def _leftovers(directory: Path, writer: str) -> list[Path]:
    """The temporary files (`<file>.<pid>.tmp`) of `writer`'s copies and spare that readers
    killed mid-fetch left: model-sized, and no later fetch's (their pid is in the name). Call
    it under the writer's lock, where no fetch of this writer is live on the host."""
    return [p for p in directory.glob(f"{writer}-*.tmp") if _writer_of(p.name.rsplit(".", 2)[0]) == writer]


def _writer_of(name: str) -> str:
    """The writer of a copy's or a spare's file (<writer>-v<N>.safetensors, <writer>-spare.safetensors)."""
    return name.removesuffix("-spare.safetensors") if name.endswith("-spare.safetensors") else name.rsplit("-v", 1)[0]


def version_of(name: str) -> int:
    """The version a weights file's name (<store>-<writer token>-v<N>.safetensors) holds."""
    return int(name.rsplit("-v", 1)[1].split(".")[0])
