"""Covering a request's tokens with runs of stored segments computed at other positions.

Owns `StoredTokens` (a stored segment's tokens and where it was computed), `ReusedSpan`
(one run of a request's tokens to load from such a segment, its keys moved by Δ) and
`cover`: from a position on, the longest run of the request's next tokens that some
segment holds (anywhere in it), then the next run, and so on while each run is at
least `min_run` tokens long. K/V loaded this way is what the tokens' sender computed
in its own context (`naive` reuse, moved to the new positions): an approximation the
caller must fence. Pure Python: no torch, no vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Runs are found through their first K tokens (an index of every K-gram of the candidates).
GRAM = 8


@dataclass(frozen=True)
class StoredTokens:
    """A stored segment's tokens; `start_position`: where its first token was computed."""

    segment_id: str
    start_position: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class ReusedSpan:
    """Load the request's tokens `[start, start + num_tokens)` from tokens
    `[offset, offset + num_tokens)` of segment `segment_id` (computed from position
    `source_position` on), keys moved by `delta` = new − old position."""

    segment_id: str
    start: int
    num_tokens: int
    offset: int
    source_position: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def delta(self) -> int:
        return self.start - (self.source_position + self.offset)


def cover(
    token_ids: Sequence[int],
    start: int,
    end: int,
    candidates: Sequence[StoredTokens],
    *,
    min_run: int,
) -> tuple[ReusedSpan, ...]:
    """Runs covering `token_ids[start:end]` from `start`, longest first at each step (ties:
    the smallest |Δ|, then the earlier candidate); stops at the first position no run of
    `min_run` tokens starts at."""
    if min_run < 1:
        raise ValueError(f"min_run {min_run} must be >= 1")
    gram = min(GRAM, min_run)
    index: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for c, candidate in enumerate(candidates):
        tokens = candidate.token_ids
        for i in range(len(tokens) - gram + 1):
            index.setdefault(tuple(tokens[i : i + gram]), []).append((c, i))
    spans: list[ReusedSpan] = []
    position = start
    while end - position >= min_run:
        best: tuple[int, int, int, int] | None = None  # (length, -|delta|, -c, offset)
        for c, offset in index.get(tuple(token_ids[position : position + gram]), ()):
            tokens = candidates[c].token_ids
            length = _common_run(token_ids, position, end, tokens, offset)
            delta = position - (candidates[c].start_position + offset)
            key = (length, -abs(delta), -c, offset)
            if best is None or key > best:
                best = key
        if best is None or best[0] < min_run:
            break
        length, _, neg_c, offset = best
        chosen = candidates[-neg_c]
        spans.append(ReusedSpan(chosen.segment_id, position, length, offset, chosen.start_position))
        position += length
    return tuple(spans)


def _common_run(
    token_ids: Sequence[int], position: int, end: int, tokens: Sequence[int], offset: int
) -> int:
    """How many tokens from `position` (before `end`) equal `tokens` from `offset`."""
    n = 0
    limit = min(end - position, len(tokens) - offset)
    while n < limit and token_ids[position + n] == tokens[offset + n]:
        n += 1
    return n


def trimmed(spans: Sequence[ReusedSpan], start: int, end: int) -> tuple[ReusedSpan, ...]:
    """`spans` cut to `[start, end)` (a run cut at the front loads from further in)."""
    kept = []
    for span in spans:
        lo, hi = max(span.start, start), min(span.end, end)
        if lo < hi:
            kept.append(
                ReusedSpan(
                    span.segment_id, lo, hi - lo, span.offset + lo - span.start,
                    span.source_position,
                )
            )  # fmt: skip
    return tuple(kept)
