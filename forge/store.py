"""Versioned policy weights on TorchStore (`WeightStore`), and the adapter that makes
torchstore 0.1.2 usable on Monarch 0.7.

Import it (not `torchstore` directly) in every process that touches the store: a
generator that calls `torchstore.get` unpickles a Controller handle, and Monarch
re-checks the class there too.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import ipaddress
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torchstore  # noqa: F401  (its import sets HYPERACTOR_CODEC_MAX_FRAME_LENGTH for big frames)
from monarch.actor import endpoint
from torchstore.controller import Controller

from forge.actor import spawn_procs, stop_procs
from forge.metrics import Reduce, record_metric
from forge.schema import TRANSPORTS
from forge.shm import (
    check_safetensors,
    forget_mapping,
    is_safe_dir,
    read_safetensors,
    remove_run_dir,
    run_dir,
    safetensors_size,
    write_safetensors,
)
from forge.transfer import FileServer, host_cache_dir, host_copy, host_id, reserve, version_of


def _beyond_loopback(host: str) -> bool:
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name
        return host != "localhost"


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


async def start_store(hosts=None):
    """Spawn TorchStore's storage volume (one process) and its controller; returns the procs
    to pass to `stop_store`. Call once, from the controller."""
    procs = spawn_procs(1, hosts, title="forge:store")
    await torchstore.initialize(mesh=procs)
    return procs


async def stop_store(procs) -> None:
    # torchstore.shutdown() leaves the volume's processes running, so they are stopped here.
    await torchstore.shutdown()
    await stop_procs(procs)
    remove_run_dir()  # the run's weight files, a dead writer's too


@dataclass
class WeightStore:
    """Versioned policy weights (HF parameter names) on TorchStore.

    `publish(v, sd)` writes version v under its own prefix, then advances `latest`; readers
    never see a half-written version. Transports:
      - "torchstore": the tensors go into TorchStore (works across hosts).
      - "shm": the tensors go into one safetensors file in /dev/shm and TorchStore holds only
        the version record; much faster than torchstore 0.1.2's RPC transport (0.2-0.3 GB/s
        here). `open` and a generator's vLLM worker map the file (no copy). Dropped versions'
        files are reused, so a reader checks `check_intact` after reading (`open` and `fetch`
        do). Readers on other hosts (`forge.transfer.host_id`) stream the file from the
        writer's FileServer, bound to `serve_on` ("0.0.0.0" on a cluster), once per host:
        the copy in the host's cache is what they map.
        Each fetch carries the run's key, which readers take from the version record: other
        peers of the network get nothing. The record pins the server's IP (no name resolved
        by readers) and the file's size, and beyond loopback its digest (hashed as the writer
        writes it): a host's copy is checked against them, and not reused by the writer
        meanwhile, before it takes its name. Readers on the writer's host map its file (a
        private directory) unchecked.
        Files live in the run's directory (`forge.shm.run_dir()` of the process that made
        this WeightStore, which is removed at `stop_store` and swept once its owner is gone)
        and carry a token of this writer. Make the WeightStore in the controller and pass it
        to the writer: a respawned writer then reuses its predecessor's files. `clear()` it
        at the end.
    """

    name: str = "policy"
    transport: str = "shm"
    shm_dir: str | None = None  # None: this process's run directory
    serve_on: str = "127.0.0.1"  # the address other hosts' readers fetch "shm" versions from
    deltas: bool = False  # other hosts fetch a version as its change from the one they hold

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown weights transport {self.transport!r}; known: {', '.join(TRANSPORTS)}")
        self._dir_host = host_id()
        self._run_dir = self.shm_dir is None  # forge's own choice, which it may make again
        if self.shm_dir is None and self.transport == "shm":
            self.shm_dir = str(run_dir())
        self._token = uuid.uuid4().hex[:8]
        self._secret = secrets.token_hex(16)  # the run's readers learn it from the version records
        self._server: FileServer | None = None
        # Only a server beyond loopback can be answered for by someone else (a name resolved
        # elsewhere, a man in the middle): there, versions carry a digest, whose hashing costs
        # ~0.2 s per 500 MB on this machine's 2 cores; on loopback the pinned port is the writer's.
        self._networked = _beyond_loopback(self.serve_on)
        self._hashed = self._networked or self.deltas  # a delta's result is checked against the digest

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_server": None}  # the writer's server stays in its process

    def _key(self, version: int) -> str:
        return f"{self.name}/v{version}"

    def _path(self, version: int) -> Path:
        return Path(self.shm_dir) / f"{self.name}-{self._token}-v{version}.safetensors"

    def _spares(self) -> list[Path]:
        if self.shm_dir is None:
            return []
        return list(Path(self.shm_dir).glob(f"{self.name}-{self._token}-spare-*.safetensors"))

    async def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> int:
        """Store `state_dict` as `version` and make it the latest. Returns the bytes written."""
        nbytes = sum(t.numel() * t.element_size() for t in state_dict.values())
        record = {
            "version": version,
            "transport": self.transport,
            "host": host_id(),
            "bytes": nbytes,
            "deltas": self.deltas,
        }
        if self.transport == "shm":
            # Made elsewhere (the controller's host), or a run directory gone since (and perhaps
            # another user's now): this process's own run directory, checked.
            if self._dir_host != host_id() or (self._run_dir and not is_safe_dir(Path(self.shm_dir))):
                self.shm_dir, self._dir_host = str(run_dir()), host_id()
            if self._server is None or self._server.directory != Path(self.shm_dir):
                if self._server is not None:
                    self._server.close()  # it served the directory left behind
                self._server = FileServer(self.shm_dir, self.serve_on, self._secret)
            record["addr"], record["key"] = list(self._server.addr), self._secret
            path = self._path(version)
            path.parent.mkdir(parents=True, exist_ok=True)  # a directory given (a run's is made)
            tmp = path.with_suffix(".tmp")
            spare = self._spare(safetensors_size(state_dict))
            if spare is not None:
                os.replace(spare, tmp)  # a dropped version's file: its pages are already allocated
            record["digest"] = await self._write(state_dict, tmp, spare)
            record["size"] = os.path.getsize(tmp)
            os.replace(tmp, path)  # a reader sees the whole file or none
            record["path"] = str(path)
        else:
            await torchstore.put_state_dict({k: v.detach() for k, v in state_dict.items()}, self._key(version))
        await torchstore.put(f"{self._key(version)}/record", record)
        await torchstore.put(f"{self.name}/latest", version)
        return nbytes

    def layout(self, state_dict: dict[str, torch.Tensor]) -> dict | None:
        """What a version of `state_dict`'s shape will be, for readers on other hosts to make room
        for before the first one comes (`reserve`): the writer's host, its files' prefix and their
        size. None for the "torchstore" transport (nothing lands in a file)."""
        if self.transport != "shm":
            return None
        return {"host": host_id(), "writer": f"{self.name}-{self._token}", "size": safetensors_size(state_dict)}

    def reserve(self, layout: dict | None) -> bool:
        """A reader: allocate this host's file for the writer's versions now (`forge.transfer.reserve`),
        unless it is the writer's host (its readers map the writer's files). Returns whether it did."""
        if layout is None or layout["host"] == host_id():
            return False
        return reserve(layout["writer"], layout["size"])

    async def latest(self) -> int | None:
        try:  # one RPC: a get that misses raises, where exists-then-get costs two
            return await torchstore.get(f"{self.name}/latest")
        except KeyError:
            return None

    async def record(self, version: int) -> dict:
        try:
            return await torchstore.get(f"{self._key(version)}/record")
        except KeyError:
            raise KeyError(
                f"weights version {version} of {self.name!r} is not in the store (dropped or never published)"
            ) from None

    async def local_path(self, version: int) -> str | None:
        """The safetensors file holding `version` on this host ("shm" transport): the writer's
        own, or this host's copy (fetched now if no reader of this host has yet)."""
        return await self._local_path(await self.record(version))

    async def _local_path(self, rec: dict) -> str | None:
        if rec["transport"] != "shm":
            return None
        if rec["host"] == host_id():
            return rec["path"] if os.path.exists(rec["path"]) else None
        start = time.perf_counter()
        name = Path(rec["path"]).name
        # Copies older than the version before go (readers may still be loading that one).
        stale = functools.partial(_older_than, rec["version"] - 1)
        loop = asyncio.get_running_loop()

        def validate(copy: Path) -> None:  # before the copy takes its name: no reader maps a torn one
            if rec["digest"] is None:  # a whole file at least (a digest says more)
                check_safetensors(copy)
            # the writer did not reuse its file while it was sent (else the digest tells)
            asyncio.run_coroutine_threadsafe(self.check_intact(rec["version"]), loop).result()

        size, digest = rec["size"], rec["digest"]  # the writer's file, byte for byte
        path, moved = await asyncio.to_thread(
            host_copy, rec["addr"], name, rec["key"], stale, validate, size=size, digest=digest, deltas=rec["deltas"]
        )
        if moved:
            record_metric("weights/host_copy_s", time.perf_counter() - start, Reduce.MAX)
            record_metric("weights/host_copy_bytes", moved, Reduce.SUM)
        return str(path)

    def _spare(self, size: int) -> Path | None:
        return next((f for f in self._spares() if f.stat().st_size == size), None)

    async def _write(self, state_dict: dict[str, torch.Tensor], tmp: Path, spare: Path | None) -> str | None:
        """`write_safetensors` into `tmp` (the file `spare` renamed, if given); a write that fails
        or is cancelled gives `tmp` up (`_give_up`): else it holds its RAM until the run ends."""
        writing = asyncio.ensure_future(asyncio.to_thread(write_safetensors, state_dict, tmp, self._hashed))
        try:
            return await asyncio.shield(writing)
        except BaseException:
            if writing.done():
                self._give_up(tmp, spare)
            else:  # cancelled: the thread writes on, into the file, until it is done
                writing.add_done_callback(lambda _: self._give_up(tmp, spare))
            raise

    def _give_up(self, tmp: Path, spare: Path | None) -> None:
        """A file a publish did not finish: a spare again if it was one (its pages are allocated), else freed."""
        if spare is not None and tmp.exists():
            os.replace(tmp, spare)
        else:
            forget_mapping(tmp)
            tmp.unlink(missing_ok=True)

    async def check_intact(self, version: int, path: str | None = None) -> None:
        """Call after reading a shm version from `path`: a file is renamed away (the writer's,
        when its version is dropped) or loses its name (a host's copy) before it is rewritten,
        and no later version takes its name, so a name still there means nothing overwrote what
        was read. Without `path` (a file of another host), the version's record tells."""
        if path is not None:  # a stat, not a store round trip: it sits between staged weights and going live
            if not os.path.exists(path):
                where = "this host's copy was replaced" if Path(path).parent == host_cache_dir() else "was dropped"
                raise KeyError(f"weights version {version} of {self.name!r}: {where} while it was read")
        elif not await torchstore.exists(f"{self._key(version)}/record"):
            raise KeyError(f"weights version {version} of {self.name!r} was dropped while it was read")

    @contextlib.asynccontextmanager
    async def open(self, version: int) -> AsyncIterator[dict[str, torch.Tensor]]:
        """`version`'s state dict for the length of the block, without copying it: views of
        the shm file (same host), or the tensors fetched from TorchStore. Leaving the block
        raises KeyError if the version was dropped, and its file reused, while it was read:
        copy out (e.g. `model.load_state_dict`) inside the block."""
        async with self._open(await self.record(version)) as state_dict:
            yield state_dict

    @contextlib.asynccontextmanager
    async def _open(self, rec: dict) -> AsyncIterator[dict[str, torch.Tensor]]:
        path = await self._local_path(rec)
        if path is not None:
            yield read_safetensors(path)
            await self.check_intact(rec["version"], path)
        elif rec["transport"] == "shm":
            raise KeyError(f"weights version {rec['version']} of {self.name!r}: its file is gone")
        else:
            yield await torchstore.get_state_dict(self._key(rec["version"]))

    async def fetch(self, version: int, into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The state dict of `version`: new tensors, or copied into `into`'s tensors (a model's
        own parameters: one copy, no allocation) and returned as `into`."""
        rec = await self.record(version)
        async with self._open(rec) as got:
            if into is not None:
                return _copy_into(got, into)
            return {k: v.clone() for k, v in got.items()} if rec["transport"] == "shm" else got

    async def versions(self) -> list[int]:
        """Versions in the store, oldest first."""
        prefix, suffix = f"{self.name}/v", "/record"
        return sorted(
            int(k[len(prefix) : -len(suffix)])
            for k in await torchstore.keys()
            if k.startswith(prefix) and k.endswith(suffix)
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
        if self._server is not None:
            self._server.close()
            self._server = None
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
            # raced this drop sees its file's name gone in check_intact() and reads a newer version.
            path = Path(rec["path"])
            if path.exists():
                if len(self._spares()) < 2:
                    os.replace(
                        path, Path(self.shm_dir) / f"{self.name}-{self._token}-spare-{uuid.uuid4().hex[:8]}.safetensors"
                    )
                else:
                    forget_mapping(path)
                    path.unlink()
        else:
            # put_state_dict stores one key per tensor plus a MAPPING key listing them.
            mapping = await torchstore.get(f"{self._key(version)}/MAPPING")
            for key in list(mapping) + ["MAPPING"]:
                await torchstore.delete(f"{self._key(version)}/{key}")


def _older_than(version: int, name: str) -> bool:
    return version_of(name) < version


def _copy_into(src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if src.keys() != dst.keys():
        raise KeyError(
            f"fetch(into=...): the version has {sorted(src.keys() ^ dst.keys())} where `into` does not, or the reverse"
        )
    for name, t in src.items():
        dst[name].copy_(t.view(dst[name].shape))
    return dst
