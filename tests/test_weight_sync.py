"""Versioned weights on TorchStore, loaded by a generator replica while it generates."""

import asyncio
import itertools
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from conftest import alive
from safetensors.torch import load_file
from test_generator import max_logprob_error, perturbed

from forge.store import WeightStore, start_store, stop_store
from forge.weight_sync import WeightSync
from services.generator import Generator
from services.schema import GeneratorConfig


async def loaded(sync: WeightSync, version: int) -> None:
    """`version` is in the store: the generators load it (within a minute)."""
    sync.publish(version)
    await sync.wait_held(version, timeout_s=60)


def test_store_roundtrip_both_transports():
    async def main():
        procs = await start_store()
        try:
            for transport in ("torchstore", "shm"):
                ws = WeightStore(name=f"rt-{transport}", transport=transport)
                assert await ws.latest() is None
                sd = {"a.weight": torch.randn(3, 4), "b.bias": torch.randn(5)}
                for v in (1, 2, 3):
                    await ws.publish(v, {k: t + v for k, t in sd.items()})
                assert await ws.latest() == 3 and await ws.versions() == [1, 2, 3]
                got = await ws.fetch(2)
                assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k] + 2) for k in sd)
                async with ws.open(3) as view:  # no copy: views of the shm file
                    assert all(torch.equal(view[k], sd[k] + 3) for k in sd)
                into = {k: torch.empty_like(t) for k, t in sd.items()}
                assert (await ws.fetch(1, into=into)) is into and all(torch.equal(into[k], sd[k] + 1) for k in sd)
                path = await ws.local_path(1)
                assert await ws.drop_older_than(3) == [1, 2] and await ws.versions() == [3]
                assert path is None or not Path(path).exists()
                with pytest.raises(KeyError, match="version 1 of 'rt-"):
                    await ws.fetch(1)
                await ws.publish(4, sd)
                if transport == "shm":  # a file dropped (to be reused) under a reader is caught
                    with pytest.raises(KeyError, match="dropped while it was read"):
                        async with ws.open(4):
                            await ws.drop(4)
                await ws.clear()  # the end of a run: no versions, no files of this writer left
                assert await ws.versions() == [] and await ws.latest() is None
                if transport == "shm":
                    assert not list(Path(ws.shm_dir).glob(f"rt-{transport}-{ws._token}-*"))
        finally:
            await stop_store(procs)

    asyncio.run(main())


def test_readers_on_another_host_share_one_transfer(tmp_path):
    """Readers on another host (procs that count as another job host) stream a "shm" version
    from the writer's FileServer once for their host and read it intact; the host keeps the
    newest two versions, rewriting the oldest copy's file as the newest; a reader of a copy
    rewritten meanwhile is told; the server serves only its directory's weight files."""
    from store_actors import HostReader

    from forge.actor import spawn_procs, stop_procs
    from forge.transfer import fetch_file

    async def main():
        procs = await start_store()
        other_host = {"_MONARCH_WORKER_ADDR": "ipc:///forge-test/host-b"}
        readers = [spawn_procs(1, env=other_host) for _ in range(2)]
        ws = WeightStore("xh")
        try:
            sd = {"a.weight": torch.randn(512, 1024), "b.bias": torch.randn(5)}
            sums = lambda v: [(t + v).sum().item() for t in sd.values()]  # noqa: E731
            await ws.publish(1, {k: t + 1 for k, t in sd.items()})
            actors = [p.spawn("reader", HostReader) for p in readers]
            got = await asyncio.gather(*(a.read.call_one(ws, 1) for a in actors))
            assert [g[0] for g in got] == [sums(1), sums(1)]
            (copy, _), (same, _) = [(g[1], None) for g in got]
            assert copy == same and Path(copy).parent != Path(ws.shm_dir)  # one copy for the host
            assert ws._server.requests == 1
            first_inode = os.stat(copy).st_ino
            for v in (2, 3):
                await ws.publish(v, {k: t + v for k, t in sd.items()})
                assert (await actors[0].read.call_one(ws, v))[0] == sums(v)
            assert ws._server.requests == 3
            cached = sorted(p.name for p in Path(copy).parent.glob("xh-*.safetensors"))
            assert cached == [f"xh-{ws._token}-v2.safetensors", f"xh-{ws._token}-v3.safetensors"]
            assert os.stat(Path(copy).with_name(cached[1])).st_ino == first_inode  # v1's pages, rewritten
            assert "this host's copy was replaced while it was read" in await actors[1].check_intact.call_one(
                ws, 1, copy
            )
            assert await actors[1].check_intact.call_one(ws, 3, str(Path(copy).with_name(cached[1]))) == ""
            for bad in ("../../etc/passwd", "missing.safetensors"):
                with pytest.raises(FileNotFoundError, match="has no file"):
                    fetch_file(ws._server.addr, bad, tmp_path / "out", ws._secret)
            with pytest.raises(ValueError, match=r"cannot serve weights on '256.0.0.1' \(trainer.serve_weights_on\)"):
                await WeightStore("bad", serve_on="256.0.0.1").publish(1, sd)
        finally:
            await ws.clear()
            for p in readers:
                await stop_procs(p)
            await stop_store(procs)

    asyncio.run(main())


def test_a_hosts_first_versions_stream_into_files_allocated_ahead(tmp_path, monkeypatch, caplog):
    """A reader host reserves a file for a writer's versions before the first comes (its tmpfs
    pages allocated, off the version's path): the first version is written into it, a spare
    for the second is allocated after it, and from the third on the oldest copy is rewritten,
    with no spare left over. A spare of another size still ends as the writer's bytes; a host
    without room for one says so and goes on."""
    import threading
    import time

    from forge import shm
    from forge.transfer import FileServer, host_cache_dir, host_copy

    served = tmp_path / "served"
    served.mkdir()
    versions = {v: {"w": torch.full((70_000,), float(v))} for v in (1, 2, 3)}
    digests = {v: shm.write_safetensors(sd, served / f"sp-tok-v{v}.safetensors", True) for v, sd in versions.items()}
    size = os.path.getsize(served / "sp-tok-v1.safetensors")
    server, cache = FileServer(served, key="k"), host_cache_dir()
    spare = cache / "sp-tok-spare.safetensors"
    stale = lambda v: lambda n: int(n.rsplit("-v", 1)[1].split(".")[0]) < v - 1  # noqa: E731

    def settled() -> None:  # the spare a fetch leaves to allocate in the background
        deadline = time.monotonic() + 10
        while any(t.name.startswith("forge-reserve-") for t in threading.enumerate()):
            assert time.monotonic() < deadline
            time.sleep(0.01)

    try:
        writer = WeightStore("sp")
        layout = writer.layout(versions[1])
        assert layout["size"] == size and not writer.reserve(layout)  # the writer's host maps its files
        monkeypatch.setenv("_MONARCH_WORKER_ADDR", "ipc:///forge-test/spare-host")
        assert writer.reserve(dict(layout, writer="sp-tok"))
        assert spare.stat().st_size == size and spare.stat().st_blocks * 512 >= size  # allocated, not sparse
        assert not writer.reserve(dict(layout, writer="sp-tok"))  # one per host
        inodes = {}
        for v in (1, 2, 3):
            ahead = spare.stat().st_ino if spare.exists() else None
            copy, moved = host_copy(
                server.addr, f"sp-tok-v{v}.safetensors", "k", stale(v), size=size, digest=digests[v]
            )
            settled()
            inodes[v] = os.stat(copy).st_ino
            assert moved == size and copy.read_bytes() == (served / copy.name).read_bytes()
            if v < 3:
                assert inodes[v] == ahead  # written into the file allocated ahead
            assert spare.exists() == (v == 1)  # a spare for the second version, none after it
        assert inodes[3] == inodes[1]  # the oldest copy, rewritten
        for p in cache.glob("sp-tok-v*"):
            p.unlink()
        monkeypatch.setenv("_MONARCH_WORKER_ADDR", "ipc:///forge-test/spare-host-2")
        assert writer.reserve(dict(layout, writer="sp-tok", size=size + 12_345))
        copy, _ = host_copy(server.addr, "sp-tok-v1.safetensors", "k", stale(1), size=size, digest=digests[1])
        assert copy.read_bytes() == (served / copy.name).read_bytes()
        settled()
        copy.unlink()
        spare.unlink(missing_ok=True)

        def full(fd, offset, length):  # /dev/shm without room
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "posix_fallocate", full)
        with caplog.at_level("WARNING", logger="forge"):
            assert not writer.reserve(dict(layout, writer="sp-tok"))
        assert "no room for" in caplog.text and not list(cache.glob("sp-tok-spare*"))
    finally:
        server.close()
        for p in cache.glob("sp-tok-*"):
            p.unlink()


@pytest.mark.slow  # 64 s: a trainer and a generator, ten versions
def test_generator_follows_latest_while_generating(tiny_model_dir):
    base = load_file(tiny_model_dir / "model.safetensors")

    async def main():
        procs = await start_store()
        shm = WeightStore("policy", transport="shm")
        gen = await Generator.options().as_service(str(tiny_model_dir), GeneratorConfig(max_model_len=256), shm)
        sync = WeightSync(None, gen)  # this test publishes, as the trainer does
        await sync.start()
        tstore = WeightStore("policy", transport="torchstore")
        try:
            assert await gen.policy_version.route() == 0
            v1 = perturbed(base, 1)

            # Publish while 32 long requests run: none waits for the fetch, all finish.
            long = {"max_tokens": 96, "ignore_eos": True}
            streams = [asyncio.ensure_future(gen.generate.route("rev abc=", sampling=long)) for _ in range(32)]
            await asyncio.sleep(0.3)
            await shm.publish(1, v1)
            await loaded(sync, 1)
            done = [c for s in await asyncio.gather(*streams) for c in s]
            assert len(done) == 32 and all(len(c.token_ids) == 96 for c in done)
            assert any(c.max_policy_version > c.policy_version for c in done)  # swapped mid-request
            # vLLM's worker read the file through a mapping: its params must be copies, not
            # views that change when the file is reused for a later version.
            path = await shm.local_path(1)
            with open(path, "r+b") as f:
                f.write(bytes(os.path.getsize(path)))
            after = await gen.generate.route("1+2=", n=4, sampling={"max_tokens": 16})
            assert all(c.policy_version == 1 for c in after)
            assert max_logprob_error(tiny_model_dir, after, v1) <= 1e-4

            # The TorchStore transport (what another host would use) reaches the generator too.
            v2 = perturbed(base, 2)
            await tstore.publish(2, v2)
            await loaded(sync, 2)
            after = await gen.generate.route("rev ab=", n=4, sampling={"max_tokens": 16})
            assert max_logprob_error(tiny_model_dir, after, v2) <= 1e-4

            # A respawned replica comes back on the latest version.
            await shm.publish(3, perturbed(base, 3))
            await shm.drop_older_than(3)
            await loaded(sync, 3)
            engine_pids = await gen.engine_pids.route()
            actor_pid = psutil.Process(engine_pids[0]).ppid()
            os.kill(actor_pid, signal.SIGKILL)
            out = await gen.generate.route("1+2=", sampling={"max_tokens": 4})
            assert out[0].policy_version == 3 and sum(r.respawns for r in gen.replicas) == 1
            # The dead replica's vLLM processes went with it (they are not left orphaned).
            for _ in range(50):
                if not any(alive(p) for p in engine_pids):
                    break
                await asyncio.sleep(0.2)
            assert not any(alive(p) for p in engine_pids)
        finally:
            await sync.stop()
            await shm.clear()  # this test is the writer: its /dev/shm files go with it
            await gen.shutdown()
            await stop_store(procs)

    asyncio.run(main())


@pytest.mark.parametrize(  # one model per family; all but qwen3's (75-80 s each) with the slow tests
    "model",
    [
        "tiny_model_dir",
        *(pytest.param(m, marks=pytest.mark.slow) for m in ("tiny_llama_dir", "tiny_moe_dir", "tiny_hf_dir")),
    ],
)
def test_trainer_to_generator_parity_and_reference(model, request, tmp_path):
    """For each model family: the trainer pushes a trained policy (HF names, its family's
    adapter); the generator serves it; on the generator's own tokens, trainer logprobs match
    the generator's (k3 KL <= 1e-4, IS ratio 1 within 1e-5) and an fp32 transformers forward
    of the pushed weights (1e-4). The trainer's HF export starts a fresh vLLM engine that
    samples the swapped-in generator's greedy tokens. The reference keeps the initial policy,
    chunked or not."""
    from test_trainer import fixed_batch, on_policy

    from forge.schema import LossConfig
    from forge.types import Episode, collate
    from services.reference import Reference
    from services.schema import TrainerConfig
    from services.trainer import Trainer

    tiny_model_dir = request.getfixturevalue(model)

    async def main():
        store = await start_store()
        weights = WeightStore("parity")
        cfg = TrainerConfig(lr=1e-3, loss=LossConfig(name="reinforce"))
        trainer = await Trainer.options(procs=1).as_service(str(tiny_model_dir), cfg, weights)
        gen = await Generator.options().as_service(str(tiny_model_dir), GeneratorConfig(max_model_len=256), weights)
        ref = await Reference.options().as_service(str(tiny_model_dir), chunk_rows=3)
        sync = WeightSync(trainer, gen)
        await sync.start()
        try:
            initial = await trainer.logprobs.route(fixed_batch())
            for _ in range(3):
                b = fixed_batch()
                await trainer.train_step.route(on_policy(b, await trainer.logprobs.route(b)))
            assert await sync.push() == 3
            await sync.wait_held(3, timeout_s=60)
            prompts = ("rev abc=", "12+7=", "sort cba=")
            groups = await asyncio.gather(*(gen.generate.route(p, n=4, sampling={"max_tokens": 24}) for p in prompts))
            await trainer.export_hf.route(str(tmp_path / "hf"))
            fresh = await Generator.options().as_service(str(tmp_path / "hf"), GeneratorConfig(max_model_len=256))
            greedy = {"max_tokens": 24, "temperature": 0.0}
            try:
                swapped = [(await gen.generate.route(p, sampling=greedy))[0].token_ids for p in prompts]
                anew = [(await fresh.generate.route(p, sampling=greedy))[0].token_ids for p in prompts]
            finally:
                await fresh.shutdown()
            assert swapped == anew
            episodes = [Episode.from_completion(c) for g in groups for c in g]
            batch = collate(episodes, pad_id=0)
            trainer_lp = await trainer.logprobs.route(batch)
            again = await trainer.logprobs.route(batch)
            for i in range(len(episodes)):
                batch.advantages[batch.doc_ids == i] = 1.0 if i % 2 else -1.0
            _, step0 = await trainer.train_step.route(batch)  # a step on the generator's fresh tokens
            ref_fixed = await ref.logprobs.route(fixed_batch())
            pushed = await weights.fetch(3)
        finally:
            await sync.stop()
            await asyncio.gather(gen.shutdown(), trainer.shutdown(), ref.shutdown())
            await weights.clear()
            await stop_store(store)
        return groups, batch, trainer_lp, again, step0, initial, ref_fixed, pushed

    groups, batch, trainer_lp, again, step0, initial, ref_fixed, pushed = asyncio.run(main())
    assert max_logprob_error(tiny_model_dir, [c for g in groups for c in g], pushed) <= 1e-4
    assert all(c.policy_version == 3 for g in groups for c in g)
    m = batch.loss_mask.bool()
    d = (trainer_lp - batch.gen_logprobs)[m]  # log(pi_trainer / pi_generator) per token
    k3 = (torch.exp(-d) + d - 1).mean().item()
    assert k3 <= 1e-4 and (torch.exp(d) - 1).abs().max().item() <= 1e-5, (k3, d.abs().max())
    assert (ref_fixed - initial).abs().max().item() <= 1e-5  # reference = initial policy
    # Step 0 on-policy: the PPO ratio's old logprobs are the trainer's own, recomputed bit for bit
    # (ratio exactly 1); the mismatch is measured on every sampled token, and only numerics remain.
    assert torch.equal(trainer_lp, again)
    print(model, {k: v for k, v in step0.items() if k.startswith("mismatch")})
    assert step0["mismatch/tokens"] == batch.loss_mask.sum().item()
    assert step0["mismatch/kl"] <= 1e-9 and step0["mismatch/abs_logprob_max"] <= 1e-4, step0
    assert step0["mismatch/outside_cap_frac"] == 0 and step0["is_ratio_mean"] == pytest.approx(1, abs=1e-5)


class SlowLoads:
    """A generator service (one replica) whose loads take `load_s` (a cross-host fetch)."""

    def __init__(self, load_s: float):
        self.version = 0

        async def load(v: int) -> list[int]:
            await asyncio.sleep(load_s)
            self.version = v
            return [v]

        async def version() -> list[int]:
            return [self.version]

        self.load_version = SimpleNamespace(fanout=load)
        self.policy_version = SimpleNamespace(fanout=version)


def test_a_hold_shorter_than_a_load_enters_while_versions_keep_coming():
    """A hold (eval.max_hold_s) shorter than the load under way is still in force when that
    load lands: its time counts from entering, so the holder enters before the next load."""

    async def main():
        sync = WeightSync(None, SlowLoads(load_s=0.5))
        await sync.start()

        async def trainer():  # a version every 0.1 s, faster than they load
            for v in itertools.count(1):
                sync.publish(v)
                await asyncio.sleep(0.1)

        pushing = asyncio.create_task(trainer())
        try:
            await asyncio.sleep(0.05)  # version 1 is loading
            async with asyncio.timeout(3), sync.hold(1, 0.1) as held:
                assert held == sync.held >= 1
        finally:
            pushing.cancel()
            await sync.stop()

    asyncio.run(main())


def test_shm_file_format_mixed_dtypes(tmp_path):
    """The one-copy writer makes files safetensors reads, also for odd sizes and non-contiguous tensors."""
    from safetensors.torch import load_file as st_load

    from forge.shm import read_safetensors, write_safetensors

    sd = {
        "a": torch.randn(3, 4),
        "b": torch.arange(10),
        "c": torch.randn(5).to(torch.bfloat16),
        "d": torch.randn(2, 3).t(),
    }
    for _ in range(2):  # the second write reuses the file in place
        write_safetensors(sd, tmp_path / "w.safetensors")
        for got in (st_load(tmp_path / "w.safetensors"), read_safetensors(tmp_path / "w.safetensors")):
            assert all(torch.equal(got[k], sd[k]) for k in sd)


def test_shm_file_digest_is_of_the_bytes_written(tmp_path):
    """write_safetensors(hashed=True) returns the digest of the file it wrote, a new one or one
    rewritten in place, also with no tensor at all (its header alone)."""
    from forge.shm import file_digest, write_safetensors

    for sd in ({}, {"a": torch.randn(3, 4), "b": torch.arange(10)}):
        path = tmp_path / f"w{len(sd)}.safetensors"
        for _ in range(2):  # the second write reuses the file in place
            assert write_safetensors(sd, path, hashed=True) == file_digest(path)


def test_shm_mappings_of_unlinked_files_are_dropped(tmp_path):
    """A kept mapping would keep an unlinked file's memory: the next read drops it."""
    from forge import shm

    sd = {"w": torch.randn(64)}
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    shm.write_safetensors(sd, a)
    shm.write_safetensors(sd, b)
    shm.read_safetensors(a)
    ino_a = os.stat(a).st_ino
    assert any(k[1] == ino_a for k in shm._MAPS)
    a.unlink()
    assert torch.equal(shm.read_safetensors(b)["w"], sd["w"])
    assert not any(k[1] == ino_a for k in shm._MAPS)
    shm.forget_mapping(b)
    assert not any(k[1] == os.stat(b).st_ino for k in shm._MAPS)
