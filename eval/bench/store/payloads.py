"""The segments the store benches put: random int8 payloads, valid chained metadata, memcpy,
and the bandwidth of a timed move beside `numpy.copyto` of the same bytes (`CopyTimed`).

Shared by `bench` (tiers), `paths` (read paths) and `put_path`; it times nothing itself.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvsplice.common.keys import root_key
from kvsplice.common.segment import SegmentMeta, chained_meta
from kvsplice.index.bench_lookup import BENCH_FINGERPRINT, BENCH_NAMESPACE
from kvsplice.storeclient.wire import with_payload_digest

MB = 1_000_000  # MB/s figures are decimal megabytes; sizes are binary MiB
MIB = 1 << 20
NUM_LAYERS = 30
SEGMENT_TOKENS = 64
VOCAB_SIZE = 32_000


def make_payload(rng: np.random.Generator, nbytes: int) -> bytes:
    """Random int8 values, like a quantized K/V payload (incompressible)."""
    return rng.integers(-128, 128, size=nbytes, dtype=np.int8).tobytes()


def make_segment_meta(rng: np.random.Generator, payload: bytes) -> SegmentMeta:
    """A valid segment at position 0: random tokens, really chained keys, `payload`'s digest."""
    tokens = tuple(rng.integers(0, VOCAB_SIZE, size=SEGMENT_TOKENS).tolist())
    parent = root_key(BENCH_FINGERPRINT)
    meta = chained_meta(BENCH_NAMESPACE, BENCH_FINGERPRINT, parent, tokens, 0, NUM_LAYERS)
    return with_payload_digest(meta, payload)


def copyto_of(payload: bytes) -> Callable[[], None]:
    source = np.frombuffer(payload, dtype=np.int8)
    target = np.empty_like(source)
    return lambda: np.copyto(target, source)


class CopyTimed:
    """A row's median `seconds` to move `size_mib` MiB, and `copyto_seconds` for
    `numpy.copyto` of the same bytes, as bandwidths (the rows are the dataclasses)."""

    size_mib: int
    seconds: float
    copyto_seconds: float

    @property
    def mb_per_s(self) -> float:
        return self.size_mib * MIB / MB / self.seconds

    @property
    def copyto_mb_per_s(self) -> float:
        return self.size_mib * MIB / MB / self.copyto_seconds

    @property
    def ratio_to_copyto(self) -> float:
        """The move's bandwidth as a fraction of copyto's."""
        return self.copyto_seconds / self.seconds
