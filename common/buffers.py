"""Large byte buffers that are cheap to fill: populated anonymous maps, reused once free.

NOTE: a buffer of many MiB from malloc is fresh mmap'd memory that faults in page by
page while it is filled (on a VM, every first touch costs more than the copy itself:
~40% of a loopback segment get of 32 MiB on a 2-core host). `MAP_POPULATE` has the
kernel fault a map in one call, and `BufferPool` reuses maps nothing references any
more, so a worker that reads segment after segment pays for its buffers once.
"""

from __future__ import annotations

import mmap
import sys
import threading

POPULATE_MIN_NBYTES = 1 << 20


def writable_buffer(nbytes: int) -> memoryview:
    """A fresh writable, zeroed buffer of `nbytes` (kept alive by the view)."""
    if nbytes < POPULATE_MIN_NBYTES or not hasattr(mmap, "MAP_POPULATE"):
        return memoryview(bytearray(nbytes))
    return memoryview(_populated_map(nbytes))


class BufferPool:
    """Receive buffers of up to `max_bytes` in all, handed out again once free.

    A map is free when only the pool refers to it: every view of it (memoryview
    slices, numpy arrays, tensors over it) holds a reference to the map, so CPython's
    reference count tells when the last one is gone. A taken buffer holds stale bytes:
    the caller overwrites all of it.
    """

    # NOTE: references to a free map while `_free_map` looks at it: the pool's list,
    # the loop variable and getrefcount's own argument.
    _FREE_REFCOUNT = 3

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes {max_bytes} must be >= 0")
        self.max_bytes = max_bytes
        self._maps: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> memoryview:
        """A writable buffer of exactly `nbytes` (not zeroed when reused)."""
        if nbytes < POPULATE_MIN_NBYTES or nbytes > self.max_bytes:
            return writable_buffer(nbytes)
        with self._lock:
            found = self._free_map(nbytes)
            if found is None:
                found = self._grow(nbytes)
        return memoryview(found)[:nbytes]

    def _free_map(self, nbytes: int) -> mmap.mmap | None:
        for candidate in self._maps:
            fits = nbytes <= len(candidate) <= 2 * nbytes
            if fits and sys.getrefcount(candidate) == self._FREE_REFCOUNT:
                return candidate
        return None

    def _grow(self, nbytes: int) -> mmap.mmap:
        """A new map, after dropping free maps until it fits the budget (busy ones stay)."""
        pooled = sum(len(m) for m in self._maps)
        for candidate in list(self._maps):
            if pooled + nbytes <= self.max_bytes:
                break
            if sys.getrefcount(candidate) == self._FREE_REFCOUNT:
                self._maps.remove(candidate)
                pooled -= len(candidate)
        created = _populated_map(nbytes) if hasattr(mmap, "MAP_POPULATE") else None
        if created is None:
            return mmap.mmap(-1, nbytes)
        if pooled + nbytes <= self.max_bytes:
            self._maps.append(created)
        return created


def _populated_map(nbytes: int) -> mmap.mmap:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
    return mmap.mmap(-1, nbytes, flags=flags)
