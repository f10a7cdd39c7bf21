"""Actors for the service tests; a module of its own so Monarch children can import it."""

import asyncio
import os

from monarch.actor import current_rank, endpoint

from forge.actor import ForgeActor


class Probe(ForgeActor):
    def __init__(self, tag: str = "probe"):
        self.tag = tag
        self.respawned = False

    @endpoint
    async def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def echo(self, x):
        return (self.tag, x)

    @endpoint
    async def nap(self, seconds: float) -> int:
        await asyncio.sleep(seconds)
        return os.getpid()

    @endpoint
    async def boom(self, msg: str) -> None:
        raise ValueError(msg)

    @endpoint
    async def rank(self) -> int:
        return current_rank().rank

    @endpoint
    async def on_respawn(self) -> None:
        self.respawned = True

    @endpoint
    async def was_respawned(self) -> bool:
        return self.respawned
