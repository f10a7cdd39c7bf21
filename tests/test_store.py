import asyncio
import os
import threading
import uuid
from pathlib import Path

import pytest
import torch

from forge.shm import write_safetensors


def test_torchstore_works_on_monarch_07():
    """The adapter in forge.store makes torchstore 0.1.2 put/get/state_dict work, also
    from another process (without it Monarch 0.7 refuses the Controller actor)."""
    import torchstore
    from monarch.actor import this_host
    from store_actors import Fetcher

    import forge.store  # noqa: F401

    async def main():
        volumes = this_host().spawn_procs(per_host={"procs": 1})
        fetchers = this_host().spawn_procs(per_host={"procs": 1})
        try:
            await torchstore.initialize(mesh=volumes)
            x = torch.randn(4, 5)
            await torchstore.put("x", x)
            assert torch.equal(await torchstore.get("x"), x)

            sd = torch.nn.Linear(8, 8).state_dict()
            await torchstore.put_state_dict(sd, "v1")
            back = await torchstore.get_state_dict("v1")
            assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)

            pid, sums = await fetchers.spawn("fetcher", Fetcher).fetch.call_one("v1")
            assert pid != os.getpid()
            assert sums == [v.sum().item() for v in sd.values()]

            await torchstore.delete("x")
            assert not await torchstore.exists("x")
        finally:
            await torchstore.shutdown()
            await fetchers.stop()
            await volumes.stop()

    asyncio.run(main())


def failing_state_dict() -> dict[str, torch.Tensor]:
    """A state dict whose file fails part-way through its write (a meta tensor has no bytes)."""
    return {"w": torch.zeros(1000), "b": torch.empty(10, device="meta")}


def spare_of(ws, tmp_path: Path) -> Path:
    """A spare file of `ws`'s, as `WeightStore.drop` leaves one, sized for `failing_state_dict()`."""
    spare = tmp_path / f"{ws.name}-{ws._token}-spare-{uuid.uuid4().hex[:8]}.safetensors"
    write_safetensors({"w": torch.zeros(1000), "b": torch.zeros(10)}, spare)
    return spare


@pytest.mark.parametrize("with_spare", [False, True])
def test_a_failed_publish_leaves_no_file_and_keeps_its_spare(tmp_path, with_spare):
    """A publish whose write fails (e.g. ENOSPC in /dev/shm) leaves no `.tmp` holding RAM, and
    the dropped version's spare it took is a spare again."""
    from forge.store import WeightStore

    ws = WeightStore("p", shm_dir=str(tmp_path))
    spare = spare_of(ws, tmp_path) if with_spare else None
    with pytest.raises(NotImplementedError):
        asyncio.run(ws.publish(3, failing_state_dict()))
    ws._server.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ([spare.name] if with_spare else [])


def test_a_cancelled_publish_gives_its_file_back_once_its_write_is_done(tmp_path, monkeypatch):
    from forge import store

    ws = store.WeightStore("p", shm_dir=str(tmp_path))
    spare = spare_of(ws, tmp_path)
    go, wrote = threading.Event(), threading.Event()

    def slow_write(*args):  # a big model's write, under way when the publish is cancelled
        go.wait(10)
        try:
            return write_safetensors(*args)
        finally:
            wrote.set()

    monkeypatch.setattr(store, "write_safetensors", slow_write)

    async def main():
        publish = asyncio.create_task(ws.publish(3, {"w": torch.ones(1000), "b": torch.ones(10)}))
        await asyncio.sleep(0.1)
        publish.cancel()
        await asyncio.gather(publish, return_exceptions=True)
        go.set()
        await asyncio.to_thread(wrote.wait, 10)
        await asyncio.sleep(0.1)  # the write's end reaches this loop

    asyncio.run(main())
    ws._server.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [spare.name]
