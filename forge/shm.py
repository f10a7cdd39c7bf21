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

import json
import mmap
import os
import shutil
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
_MAX_MAPS = 4  # a writer cycles through keep_versions + 2 spare files
ROOT = Path("/dev/shm/forge") if os.path.isdir("/dev/shm") else Path("/tmp/forge-shm")


# ---- a directory per run ------------------------------------------------------------
# Weight files are RAM: a SIGKILLed run must not keep them until reboot. Each controller
# process owns ROOT/run-<pid>-<start time>; the first `run_dir()` of any later process
# removes the directories whose owner is gone (the start time tells a reused pid apart).


def _start_time(pid: int) -> str | None:
    """The start time of live process `pid` (None once it has exited, zombies included)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # field 3: the state (a killed child its parent has not reaped yet is a zombie, "Z");
    # field 22: the start time in clock ticks
    return None if len(fields) < 20 or fields[0] in ("Z", "X") else fields[19]


def _owner_alive(d: Path) -> bool:
    _, pid, start = (d.name.split("-") + ["", ""])[:3]
    return pid.isdigit() and _start_time(int(pid)) == start


def sweep_dead_runs(root: Path = ROOT) -> list[Path]:
    """Remove the run directories whose owner process has exited; returns them."""
    dead = [d for d in root.glob("run-*") if d.is_dir() and not _owner_alive(d)]
    for d in dead:
        shutil.rmtree(d, ignore_errors=True)
    return dead


_RUN_DIR: Path | None = None


def run_dir() -> Path:
    """This process's directory for shared-memory files (created, and dead runs swept, on
    first use). Pass it to the processes that write for this run (a WeightStore carries it)."""
    global _RUN_DIR
    if _RUN_DIR is None or not _RUN_DIR.is_dir():
        _RUN_DIR = owned_dir(ROOT)
    return _RUN_DIR


def owned_dir(root: Path, mode: int = 0o755, pid: int | None = None) -> Path:
    """root/run-<pid>-<start time>: a directory of process `pid`'s (default: this one), made
    after removing those of processes that are gone (the sandbox keeps its working
    directories this way too)."""
    sweep_dead_runs(root)
    pid = os.getpid() if pid is None else pid
    d = root / f"run-{pid}-{_start_time(pid)}"
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(mode)
    return d


def remove_run_dir() -> None:
    """The end of this process's run: free every file in its directory."""
    global _RUN_DIR
    if _RUN_DIR is not None:
        for f in _RUN_DIR.glob("*"):
            forget_mapping(f)
        shutil.rmtree(_RUN_DIR, ignore_errors=True)
        _RUN_DIR = None


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
        fd = os.open(path, os.O_RDWR)
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
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for t in state_dict.values():
            f.write(memoryview(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy()))


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
