"""One-copy safetensors files in shared memory (/dev/shm), read with no copy at all, in a
directory per run that outlives no crash.

safetensors' save_file builds the whole file as bytes first, and load_file copies it out
again (0.5-0.9 GB/s measured here). Here each tensor is copied straight into the file, and
reading maps it. Mappings are kept per file (inode) and reused: a tmpfs page costs a fault
the first time a process touches it through a mapping, which made a fresh mapping 5-10x
slower than memcpy; a version written into (or read from) a file mapped before runs at
memcpy speed.

Only torch and the standard library: vLLM's worker process imports this too.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import mmap
import os
import secrets
import shutil
import stat
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_FROM_NAME = {v: k for k, v in _DTYPES.items()}
# Mappings kept per process: a writer cycles through trainer.keep_versions (2 by default) + 2
# spare files. With more versions kept, the oldest mappings are remapped (slower), never wrong.
_MAX_MAPS = 4
# Each user's files go in a directory of its own right in /dev/shm (sticky, like /tmp: names
# in it are removed only by their owners): ROOT, 0700. Another user can take that name first
# (its own directory, a symlink); `user_root()` then takes a name nobody else can guess.
_BASE = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
ROOT = _BASE / f"forge-{os.geteuid()}"  # the usual root: `user_root()` is the one in use
_SHARED = _BASE / "forge"  # forge's earlier layouts: one parent for every user, run dirs in it
# The secret suffix of this user's root when ROOT is taken: in the user's home (0600), where
# no other user can read, write or block it, and every process of the user finds it.
_NAME_FILE = Path.home() / ".cache" / "forge" / "shm-name"
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeDirectoryError(RuntimeError):
    """A directory forge keeps private files in is not safe: a symlink, another user's, or
    writable by others."""


def _checked(d: Path, private: bool) -> Path:
    """`d` (lstat: never through a symlink) when it is a real directory of this user's that
    nobody else can write to (or a sticky one of root's or this user's, like /tmp);
    `private`: nobody else can enter it either."""
    st = os.lstat(d)
    mine = st.st_uid == os.geteuid()
    others = 0o077 if private else 0o022
    if stat.S_ISDIR(st.st_mode) and mine and not st.st_mode & others:
        return d
    if not private and stat.S_ISDIR(st.st_mode) and st.st_uid in (0, os.geteuid()) and st.st_mode & stat.S_ISVTX:
        return d  # shared like /tmp: writable by all, sticky
    what = "a symlink" if stat.S_ISLNK(st.st_mode) else f"owned by uid {st.st_uid}, mode {stat.filemode(st.st_mode)}"
    raise UnsafeDirectoryError(
        f"{d} is {what}: forge keeps weights and run files there only in a directory of its user's "
        f"(uid {os.geteuid()}) that no other user can write to{' or enter' if private else ''}; remove it"
    )


def is_safe_dir(d: Path, private: bool = False) -> bool:
    """Whether `d` still is a directory forge may keep this user's files in (`_checked`'s rule):
    one that vanished (systemd-logind's RemoveIPC at a logout, a cleanup) may be another user's now."""
    try:
        _checked(d, private)
    except (OSError, UnsafeDirectoryError):
        return False
    return True


def private_root(root: Path) -> Path:
    """`root`, made (0700) or checked, in a parent nobody else can rename it out of."""
    _checked(root.parent, private=False)
    with contextlib.suppress(FileExistsError):
        root.mkdir(mode=0o700)
    return _checked(root, private=True)


_USER_ROOT: Path | None = None


def user_root() -> Path:
    """This user's private directory for shared-memory files: ROOT, or where another user took
    that name, ROOT-<a secret suffix kept in _NAME_FILE>. Earlier layouts' dead runs are swept."""
    global _USER_ROOT
    if _USER_ROOT is None or not is_safe_dir(_USER_ROOT, private=True):
        try:
            _USER_ROOT = private_root(ROOT)
        except UnsafeDirectoryError as taken:
            _USER_ROOT = _suffixed_root(taken)
        _sweep_earlier_layouts()
    return _USER_ROOT


def _suffixed_root(taken: UnsafeDirectoryError) -> Path:
    """ROOT-<this user's secret suffix>, with a new suffix where another user took that name
    too: a suffix is no secret once its directory exists (every user lists /dev/shm), and after
    /dev/shm is cleared (a reboot) that user could make it first."""
    for _ in range(3):
        try:
            suffix = _secret_suffix()
        except OSError as e:
            raise UnsafeDirectoryError(f"{taken}; the name forge uses instead is kept in {_NAME_FILE}: {e}") from None
        try:
            return private_root(ROOT.with_name(f"{ROOT.name}-{suffix}"))
        except UnsafeDirectoryError as e:
            taken = e
            _replace_suffix(suffix)
    raise taken


def _replace_suffix(old: str) -> None:
    """A new secret suffix in place of `old`, unless another process of this user's made one first."""
    lock = os.open(_NAME_FILE.with_name(f".{_NAME_FILE.name}.lock"), os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _NAME_FILE.read_text().strip() == old:
            os.replace(_new_suffix_file(), _NAME_FILE)
    finally:
        os.close(lock)


def _secret_suffix() -> str:
    """This user's secret suffix, made once (the first of racing processes wins)."""
    with contextlib.suppress(FileNotFoundError):
        return _NAME_FILE.read_text().strip()
    _NAME_FILE.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = _new_suffix_file()
    with contextlib.suppress(FileExistsError):
        os.link(tmp, _NAME_FILE)
    tmp.unlink()
    return _NAME_FILE.read_text().strip()


def _new_suffix_file() -> Path:
    """A new secret suffix, in a file of this process's beside _NAME_FILE."""
    tmp = _NAME_FILE.with_name(f".{_NAME_FILE.name}.{os.getpid()}")
    fd = open_new(tmp)
    os.write(fd, secrets.token_hex(16).encode())
    os.close(fd)
    return tmp


def _sweep_earlier_layouts() -> None:
    """Remove this user's dead runs of forge's earlier layouts (_SHARED/run-*, then
    _SHARED/<uid>/run-*): their weight files would hold RAM until reboot. A _SHARED of another
    user's holds nothing of this user's (forge refused to write there)."""
    with contextlib.suppress(OSError, UnsafeDirectoryError):
        _checked(_SHARED, private=False)
        _sweep_unlocked_layout(_SHARED)
        sweep_dead_runs(_checked(_SHARED / str(os.geteuid()), private=True))


def _sweep_unlocked_layout(shared: Path) -> None:
    """Remove this user's run directories of forge's first layout (shared/run-<pid>-<start
    time>, alive while that process was)."""
    for d in shared.glob("run-*"):
        try:
            st = os.lstat(d)
        except FileNotFoundError:
            continue
        _, pid, start = (d.name.split("-") + ["", ""])[:3]
        mine = stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
        if mine and not (pid.isdigit() and _start_time(int(pid)) == start):
            shutil.rmtree(d, ignore_errors=True)


# ---- a directory per run ------------------------------------------------------------
# Weight files are RAM: a SIGKILLed run must not keep them until reboot. Each owner process
# holds a shared flock on its directory's `.owner` file for as long as it lives; the first
# `run_dir()` of any later process removes the directories nobody holds. A lock, not a pid:
# jobs in other pid namespaces (docker --ipc=host, a shared emptyDir) share /dev/shm too.
_HELD: dict[Path, int] = {}  # directory -> the fd of its `.owner` lock, open for this process's life
_GRACE_S = 60.0  # a directory with no `.owner` yet is being made (or predates locks) for this long


def _start_time(pid: int) -> str | None:
    """The start time of live process `pid` in clock ticks (None once it has exited): with the
    pid, a name no later process of this machine reuses."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if len(fields) < 20 or fields[0] in ("Z", "X") else fields[19]


def _claim_if_unowned(d: Path) -> int | None:
    """An fd holding `d`'s owner lock exclusively when nobody else holds it (-1: `d` has no
    lock file and is older than the grace period), else None. Held while `d` is removed: an
    owner that opened the lock meanwhile finds its file gone once it gets it, and remakes `d`."""
    try:
        fd = os.open(d / ".owner", os.O_RDONLY | _NOFOLLOW)
    except FileNotFoundError:
        try:
            return -1 if time.time() - os.lstat(d).st_mtime > _GRACE_S else None
        except FileNotFoundError:  # another process's sweep removed it first (a mesh's procs start together)
            return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def sweep_dead_runs(root: Path | None = None) -> list[Path]:
    """Remove the run directories (of `root`, default `user_root()`) whose owners have all
    exited; returns them."""
    root = user_root() if root is None else root
    dead = []
    for d in root.glob("run-*") if root.is_dir() else []:
        if d in _HELD or d.is_symlink() or not d.is_dir() or (fd := _claim_if_unowned(d)) is None:
            continue
        shutil.rmtree(d, ignore_errors=True)
        if fd >= 0:
            os.close(fd)
        dead.append(d)
    return dead


def _hold(d: Path) -> int | None:
    """A shared hold on `d`'s owner lock, made if need be; None if a sweeper removed it first."""
    with contextlib.suppress(FileExistsError):
        d.mkdir(mode=0o700)
    try:
        fd = os.open(d / ".owner", os.O_RDONLY | os.O_CREAT | _NOFOLLOW, 0o600)
    except FileNotFoundError:  # swept between the two calls
        return None
    fcntl.flock(fd, fcntl.LOCK_SH)
    with contextlib.suppress(FileNotFoundError):
        if os.path.samestat(os.fstat(fd), os.lstat(d / ".owner")):
            return fd
    os.close(fd)
    return None


_RUN_DIR: Path | None = None


def run_dir() -> Path:
    """This process's directory for shared-memory files (created, and dead runs swept, on
    first use). Pass it to the processes that write for this run (a WeightStore carries it)."""
    global _RUN_DIR
    if _RUN_DIR is None or not is_safe_dir(_RUN_DIR):
        _RUN_DIR = owned_dir(user_root())
    return _RUN_DIR


def owned_dir(root: Path, mode: int = 0o755, pid: int | None = None) -> Path:
    """root/run-<pid>-<start time>: a directory of process `pid`'s (default: this one), made
    after removing those nobody holds. This process holds it (with `pid`'s other processes
    that call this, e.g. the procs of one host agent) until it exits. The sandbox keeps its
    working directories this way too."""
    with contextlib.suppress(FileExistsError):
        root.mkdir(mode=0o755, parents=True)
    _checked(root, private=False)
    sweep_dead_runs(root)
    pid = os.getpid() if pid is None else pid
    d = root / f"run-{pid}-{_start_time(pid)}"
    if d in _HELD and not is_safe_dir(d):  # gone, and perhaps remade by another user
        os.close(_HELD.pop(d))
    while d not in _HELD:
        if (fd := _hold(d)) is not None:
            _HELD[d] = fd
    _checked(d, private=False).chmod(mode)
    return d


def remove_run_dir() -> None:
    """The end of this process's run: free every file in its directory."""
    global _RUN_DIR
    if _RUN_DIR is not None:
        for f in _RUN_DIR.glob("*"):
            forget_mapping(f)
        shutil.rmtree(_RUN_DIR, ignore_errors=True)
        with contextlib.suppress(KeyError):
            os.close(_HELD.pop(_RUN_DIR))
        _RUN_DIR = None


def open_new(path: str | Path, flags: int = os.O_WRONLY) -> int:
    """A new file of this user's only (0600), never through a symlink: a stale one of the same
    name is removed first."""
    Path(path).unlink(missing_ok=True)
    return os.open(path, flags | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)


@dataclass
class _Mapping:
    fd: int  # kept open to see (fstat) when the file is unlinked
    buf: torch.Tensor  # the whole file, mapped shared


_MAPS: dict[tuple[int, int, int], _Mapping] = {}  # (device, inode, size) -> mapping, most recent last


def _forget(key: tuple[int, int, int]) -> None:
    os.close(_MAPS.pop(key).fd)  # the memory goes when the last view of `buf` does


def _mapping(path: str | Path) -> torch.Tensor:
    # An unlinked file's pages live as long as a mapping does: drop those first.
    for key in [k for k, m in _MAPS.items() if os.fstat(m.fd).st_nlink == 0]:
        _forget(key)
    st = os.stat(path)
    key = (st.st_dev, st.st_ino, st.st_size)
    m = _MAPS.pop(key, None)
    if m is None:
        fd = os.open(path, os.O_RDWR | _NOFOLLOW)
        m = _Mapping(fd, torch.frombuffer(mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED), dtype=torch.uint8))
    _MAPS[key] = m
    while len(_MAPS) > _MAX_MAPS:
        _forget(next(iter(_MAPS)))
    return m.buf


def forget_mapping(path: str | Path) -> None:
    """Before unlinking a file: a kept mapping would keep its memory."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    key = (st.st_dev, st.st_ino, st.st_size)
    if key in _MAPS:
        _forget(key)


def _header(state_dict: dict[str, torch.Tensor]) -> tuple[dict, bytes, int]:
    header, offset = {}, 0
    for name, t in state_dict.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    return header, raw, offset


class FileDigest:
    """The digest of a file of `size` bytes: sha256 over the sha256s of its 32 MB chunks, each
    hashed by a thread (hashlib frees the GIL) from a read-only mapping (no copy) once
    `written` says it is in the file, so hashing runs beside the writing or receiving of later
    chunks. sha256 hashed 500 MB in 0.6 s on one core here (blake2b was slower); chunks spread
    that over the host's cores."""

    CHUNK = 32 << 20

    def __init__(self, fd: int, size: int):
        self.size, self.done, self.parts = size, 0, []
        self.map = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else b""
        self.pool = ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="forge-digest")

    def _part(self, start: int, end: int) -> bytes:
        with memoryview(self.map) as whole, whole[start:end] as part:
            return hashlib.sha256(part).digest()

    def written(self, upto: int) -> None:
        """Bytes [0, upto) of the file are final."""
        while upto - self.done >= self.CHUNK or (upto == self.size and self.done < upto):
            end = min(self.done + self.CHUNK, self.size)
            self.parts.append(self.pool.submit(self._part, self.done, end))
            self.done = end

    def hexdigest(self) -> str:
        """The digest, once every byte is written."""
        self.written(self.size)
        try:
            parts: list[Future] = self.parts
            return "sha256-chunks:" + hashlib.sha256(b"".join(f.result() for f in parts)).hexdigest()
        finally:
            self.close()

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)
        if self.size:
            self.map.close()


class NoDigest:
    """FileDigest's stand-in where no digest is wanted: nothing hashed, `hexdigest()` None."""

    def written(self, upto: int) -> None:
        pass

    def hexdigest(self) -> None:
        return None

    def close(self) -> None:
        pass


def digest_of(fd: int, size: int, hashed: bool) -> FileDigest | NoDigest:
    return FileDigest(fd, size) if hashed else NoDigest()


def file_digest(path: str | Path) -> str:
    """`FileDigest` of the file at `path`."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    try:
        return FileDigest(fd, os.fstat(fd).st_size).hexdigest()
    finally:
        os.close(fd)


def safetensors_size(state_dict: dict[str, torch.Tensor]) -> int:
    _, raw, data = _header(state_dict)
    return 8 + len(raw) + data


def write_safetensors(state_dict: dict[str, torch.Tensor], path: str | Path, hashed: bool = False) -> str | None:
    """Write `path` with one copy per tensor; returns its `FileDigest` when `hashed` (hashed
    while later tensors are written), else None. A file of the right size is overwritten in
    place through its kept mapping; a new one is written with plain writes (a fresh mapping of
    a new tmpfs file pays a fault per 4 KB page)."""
    header, raw, offset = _header(state_dict)
    size = 8 + len(raw) + offset
    head = len(raw).to_bytes(8, "little") + raw
    in_place = Path(path).exists() and os.path.getsize(path) == size
    buf = _mapping(path) if in_place else None
    with open(os.open(path, os.O_RDWR | _NOFOLLOW) if in_place else open_new(path, os.O_RDWR), "r+b") as f:
        f.truncate(size)  # the digest maps it whole
        digest = digest_of(f.fileno(), size, hashed)
        try:
            _write(f, buf, head, header, state_dict, digest)
        except BaseException:
            digest.close()
            raise
        return digest.hexdigest()


def _write(
    f, buf: torch.Tensor | None, head: bytes, header: dict, state_dict: dict, digest: FileDigest | NoDigest
) -> None:
    """The file's bytes: through `buf` (its kept mapping) when given, else with writes."""
    start = len(head)
    if buf is not None:
        buf[:start].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
    else:
        f.write(head)
        f.flush()  # in the file before any digest thread reads it (a state dict with no tensors: at once)
    for name, t in state_dict.items():
        a, b = header[name]["data_offsets"]
        if buf is not None:
            buf[start + a : start + b].copy_(t.detach().reshape(-1).contiguous().view(torch.uint8))
        else:
            f.write(memoryview(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy()))
            if isinstance(digest, FileDigest):
                f.flush()  # in the file, for the digest's threads to read
        digest.written(start + b)


def check_safetensors(path: str | Path) -> None:
    """A ValueError unless `path` is a whole safetensors file: its header parses and its
    tensors end where the file does."""
    with open(os.open(path, os.O_RDONLY | _NOFOLLOW), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        n = int.from_bytes(f.read(8), "little")
        try:
            header = json.loads(f.read(n)) if 8 + n <= size else None
            end = max((info["data_offsets"][1] for k, info in header.items() if k != "__metadata__"), default=0)
        except (AttributeError, TypeError, ValueError, KeyError, IndexError):
            end = None
    if end is None or 8 + n + end != size:
        raise ValueError(f"{path} is not a whole safetensors file ({size} bytes; its header says otherwise)")


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors that view the file through a kept shared mapping (no copy): they change if the
    file is rewritten, so copy what must outlive the version (`WeightStore.fetch` does)."""
    buf = _mapping(path)
    n = int.from_bytes(buf[:8].numpy().tobytes(), "little")
    header = json.loads(buf[8 : 8 + n].numpy().tobytes())
    start = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        raw = buf[start + a : start + b]
        dtype = _FROM_NAME[info["dtype"]]
        if (start + a) % dtype.itemsize:
            raw = raw.clone()  # misaligned for its dtype (after an odd-sized tensor): copy this one
        out[name] = raw.view(dtype).view(info["shape"])
    return out
