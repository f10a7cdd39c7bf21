"""forge's own lines on the console, between the progress bar's redraws.

    report("agent episode failed", "ValueError: ... maximum context length is 64 ...")

Episode, rollout and environment failures cost only their episode, and a run may have
thousands: the first of each distinct kind is printed with its message, the rest are counted
(the progress bar shows the run's failures, metrics.jsonl each step's).
"""

from __future__ import annotations

import re

from tqdm import tqdm

_seen: set[tuple[str, str]] = set()


def _shape(message: str) -> str:
    """What failures of one kind share: the message without its quoted values and numbers."""
    return re.sub(r"'[^']*(?:'|$)|\"[^\"]*(?:\"|$)|\d+(\.\d+)?", "_", message)[:120]  # a literal cut short too


def first(what: str, message: str) -> bool:
    """Whether this is the first failure of `what` with a message of this shape."""
    key = (what, _shape(message))
    if key in _seen:
        return False
    _seen.add(key)
    return True


def report(what: str, message: str) -> bool:
    """Print `forge: WHAT: MESSAGE` the first time a failure of this shape happens; True if printed."""
    if not first(what, message):
        return False
    tqdm.write(f"forge: {what}: {message} (the first like it; the rest are counted)")
    return True
