"""Actors for test_store.py; a module of its own so Monarch children can import it."""

import os

import torchstore
from monarch.actor import Actor, endpoint

import forge.store  # noqa: F401  (the child needs the torchstore adapter too)


class Fetcher(Actor):
    @endpoint
    async def fetch(self, key: str) -> tuple[int, list[float]]:
        sd = await torchstore.get_state_dict(key)
        return os.getpid(), [v.sum().item() for v in sd.values()]


class HostReader(Actor):
    """Reads a weights version as a generator on another host would."""

    @endpoint
    async def read(self, store, version: int) -> tuple[list[float], str]:
        async with store.open(version) as sd:
            sums = [t.sum().item() for t in sd.values()]
        return sums, await store.local_path(version)

    @endpoint
    async def check_intact(self, store, version: int, path: str) -> str:
        try:
            await store.check_intact(version, path)
        except KeyError as e:
            return str(e)
        return ""
