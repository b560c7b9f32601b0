"""What a looked-up request is promised: its exact stored prefix, then the runs that continue it.

`Answer` is what the sidecar held for a request's tokens when it was asked (stale once
the request grew, or after `LOOKUP_MAX_AGE_S`); `promise` cuts it to whole blocks and says
where the approximate fence goes. Pure: no vLLM, no store client.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvsplice.integrations.vllm.span_cover import ReusedSpan, trimmed
from kvsplice.storeclient.results import PrefixLookup

# A request that waited this long since its lookup is looked up again before a load.
LOOKUP_MAX_AGE_S = 10.0


@dataclass(frozen=True)
class Answer:
    """What the sidecar held for a request's first `num_tokens` tokens, asked at `at_s`."""

    lookup: PrefixLookup
    spans: tuple[ReusedSpan, ...]  # approximate runs past the exact prefix
    num_tokens: int
    at_s: float

    def is_stale(self, num_tokens: int) -> bool:
        """Whether the request changed (a resumed request has more tokens) or waited so
        long since its lookup that what it found may have been evicted."""
        age_s = time.monotonic() - self.at_s
        return self.num_tokens != num_tokens or age_s > LOOKUP_MAX_AGE_S


@dataclass(frozen=True)
class Promise:
    end: int  # the request's tokens up to here are computed, cached or loaded
    spans: tuple[ReusedSpan, ...] = ()  # the approximate runs loaded, from `fence` on
    fence: int | None = None  # the first token whose K/V may be approximate


def promise(answer: Answer, cap: int, num_computed_tokens: int, block_size: int) -> Promise:
    """The stored run past `num_computed_tokens` in whole blocks up to `cap`: the exact
    prefix, then (fenced where they start) the approximate runs that continue it."""
    matched, spans = answer.lookup.num_matched_tokens, answer.spans
    end = max(min(matched, cap) // block_size * block_size, num_computed_tokens)
    if spans and spans[0].start == matched:
        approximate_end = min(spans[-1].end, cap) // block_size * block_size
        if approximate_end > end:
            return Promise(approximate_end, trimmed(spans, end, approximate_end), end)
    return Promise(end)
