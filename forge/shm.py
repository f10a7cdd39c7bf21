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
import json
import mmap
import os
import shutil
import stat
import time
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
# Shared by every user of the machine, like /tmp; each user's files go below in ROOT, 0700.
_SHARED = Path("/dev/shm/forge") if os.path.isdir("/dev/shm") else Path("/tmp/forge-shm")
ROOT = _SHARED / str(os.geteuid())
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeDirectoryError(RuntimeError):
    """A directory forge keeps private files in is not safe: a symlink, another user's, or
    writable by others."""


def _checked(d: Path, private: bool) -> Path:
    """`d` (lstat: never through a symlink) when it is a real directory of this user's (or
    root's, for a shared parent) that nobody else can write to; `private`: nobody else can
    enter it either."""
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


def private_root(root: Path = ROOT) -> Path:
    """`root`, made (0700, in a sticky world-writable parent shared by users) or checked."""
    if root.parent == _SHARED:
        with contextlib.suppress(FileExistsError):
            _SHARED.mkdir(parents=True)
        st = os.lstat(_SHARED)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
            _SHARED.chmod(0o1777)  # other users make their own directories in it
        _checked(_SHARED, private=False)
        _sweep_unlocked_layout(_SHARED)
    with contextlib.suppress(FileExistsError):
        root.mkdir(mode=0o700)
    return _checked(root, private=root.parent == _SHARED)


def _sweep_unlocked_layout(shared: Path) -> None:
    """Remove this user's run directories of forge's earlier layout (shared/run-<pid>-<start
    time>, alive while that process was): weight files of a crashed run there would hold RAM
    until reboot, and nothing else sweeps them now."""
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
        return -1 if time.time() - os.lstat(d).st_mtime > _GRACE_S else None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def sweep_dead_runs(root: Path = ROOT) -> list[Path]:
    """Remove the run directories whose owners have all exited; returns them."""
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
    fd = os.open(d / ".owner", os.O_RDONLY | os.O_CREAT | _NOFOLLOW, 0o600)
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
    if _RUN_DIR is None or not _RUN_DIR.is_dir():
        _RUN_DIR = owned_dir(private_root(ROOT))
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


def safetensors_size(state_dict: dict[str, torch.Tensor]) -> int:
    _, raw, data = _header(state_dict)
    return 8 + len(raw) + data


def write_safetensors(state_dict: dict[str, torch.Tensor], path: str | Path) -> None:
    """Write `path` with one copy per tensor. A file of the right size is overwritten in place
    through its kept mapping; a new one is written with plain writes (a fresh mapping of a
    new tmpfs file pays a fault per 4 KB page)."""
    header, raw, offset = _header(state_dict)
    size = 8 + len(raw) + offset
    if Path(path).exists() and os.path.getsize(path) == size:
        buf = _mapping(path)
        buf[: 8 + len(raw)].copy_(torch.frombuffer(bytearray(len(raw).to_bytes(8, "little") + raw), dtype=torch.uint8))
        start = 8 + len(raw)
        for name, t in state_dict.items():
            a, b = header[name]["data_offsets"]
            buf[start + a : start + b].copy_(t.detach().reshape(-1).contiguous().view(torch.uint8))
        return
    with open(open_new(path), "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for t in state_dict.values():
            f.write(memoryview(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy()))


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
