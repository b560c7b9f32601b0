"""Large byte buffers that are cheap to fill: an anonymous map the kernel faults in at once.

NOTE: a buffer of many MiB from malloc is fresh mmap'd memory that faults in page by
page while it is filled (~40% of a loopback segment get of 32 MiB on a 2-core host);
`MAP_POPULATE` has the kernel fault the whole map in one call. Small buffers (and
systems without it) are bytearrays.
"""

from __future__ import annotations

import mmap

POPULATE_MIN_NBYTES = 1 << 20


def writable_buffer(nbytes: int) -> memoryview:
    """A writable, zeroed buffer of `nbytes` (kept alive by the view)."""
    if nbytes < POPULATE_MIN_NBYTES or not hasattr(mmap, "MAP_POPULATE"):
        return memoryview(bytearray(nbytes))
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
    return memoryview(mmap.mmap(-1, nbytes, flags=flags))


def copied(data: bytes | memoryview) -> memoryview:
    """A private copy of `data` in a `writable_buffer`."""
    buffer = writable_buffer(len(data))
    buffer[:] = data
    return buffer
