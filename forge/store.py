"""Weights on TorchStore. Importing this module makes torchstore 0.1.2 usable on Monarch 0.7.

Import it (not `torchstore` directly) in every process that touches the store: a
generator that calls `torchstore.get` unpickles a Controller handle, and Monarch
re-checks the class there too.
"""

from __future__ import annotations

import functools
import inspect

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
