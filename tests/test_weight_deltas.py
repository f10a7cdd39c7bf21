"""Weight versions as deltas across hosts (forge.delta): a host holding version v gets v + 1 as
the words that changed, checked against the version's digest; a delta for another base, a
corrupted one and one from a peer without the run's key are refused before the copy takes
its name, and the host fetches the whole file instead."""

import asyncio
import errno
import os
import shutil

import pytest
import torch

from forge import delta, shm
from forge.transfer import FileServer, fetch_delta, host_cache_dir, host_copy

KEY = "the-run-key"


def bf16_version(step: int, n: int = 300_000) -> dict[str, torch.Tensor]:
    """A bf16 model after `step` updates of 1e-6 (sign steps, as Adam's first): few words change."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, generator=g) * 0.02
    for s in range(step):
        w += 1e-6 * torch.sign(torch.randn(n, generator=torch.Generator().manual_seed(s + 1)))
    return {"a.weight": w[: n // 2].bfloat16(), "b.weight": w[n // 2 :].bfloat16(), "step": torch.tensor([step])}


@pytest.fixture
def writer(tmp_path):
    """A writer's directory with versions 1 and 2 of a bf16 model, served with the run's key."""
    served = tmp_path / "served"
    served.mkdir()
    digests = {v: shm.write_safetensors(bf16_version(v), served / f"pol-tok-v{v}.safetensors", True) for v in (1, 2)}
    server = FileServer(served, key=KEY)
    yield server, digests
    server.close()
    for p in host_cache_dir().glob("pol-tok-*"):
        p.unlink()


def name(v: int) -> str:
    return f"pol-tok-v{v}.safetensors"


def test_a_delta_turns_the_base_into_the_target_word_for_word(tmp_path):
    a, b = tmp_path / name(1), tmp_path / name(2)
    shm.write_safetensors(bf16_version(1), a)
    shm.write_safetensors(bf16_version(2), b)
    made = delta.make(a, b, KEY)
    assert made is not None and len(made) < 0.2 * os.path.getsize(b)
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT, 0o600)
    delta.apply(made, KEY, a, b.name, fd)
    os.close(fd)
    assert (tmp_path / "out").read_bytes() == b.read_bytes()
    # fp32 changes nearly every word: no delta, a whole fetch
    shm.write_safetensors({"w": torch.randn(10_000)}, a)
    shm.write_safetensors({"w": torch.randn(10_000)}, b)
    assert delta.make(a, b, KEY) is None


def test_a_host_holding_a_version_fetches_the_next_as_its_delta(writer):
    server, digests = writer
    stale = lambda n: int(n.rsplit("-v", 1)[1].split(".")[0]) < 1  # noqa: E731
    first, moved = host_copy(server.addr, name(1), KEY, stale, digest=digests[1], deltas=True)
    assert moved == os.path.getsize(first)  # no base held: whole
    second, moved = host_copy(server.addr, name(2), KEY, stale, digest=digests[2], deltas=True)
    assert second.read_bytes() == (server.directory / name(2)).read_bytes()
    assert 0 < moved < 0.2 * os.path.getsize(second) and first.exists()  # the base stays: readers may be on it


def test_a_delta_for_another_base_is_refused_before_the_copy_takes_its_name(writer, tmp_path):
    server, digests = writer
    held = host_cache_dir() / name(1)
    shm.write_safetensors(bf16_version(7), held)  # this host's copy is not the writer's v1
    dest = host_cache_dir() / name(2)
    with pytest.raises(ValueError, match="does not match the digest of its version record"):
        fetch_delta(server.addr, name(2), held, dest, KEY, digests[2])
    assert not dest.exists() and not list(host_cache_dir().glob(name(2) + "*"))
    other = tmp_path / name(0)  # a base of another name: the delta names the one it was made from
    shutil.copy(server.directory / name(1), other)
    made = delta.make(server.directory / name(1), server.directory / name(2), KEY)
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT, 0o600)
    with pytest.raises(delta.DeltaError, match="turns pol-tok-v1.safetensors into pol-tok-v2.safetensors"):
        delta.apply(made, KEY, other, name(2), fd)
    with pytest.raises(delta.DeltaError, match="this reader needs .* into pol-tok-v3"):
        delta.apply(made, KEY, server.directory / name(1), name(3), fd)
    os.close(fd)
    # host_copy falls back to the whole file, checked
    got, moved = host_copy(server.addr, name(2), KEY, lambda n: False, digest=digests[2], deltas=True)
    assert got.read_bytes() == (server.directory / name(2)).read_bytes() and moved == os.path.getsize(got)


def test_a_delta_that_cannot_be_written_says_why_and_the_host_fetches_the_whole_file(writer, tmp_path, monkeypatch):
    """An error while the delta's result is written (a full /dev/shm: ENOSPC) comes out as
    itself, not as the mapping's BufferError, so host_copy falls back to the whole file."""
    server, digests = writer
    first, _ = host_copy(server.addr, name(1), KEY, lambda n: False, digest=digests[1], deltas=True)

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "copy_file_range", full)
    made = delta.make(server.directory / name(1), server.directory / name(2), KEY)
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError, match="No space left"):
            delta.apply(made, KEY, first, name(2), fd)
    finally:
        os.close(fd)
    got, moved = host_copy(server.addr, name(2), KEY, lambda n: False, digest=digests[2], deltas=True)
    assert got.read_bytes() == (server.directory / name(2)).read_bytes() and moved == os.path.getsize(got)


def test_a_corrupted_delta_is_refused(writer, tmp_path):
    server, _ = writer
    made = bytearray(delta.make(server.directory / name(1), server.directory / name(2), KEY))
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT, 0o600)
    for at in (len(delta.MAGIC) + 40, len(made) - 1):  # the header, a value
        bad = bytearray(made)
        bad[at] ^= 0x01
        with pytest.raises(delta.DeltaError, match="tag is not the run's key's"):
            delta.apply(bytes(bad), KEY, server.directory / name(1), name(2), fd)
    os.close(fd)
    assert os.path.getsize(tmp_path / "out") == 0  # nothing written


def test_a_malformed_delta_with_the_key_is_refused_and_the_host_fetches_the_whole_file(writer, tmp_path):
    """A delta tagged with the run's key (a buggy writer) but malformed: an offset past the
    file's end, a header without a field or not an object, a count that is no integer. Each is
    a DeltaError (not an IndexError the reader would not fall back from), and a host served
    one fetches the whole file."""
    import json

    import numpy as np

    server, digests = writer
    size = os.path.getsize(server.directory / name(2))
    blocks = -(-size // 2 // delta.BLOCK)

    def tagged(header, counts, offsets, values) -> bytes:
        h = json.dumps(header).encode()
        arrays = [np.asarray(a, dtype) for a, dtype in ((counts, "<u4"), (offsets, "<u2"), (values, "<u2"))]
        body = delta._LEN.pack(len(h)) + h + b"".join(a.tobytes() for a in arrays)
        return delta.MAGIC + delta._tag(KEY, body) + body

    header = {"base": name(1), "target": name(2), "size": size, "changed": 1}
    past_the_end = size // 2 - ((blocks - 1) << 16) + 5
    bad = {
        "past the end": tagged(header, [0] * (blocks - 1) + [1], [past_the_end], [7]),
        "no base": tagged({k: v for k, v in header.items() if k != "base"}, [0] * blocks, [], []),
        "a list": tagged([1, 2], [], [], []),
        "a string count": tagged({**header, "changed": "1"}, [0] * (blocks - 1) + [1], [0], [7]),
    }
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT, 0o600)
    for what, made in bad.items():
        with pytest.raises(delta.DeltaError):
            delta.apply(made, KEY, server.directory / name(1), name(2), fd)
            pytest.fail(f"{what}: applied")
    os.close(fd)
    shutil.copy(server.directory / name(1), host_cache_dir() / name(1))
    server._deltas[name(1), name(2)] = bad["past the end"]
    got, moved = host_copy(server.addr, name(2), KEY, lambda n: False, digest=digests[2], deltas=True)
    assert got.read_bytes() == (server.directory / name(2)).read_bytes() and moved == os.path.getsize(got)


def test_a_delta_from_a_peer_without_the_key_is_refused(writer, tmp_path):
    """A server at the writer's address that is not the writer (it learns whatever a reader
    sends) offers a well-formed delta to other weights: it cannot tag it with the run's key,
    so the reader never applies it, and fetches the whole file (from the same peer here:
    refused by the digest)."""
    server, digests = writer
    evil_dir = tmp_path / "evil"
    evil_dir.mkdir()
    shutil.copy(server.directory / name(1), evil_dir / name(1))
    shm.write_safetensors(bf16_version(9), evil_dir / name(2))
    evil = FileServer(evil_dir, key="not-the-run-key")
    evil.key = KEY  # it answers the reader's request (whose key it sees) ...
    made = delta.make(evil_dir / name(1), evil_dir / name(2), "not-the-run-key")  # ... but tags with its own
    evil._deltas[name(1), name(2)] = made
    held = host_cache_dir() / name(1)
    shutil.copy(server.directory / name(1), held)
    try:
        with pytest.raises(delta.DeltaError, match="tag is not the run's key's"):
            fetch_delta(evil.addr, name(2), held, host_cache_dir() / name(2), KEY, digests[2])
        with pytest.raises(ValueError, match="does not match the digest"):
            host_copy(evil.addr, name(2), KEY, lambda n: False, digest=digests[2], deltas=True)
        assert not (host_cache_dir() / name(2)).exists() and held.exists()
    finally:
        evil.close()


def test_a_store_with_deltas_sends_other_hosts_only_the_change(monkeypatch):
    """WeightStore(deltas=True): versions carry a digest, and a reader of another host that
    holds the last version fetches the next as a delta (bytes moved a small part of the file),
    equal to the writer's."""
    from forge.metrics import _drain, reduce_states
    from forge.store import WeightStore, start_store, stop_store

    async def main():
        procs = await start_store()
        ws = WeightStore("dstore", deltas=True)
        try:
            await ws.publish(1, bf16_version(1))
            await ws.publish(2, bf16_version(2))
            monkeypatch.setenv("_MONARCH_WORKER_ADDR", "ipc:///forge-test/delta-reader-host")
            _drain()
            first = await ws.fetch(1)
            whole = reduce_states([_drain()])["weights/host_copy_bytes"]
            second = await ws.fetch(2)
            moved = reduce_states([_drain()])["weights/host_copy_bytes"]
            assert all(torch.equal(second[k], t) for k, t in bf16_version(2).items()) and first.keys() == second.keys()
            assert moved < 0.2 * whole and (await ws.record(2))["digest"]
        finally:
            monkeypatch.delenv("_MONARCH_WORKER_ADDR")
            await ws.clear()
            await stop_store(procs)

    asyncio.run(main())
