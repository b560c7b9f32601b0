"""Where the time of one agent call goes: the reuse path's stages, in seconds.

Owns `CallTimings` and the `timed` context manager that adds a stage's
`time.perf_counter()` span to it. It measures; it does not decide what counts as
TTFT (that is the engine's: everything up to the first token, store puts excluded).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

logger = logging.getLogger(__name__)


@dataclass
class CallTimings:
    """Seconds per stage; stages before the first token sum to (about) the TTFT.

    lookup_s: store index calls (LookupPrefix, FindSimilar).  fetch_s: GetSegment.
    decode_s: payload decode/dequantize.  shift_s: RoPE Δ-rotation of reused keys.
    base_prefill_s: standalone prefills of placeholder base caches (KVComm left these out).
    splice_s: appending reused K/V to the model cache.  prefill_s: model forwards over
    computed spans.  first_decode_s: picking the first token from the prefill logits.
    After the first token (not in TTFT): decode_tokens_s (the rest of generation),
    store_s (capturing this call's segments and putting them, or queueing them for the
    engine's writer thread).
    """

    lookup_s: float = 0.0
    fetch_s: float = 0.0
    decode_s: float = 0.0
    shift_s: float = 0.0
    base_prefill_s: float = 0.0
    splice_s: float = 0.0
    prefill_s: float = 0.0
    first_decode_s: float = 0.0
    decode_tokens_s: float = 0.0
    store_s: float = 0.0

    def add(self, stage: str, seconds: float) -> None:
        if not hasattr(self, stage):
            raise ValueError(f"unknown timing stage {stage!r}")
        setattr(self, stage, getattr(self, stage) + seconds)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


@contextmanager
def timed(timings: CallTimings, stage: str) -> Iterator[None]:
    """Add the wall time of the `with` body to `timings.<stage>` (also when it raises)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timings.add(stage, time.perf_counter() - start)
