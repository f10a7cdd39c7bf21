"""A weight version as its change from an older one: the 16-bit words of its file that differ
from the older version's file, found once by the writer and sent to each host that holds the
older one.

After a small update most elements of a bf16 model keep their value (a step of lr 1e-6 moves
~4% of them, measured by `forge bench weight_sync`), so the changed words, with their offsets,
are a small part of the file; fp32 files change nearly everywhere and fall back to full fetches
(`make` returns None when the delta is not smaller than `MAX_RATIO` of the file).

Layout: MAGIC, the HMAC-SHA256 tag (32 bytes, keyed by the run's weights key) of all that
follows, a header (the base's and the target's file names, the file size, the changed word
count), then per block of 2^16 words the count of changed words (uint32), then their offsets
in the block (uint16) and their new values (uint16). A reader applies a delta only if the tag is
the key's and it names the base it holds and the version it asked for; the result is still
checked against the version record's digest before it takes its name.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import mmap
import os
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

MAGIC = b"forge-delta-1\n"
BLOCK = 1 << 16  # words per block: an offset within it is a uint16
MAX_RATIO = 0.5  # a delta this share of the file or more is not worth a base copy and a scatter
_SCAN = 256 * BLOCK  # words compared at once (32 MB of each file)
_LEN = struct.Struct("<I")
_TAG = 32


def _nothing(upto: int) -> None:
    pass


class DeltaError(ValueError):
    """A delta that is not for this base and version, or not the writer's."""


def _words(path: Path) -> np.ndarray:
    """The file as read-only uint16 words (a mapping, no copy)."""
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return np.zeros(0, np.uint16)
        return np.frombuffer(mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ), np.uint16)


def _changes(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One span of words (whole blocks): per block its changed count, then their offsets and values."""
    at = np.flatnonzero(old != new)
    counts = np.bincount(at >> 16, minlength=-(-new.size // BLOCK)).astype("<u4")
    return counts, (at & 0xFFFF).astype("<u2"), new[at].astype("<u2")


def make(base: Path, target: Path, key: str) -> bytes | None:
    """The delta that turns file `base` into file `target`, tagged with `key`; None when the
    two differ in size (or have an odd one) or the delta would not be smaller than MAX_RATIO
    of `target`. Spans are compared by a thread each (numpy lets go of the GIL), in order, so
    a file that changes everywhere stops after the first few."""
    size = os.path.getsize(target)
    if size % 2 or os.path.getsize(base) != size:
        return None
    old, new = _words(base), _words(target)
    parts, changed = [], 0
    with ThreadPoolExecutor(min(4, os.cpu_count() or 1), thread_name_prefix="forge-delta") as pool:
        spans = [pool.submit(_changes, old[i : i + _SCAN], new[i : i + _SCAN]) for i in range(0, new.size, _SCAN)]
        for span in spans:
            parts.append(span.result())
            changed += parts[-1][1].size
            if 4 * changed >= MAX_RATIO * size:
                for rest in spans:
                    rest.cancel()
                return None
    header = json.dumps({"base": base.name, "target": target.name, "size": size, "changed": changed}).encode()
    body = b"".join([_LEN.pack(len(header)), header] + [part[i].tobytes() for i in range(3) for part in parts])
    return MAGIC + _tag(key, body) + body


def _tag(key: str, body: bytes) -> bytes:
    # Keyed by a key of its own, derived from the run's: readers send another (forge.transfer.wire_key).
    tag_key = hmac.new(key.encode(), b"forge-weights-delta", hashlib.sha256).digest()
    return hmac.new(tag_key, body, hashlib.sha256).digest()


def read(delta: bytes, key: str, base: str, target: str, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The (word index, new value) pairs of `delta`, once its tag is `key`'s and it turns file
    `base` into file `target` of `size` bytes; DeltaError if not."""
    if not delta.startswith(MAGIC) or len(delta) < len(MAGIC) + _TAG + _LEN.size:
        raise DeltaError("not a forge weights delta")
    tag, body = delta[len(MAGIC) : len(MAGIC) + _TAG], memoryview(delta)[len(MAGIC) + _TAG :]
    if not hmac.compare_digest(tag, _tag(key, body)):
        raise DeltaError("its tag is not the run's key's (corrupted, or not from the run's writer)")
    try:  # a tag proves who made it, not that it is well made (a buggy writer): its shape is checked
        (n,) = _LEN.unpack_from(body)
        header = json.loads(bytes(body[_LEN.size : _LEN.size + n]))
        want = {"base": base, "target": target, "size": size}
        if {k: header.get(k) for k in want} != want:
            raise DeltaError(
                f"it turns {header.get('base')} into {header.get('target')}; this reader needs {base} into {target}"
            )
        blocks, changed, at = -(-size // 2 // BLOCK), header["changed"], _LEN.size + n
        if type(changed) is not int or len(body) != at + 4 * blocks + 4 * changed:
            raise DeltaError(f"its body is not {blocks} block counts and {changed!r} changed words")
        counts = np.frombuffer(body, "<u4", blocks, at)
        offsets = np.frombuffer(body, "<u2", changed, at + 4 * blocks)
        values = np.frombuffer(body, "<u2", changed, at + 4 * blocks + 2 * changed)
    except (KeyError, TypeError, ValueError, AttributeError, struct.error) as e:
        raise e if isinstance(e, DeltaError) else DeltaError(f"malformed ({type(e).__name__}: {e})") from None
    if int(counts.sum()) != changed:
        raise DeltaError("its block counts do not add up to its changed words")
    index = np.repeat(np.arange(blocks, dtype=np.int64) << 16, counts) + offsets
    if changed and (int(index[-1]) >= size // 2 or not bool((np.diff(index) > 0).all())):
        raise DeltaError("its changed words are not in order within the file")
    return index, values


def apply(delta: bytes, key: str, base: Path, target: str, fd: int, written: Callable[[int], None] = _nothing) -> None:
    """Write the file `target` into `fd` (truncated to its size): the file `base` with
    `delta`'s words; DeltaError unless `delta` is `key`'s and turns `base` into `target`.
    `written(n)` is told as each part of the file is final (bytes [0, n)), so a digest can hash
    it while the rest is written."""
    size = os.path.getsize(base)
    index, values = read(delta, key, base.name, target, size)
    os.ftruncate(fd, size)
    if not size:
        return
    bounds = np.searchsorted(index, np.arange(0, size // 2 + _SCAN, _SCAN))
    with open(os.open(base, os.O_RDONLY | os.O_NOFOLLOW), "rb") as src, mmap.mmap(fd, size) as m:
        words = np.frombuffer(m, np.uint16)
        try:
            for part, start in enumerate(range(0, size, 2 * _SCAN)):
                end, copied = min(size, start + 2 * _SCAN), start
                while copied < end:  # in the kernel: no pass through this process's memory
                    copied += os.copy_file_range(src.fileno(), fd, end - copied, copied, copied)
                lo, hi = bounds[part], bounds[part + 1]
                words[index[lo:hi]] = values[lo:hi]
                written(end)
        finally:
            # The mapping closes only once no array views it: else an error here (ENOSPC) comes
            # out as a BufferError, which names nothing and no caller's fallback catches.
            del words
