"""Rebuilding the store's catalog at open from the durable tier's segment records.

Reads only each record's meta section (`get_prefix`), never its payload; records
whose meta fails verification are deleted from every tier.
"""

from __future__ import annotations

import logging

from kvsplice.common.errors import CorruptPayload
from kvsplice.storage.catalog import Catalog, CatalogEntry
from kvsplice.storage.keyspace import SEGMENT_SPACE, segment_key
from kvsplice.storage.segment_codec import meta_digest, meta_span, read_meta
from kvsplice.storage.tier_stack import TierStack

logger = logging.getLogger(__name__)

_META_PREFIX_GUESS_NBYTES = 16 * 1024


def load_catalog(stack: TierStack) -> tuple[Catalog, int]:
    """The catalog of every readable segment in `stack.durable`, and how many were dropped."""
    loaded: list[tuple[bytes, CatalogEntry]] = []
    num_dropped = 0
    for key in stack.durable.keys(SEGMENT_SPACE):
        try:
            entry = _load_entry(stack, key)
        except CorruptPayload as exc:
            logger.warning("%s: dropped segment %s at open: %s", stack.durable.name, key.hex(), exc)
            stack.delete(key)
            num_dropped += 1
            continue
        if entry is not None:
            loaded.append((key, entry))
    # NOTE: recency is not persisted; creation order is the closest stand-in for
    # LRU order after a restart (the oldest created is evicted first).
    loaded.sort(key=lambda item: item[1].meta.created_at_s)
    catalog = Catalog()
    for key, entry in loaded:
        catalog.insert(key, entry)
    logger.info("catalog loaded %d segments from %s", len(loaded), stack.durable.name)
    return catalog, num_dropped


def _load_entry(stack: TierStack, key: bytes) -> CatalogEntry | None:
    head = stack.durable.get_prefix(key, _META_PREFIX_GUESS_NBYTES)
    if head is not None and len(head) < meta_span(head):
        head = stack.durable.get_prefix(key, meta_span(head))
    if head is None:  # gone meanwhile, or its envelope failed (the tier dropped it)
        return None
    meta = read_meta(head)
    if segment_key(meta.namespace, meta.context_key) != key:
        raise CorruptPayload("record stored under another segment's key")
    return CatalogEntry(meta, meta_span(head) + meta.payload_nbytes, meta_digest(head))
