"""Where a prompt's next tokens are stored, found by content: approximate runs for `span_cover`.

The sidecar's similar segments (MinHash/LSH, or beginning as the window does) of
chunk-long windows a quarter chunk apart, then `cover`. Windows are asked for a chunk at
a time from where the runs found so far end, not past a chunk no run reaches, nor past a
deadline (the runs found by then are kept: a slow search must not cost the request its
exact prefix). Runs on the connector's lookup thread.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvsplice.integrations.vllm.sidecar_faults import FaultLog
from kvsplice.integrations.vllm.span_cover import ReusedSpan, StoredTokens, cover

# Windows of a chunk, a quarter chunk apart (a stored chunk then overlaps one of them by
# at least 7/8, enough for the LSH), at most this many past the exact prefix, and at most
# this many similar segments read per window.
MAX_SPAN_WINDOWS = 64
MAX_SPAN_CANDIDATES = 4
# A run shorter than this is not loaded (its tokens are computed).
MIN_SPAN_TOKENS = 16
# The runs found within this share of the lookup deadline are kept, the search stops there
# (a timed-out lookup is a miss).
SPAN_SEARCH_SHARE = 0.5


def find_spans(
    store: Any, root: str, token_ids: Sequence[int], start: int, *,
    block_size: int, chunk_tokens: int, deadline: float, faults: FaultLog,
    exact_only: bool = False,
) -> tuple[ReusedSpan, ...]:  # fmt: skip
    """Stored runs of `token_ids` from `start` on (whole blocks, leaving the last token);
    `exact_only`: of segments computed on an exact chain only (the anchor mode's bases:
    an offset corrects K/V of the kind it was measured against, a sender's own).

    NOTE: each candidate's tokens come with the search's answer (`with_token_ids`, from
    the sidecar's catalog): no payload is read here; a run's segment is fetched (and
    verified) once, by the load. A candidate without tokens (an older sidecar) is skipped,
    a fault.
    """
    end = (len(token_ids) - 1) // block_size * block_size
    step = max(1, chunk_tokens // 4)
    candidates: dict[str, StoredTokens] = {}
    spans: tuple[ReusedSpan, ...] = ()
    position, num_queries, late = start, 0, False
    while position < end and num_queries < MAX_SPAN_WINDOWS and not late:
        for window in range(position, min(position + chunk_tokens, end), step):
            late = time.monotonic() > deadline
            if late:
                faults.record(
                    "looking up approximate runs stopped",
                    f"past {SPAN_SEARCH_SHARE:.0%} of the lookup deadline",
                )
                break
            num_queries += 1
            window_ids = token_ids[window : window + chunk_tokens]
            if _add_candidates(store, root, window_ids, candidates, exact_only):
                faults.record(
                    "approximate candidates came without their tokens",
                    "the sidecar predates FindSimilar's with_token_ids (upgrade it)",
                )
        spans = cover(token_ids, start, end, list(candidates.values()), min_run=MIN_SPAN_TOKENS)
        reached = spans[-1].end if spans else start
        if reached <= position:  # nothing from here on: the tokens are new
            break
        position = reached
    return spans


def _add_candidates(
    store: Any, root: str, window: Sequence[int], candidates: dict[str, StoredTokens],
    exact_only: bool,
) -> int:  # fmt: skip
    """Adds the window's new candidates; returns how many came without tokens (skipped)."""
    num_tokenless = 0
    found = store.find_similar(root, window, limit=MAX_SPAN_CANDIDATES, with_token_ids=True)
    for candidate in found:
        ref = candidate.segment
        num_tokenless += not candidate.token_ids
        if ref.segment_id in candidates or ref.layer_start != 0 or not candidate.token_ids:
            continue
        if candidate.exact or not exact_only:
            candidates[ref.segment_id] = StoredTokens(
                ref.segment_id, ref.start_position, tuple(candidate.token_ids)
            )
    return num_tokenless
