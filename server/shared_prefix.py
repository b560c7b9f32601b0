"""A prefix match carried past the local index into the shared tier (lookup read-through).

A sidecar's index knows what it stored and what the shared tier's event streams told it.
A segment another sidecar put moments ago (its event not yet polled here), or whose event
was trimmed off the stream or lost while this sidecar's catch-up failed, is in the cluster
but not in the index. Where a match stops short of the prompt, the next segment's context
key is computed for each segment length in use (the cluster's commonest for the namespace,
then the index's: a sidecar that indexed nothing still walks the chain) and asked of the
shared tier; a record found is read through (verified, cached, cataloged, indexed) and the
walk goes on from its end. A miss costs one existence check per length tried (and, at most
once a second per namespace, one read of the cluster's lengths).
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
    """What a lookup asks of the shared tier: the local match, whether to carry it into
    the shared tier (not without one, while degraded, or when complete) and the lengths
    the local index knows (tried after the cluster's, see `probe_lengths`)."""

    namespace: str
    fingerprint: str
    token_ids: tuple[int, ...]
    match: PrefixMatch
    extendable: bool
    local_lengths: tuple[int, ...] = ()


def extend_from_shared(store: TieredStore, probe: SharedProbe) -> PrefixMatch:
    """`probe.match` extended with the chained segments the shared tier holds; stops at
    the first position where no length finds one, or at once while the tier is degraded."""
    shared = store.shared
    tokens = probe.token_ids
    segments = list(probe.match.segments)
    position = probe.match.num_matched_tokens
    parent = segments[-1].context_key if segments else root_key(probe.fingerprint)
    if shared is None or not probe.extendable:
        return probe.match
    try:
        lengths = probe_lengths(probe, shared.lengths.commonest(probe.namespace, MAX_PROBE_LENGTHS))
        while lengths and position < len(tokens):
            meta = _next_segment(store, probe, lengths, parent, position)
            if meta is None:
                break
            segments.append(meta)
            position, parent = meta.end_position, meta.context_key
    except StoreUnavailable as exc:
        logger.debug("lookup not carried into the shared tier: %s", exc)
    if len(segments) == len(probe.match.segments):
        return probe.match
    return PrefixMatch(tuple(segments), position)


def probe_lengths(probe: SharedProbe, cluster_lengths: Sequence[int]) -> tuple[int, ...]:
    """The cluster's lengths of the namespace (every sidecar's published puts), then the
    local index's others (puts not published yet; the index falls back to every namespace
    when it holds none of this one): `MAX_PROBE_LENGTHS` at most."""
    merged = dict.fromkeys((*cluster_lengths, *probe.local_lengths))
    return tuple(merged)[:MAX_PROBE_LENGTHS]


def _next_segment(
    store: TieredStore, probe: SharedProbe, lengths: Sequence[int], parent: bytes, position: int
) -> SegmentMeta | None:
    assert store.shared is not None
    for length in lengths:
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
