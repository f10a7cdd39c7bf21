"""Versioned policy weights on TorchStore (`WeightStore`), and the adapter that makes
torchstore 0.1.2 usable on Monarch 0.7.

Import it (not `torchstore` directly) in every process that touches the store: a
generator that calls `torchstore.get` unpickles a Controller handle, and Monarch
re-checks the class there too.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torchstore  # noqa: F401  (its import sets HYPERACTOR_CODEC_MAX_FRAME_LENGTH for big frames)
from monarch.actor import endpoint
from torchstore.controller import Controller


def _make_controller_endpoints_async() -> None:
    # Why: torchstore 0.1.2 targets Monarch 0.1.2; its Controller mixes sync and async
    # endpoints, which Monarch 0.7 refuses at spawn and at unpickle. The sync ones are
    # plain dict/trie updates, so running them as coroutines is safe.
    # Remove when a torchstore release supports Monarch >= 0.7.
    for name, attr in list(vars(Controller).items()):
        fn = getattr(attr, "_method", None)
        if fn is None or inspect.iscoroutinefunction(fn):
            continue

        @functools.wraps(fn)
        async def as_async(self, *args, _fn=fn, **kwargs):
            return _fn(self, *args, **kwargs)

        setattr(Controller, name, endpoint(as_async))


_make_controller_endpoints_async()


# ---- versioned policy weights -------------------------------------------------------


TRANSPORTS = ("shm", "torchstore")


async def start_store(hosts=None):
    """Spawn TorchStore's storage volume (one process) and its controller; returns the procs
    to pass to `stop_store`. Call once, from the controller."""
    from forge.actor import spawn_procs

    procs = spawn_procs(1, hosts)
    await torchstore.initialize(mesh=procs)
    return procs


async def stop_store(procs) -> None:
    from forge.actor import stop_procs

    # torchstore.shutdown() leaves the volume's processes running, so they are stopped here.
    await torchstore.shutdown()
    await stop_procs(procs)


@dataclass
class WeightStore:
    """Versioned policy weights (HF parameter names) on TorchStore.

    `publish(v, sd)` writes version v under its own prefix, then advances `latest`; readers
    never see a half-written version. Transports:
      - "torchstore": the tensors go into TorchStore (works across hosts).
      - "shm": the tensors go into one safetensors file in /dev/shm and TorchStore holds only
        the version record. Same host only, and much faster with torchstore 0.1.2, whose RPC
        transport moves 0.2-0.3 GB/s here; a generator's vLLM worker reads the file directly.
        Dropped versions' files are reused, so a reader checks `check_intact` after reading.
        File names carry a token of this writer, so runs sharing a host never share files;
        keep one WeightStore per writer and `clear()` it at the end.
    """

    name: str = "policy"
    transport: str = "shm"
    shm_dir: str = "/dev/shm/forge"

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown weights transport {self.transport!r}; known: {', '.join(TRANSPORTS)}")
        self._token = uuid.uuid4().hex[:8]

    def _key(self, version: int) -> str:
        return f"{self.name}/v{version}"

    def _path(self, version: int) -> Path:
        return Path(self.shm_dir) / f"{self.name}-{self._token}-v{version}.safetensors"

    def _spares(self) -> list[Path]:
        return list(Path(self.shm_dir).glob(f"{self.name}-{self._token}-spare-*.safetensors"))

    async def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> int:
        """Store `state_dict` as `version` and make it the latest. Returns the bytes written."""
        nbytes = sum(t.numel() * t.element_size() for t in state_dict.values())
        record = {"version": version, "transport": self.transport, "host": socket.gethostname(), "bytes": nbytes}
        if self.transport == "shm":
            path = self._path(version)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            spare = self._spare(safetensors_size(state_dict))
            if spare is not None:
                os.replace(spare, tmp)  # a dropped version's file: its pages are already allocated
            await asyncio.to_thread(write_safetensors, state_dict, tmp)
            os.replace(tmp, path)  # a reader sees the whole file or none
            record["path"] = str(path)
        else:
            await torchstore.put_state_dict({k: v.detach() for k, v in state_dict.items()}, self._key(version))
        await torchstore.put(f"{self._key(version)}/record", record)
        await torchstore.put(f"{self.name}/latest", version)
        return nbytes

    async def latest(self) -> int | None:
        if not await torchstore.exists(f"{self.name}/latest"):
            return None
        return await torchstore.get(f"{self.name}/latest")

    async def record(self, version: int) -> dict:
        key = f"{self._key(version)}/record"
        if not await torchstore.exists(key):
            raise KeyError(f"weights version {version} of {self.name!r} is not in the store (dropped or never published)")
        return await torchstore.get(key)

    async def local_path(self, version: int) -> str | None:
        """The safetensors file holding `version`, if it is readable from this host (shm)."""
        rec = await self.record(version)
        if rec["transport"] == "shm" and rec["host"] == socket.gethostname() and os.path.exists(rec["path"]):
            return rec["path"]
        return None

    def _spare(self, size: int) -> Path | None:
        return next((f for f in self._spares() if f.stat().st_size == size), None)

    async def check_intact(self, version: int) -> None:
        """Call after reading a shm version: its record is deleted before its file is reused,
        so a record that still exists means nothing overwrote what was read."""
        await self.record(version)

    async def fetch(self, version: int, into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The state dict of `version`: new tensors, or copied into `into`'s tensors (a model's
        own parameters: one copy, no allocation) and returned as `into`."""
        path = await self.local_path(version)
        if path is not None:
            got = read_safetensors(path)
            if into is None:
                state_dict = {k: v.clone() for k, v in got.items()}
            else:
                state_dict = _copy_into(got, into)
            await self.check_intact(version)
            return state_dict
        rec = await self.record(version)
        if rec["transport"] == "shm":
            raise RuntimeError(f"weights version {version} are in /dev/shm on host {rec['host']}; use transport='torchstore' across hosts")
        got = await torchstore.get_state_dict(self._key(version))
        return got if into is None else _copy_into(got, into)

    async def versions(self) -> list[int]:
        """Versions in the store, oldest first."""
        prefix, suffix = f"{self.name}/v", "/record"
        return sorted(
            int(k[len(prefix) : -len(suffix)]) for k in await torchstore.keys() if k.startswith(prefix) and k.endswith(suffix)
        )

    async def drop_older_than(self, version: int) -> list[int]:
        dropped = [v for v in await self.versions() if v < version]
        for v in dropped:
            await self.drop(v)
        return dropped

    async def clear(self) -> None:
        """Drop every version and free this writer's files (the end of a run)."""
        for v in await self.versions():
            await self.drop(v)
        for f in self._spares():
            forget_mapping(f)
            f.unlink(missing_ok=True)
        if await torchstore.exists(f"{self.name}/latest"):
            await torchstore.delete(f"{self.name}/latest")

    async def drop(self, version: int) -> None:
        rec = await self.record(version)
        await torchstore.delete(f"{self._key(version)}/record")  # first: nobody starts reading it now
        if rec["transport"] == "shm":
            # Kept as a spare for the next publish: writing into pages that exist runs at memcpy
            # speed, a new tmpfs file pays a page fault per 4 KB (3x slower here). A reader that
            # raced this drop sees the record gone in check_intact() and reads a newer version.
            path = Path(rec["path"])
            if path.exists():
                if len(self._spares()) < 2:
                    os.replace(path, Path(self.shm_dir) / f"{self.name}-{self._token}-spare-{uuid.uuid4().hex[:8]}.safetensors")
                else:
                    forget_mapping(path)
                    path.unlink()
        else:
            # put_state_dict stores one key per tensor plus a MAPPING key listing them.
            mapping = await torchstore.get(f"{self._key(version)}/MAPPING")
            for key in list(mapping) + ["MAPPING"]:
                await torchstore.delete(f"{self._key(version)}/{key}")


# ---- one-copy safetensors in shared memory ---------------------------------------------
# safetensors' save_file builds the whole file as bytes first, and load_file copies it out
# again (0.5-0.9 GB/s measured here). Here each tensor is copied straight into the file, and
# reading maps it with no copy at all. Mappings are kept per file (inode) and reused: a tmpfs
# page costs a fault the first time a process touches it through a mapping, which made a
# fresh mapping 5-10x slower than memcpy; a version written into a dropped version's file
# through the mapping kept from last time runs at memcpy speed.

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_FROM_NAME = {v: k for k, v in _DTYPES.items()}
_MAPS: dict[tuple[int, int, int], torch.Tensor] = {}  # (device, inode, size) -> the file, mapped shared
_MAX_MAPS = 4  # a writer cycles through keep_versions + 2 spare files


def _mapping(path: str | Path) -> torch.Tensor:
    st = os.stat(path)
    key = (st.st_dev, st.st_ino, st.st_size)
    buf = _MAPS.pop(key, None)
    if buf is None:
        buf = torch.from_file(str(path), shared=True, size=st.st_size, dtype=torch.uint8)
    _MAPS[key] = buf  # most recently used last
    while len(_MAPS) > _MAX_MAPS:
        _MAPS.pop(next(iter(_MAPS)))
    return buf


def _copy_into(src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if src.keys() != dst.keys():
        raise KeyError(f"fetch(into=...): the version has {sorted(src.keys() ^ dst.keys())} where `into` does not, or the reverse")
    for name, t in src.items():
        dst[name].copy_(t.view(dst[name].shape))
    return dst


def forget_mapping(path: str | Path) -> None:
    """Before unlinking a file: a kept mapping would keep its memory."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    _MAPS.pop((st.st_dev, st.st_ino, st.st_size), None)


def _header(state_dict: dict[str, torch.Tensor]) -> tuple[dict, bytes, int]:
    import json

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
    import json

    buf = _mapping(path)
    n = int.from_bytes(bytes(buf[:8].tolist()), "little")
    header = json.loads(bytes(buf[8 : 8 + n].tolist()))
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
