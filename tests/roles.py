"""Processes of a forge run, found by the role each runs (its process title)."""

import time

import psutil


def role(parent: psutil.Process, title: str, timeout: float = 180) -> psutil.Process:
    """The child process of `parent` that runs the forge role `title` (its process title),
    once there is one: a role being respawned has no process, or one not yet titled."""
    deadline = time.time() + timeout
    while True:
        found, seen = [], []
        for p in parent.children(recursive=True):
            try:
                seen.append(p.cmdline()[:1])
            except psutil.Error:  # exited meanwhile
                continue
            if seen[-1] == [f"forge:{title}"]:
                found.append(p)
        if len(found) == 1:
            return found[0]
        assert time.time() < deadline, seen
        time.sleep(0.2)


def running(parent: psutil.Process, titles: tuple[str, ...]) -> list[psutil.Process]:
    """The live child processes of `parent` that run one of the forge roles `titles`."""
    found = []
    for p in parent.children(recursive=True):
        try:
            if p.cmdline()[:1] in [[f"forge:{t}"] for t in titles] and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:  # exited meanwhile
            continue
    return found
