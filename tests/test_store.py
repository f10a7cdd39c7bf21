import asyncio
import os

import torch


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
