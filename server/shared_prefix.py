"""A prefix match carried past the local index into the shared tier (lookup read-through).

A sidecar's index knows what it stored and what the shared tier's event streams told it.
A segment another sidecar put moments ago (its event not yet polled here), or whose event
was trimmed off the stream or lost while this sidecar's catch-up failed, is in the cluster
but not in the index. Where a match stops short of the prompt, the next segment's context
key is computed for each segment length workers here use (the index's commonest) and asked
of the shared tier; a record found is read through (verified, cached, cataloged, indexed)
and the walk goes on from its end. A miss costs one existence check per length tried.
Blocking I/O: call it off the event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvsplice.common.errors import StoreUnavailable
from kvsplice.common.keys import context_key, root_key
from kvsplice.common.segment import SegmentMeta
from kvsplice.index.exact_index import PrefixMatch
from kvsplice.storage.keyspace import segment_key
from kvsplice.storage.tiered_store import TieredStore

logger = logging.getLogger(__name__)

MAX_PROBE_LENGTHS = 4  # segment lengths tried at each position


@dataclass(frozen=True)
class SharedProbe:
    """What a lookup asks of the shared tier: the local match and the lengths to try."""

    namespace: str
    fingerprint: str
    token_ids: tuple[int, ...]
    match: PrefixMatch
    lengths: tuple[int, ...]  # none: nothing to ask (no shared tier, degraded, or complete)

    @property
    def extendable(self) -> bool:
        return bool(self.lengths)


def extend_from_shared(store: TieredStore, probe: SharedProbe) -> PrefixMatch:
    """`probe.match` extended with the chained segments the shared tier holds; stops at
    the first position where no length finds one, or at once while the tier is degraded."""
    shared = store.shared
    tokens = probe.token_ids
    segments = list(probe.match.segments)
    position = probe.match.num_matched_tokens
    parent = segments[-1].context_key if segments else root_key(probe.fingerprint)
    if shared is None or not probe.lengths:
        return probe.match
    try:
        while position < len(tokens):
            meta = _next_segment(store, probe, parent, position)
            if meta is None:
                break
            segments.append(meta)
            position, parent = meta.end_position, meta.context_key
    except StoreUnavailable as exc:
        logger.debug("lookup not carried into the shared tier: %s", exc)
    if len(segments) == len(probe.match.segments):
        return probe.match
    return PrefixMatch(tuple(segments), position)


def _next_segment(
    store: TieredStore, probe: SharedProbe, parent: bytes, position: int
) -> SegmentMeta | None:
    assert store.shared is not None
    for length in probe.lengths:
        span = probe.token_ids[position : position + length]
        if len(span) < length:
            continue
        key = context_key(parent, span)
        if store.get_meta(probe.namespace, key) is None and not store.shared.records.contains(
            segment_key(probe.namespace, key)
        ):
            continue
        stored = store.get(probe.namespace, key)  # read through: verified, cached, announced
        if stored is not None and _continues(stored.meta, probe, parent, span, position):
            return stored.meta
    return None


def _continues(
    meta: SegmentMeta, probe: SharedProbe, parent: bytes, span: Sequence[int], position: int
) -> bool:
    return (
        meta.model_fingerprint == probe.fingerprint
        and meta.parent_key == parent
        and meta.token_ids == tuple(span)
        and meta.start_position == position
    )
