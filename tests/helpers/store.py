"""`make_*` factories for the server tests: valid chained segments, payloads, services."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

from kvsplice.common.keys import root_key
from kvsplice.common.segment import SegmentMeta, chained_meta
from kvsplice.index.exact_index import ExactIndex
from kvsplice.index.similarity_index import SimilarityIndex
from kvsplice.server.config import SegmentServiceConfig
from kvsplice.server.segment_service import SegmentService
from kvsplice.storage.config import LMDBTierConfig, MemoryTierConfig, StoreConfig, build_store
from kvsplice.storage.tiered_store import TieredStore
from kvsplice.storeclient.wire import with_payload_digest

FINGERPRINT = "kvfp1-" + "0" * 32
OTHER_FINGERPRINT = "kvfp1-" + "1" * 32
NAMESPACE = "tenant-a"


def make_payload(nbytes: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(nbytes)


def make_meta(
    token_ids: Sequence[int],
    payload: bytes,
    *,
    parent_key: bytes | None = None,
    start_position: int = 0,
    namespace: str = NAMESPACE,
    fingerprint: str = FINGERPRINT,
    **fields: object,
) -> SegmentMeta:
    """A segment after `parent_key` (the root by default) whose size and checksum fit `payload`."""
    parent = root_key(fingerprint) if parent_key is None else parent_key
    meta = chained_meta(namespace, fingerprint, parent, token_ids, start_position, 30)
    return replace(with_payload_digest(meta, payload), **fields)


def make_chain(
    spans: Sequence[Sequence[int]], nbytes: int = 256, **fields: object
) -> list[tuple[SegmentMeta, bytes]]:
    """Consecutive segments from position 0, each with its own seeded payload."""
    segments = []
    parent, position = None, 0
    for i, span in enumerate(spans):
        payload = make_payload(nbytes, seed=i)
        meta = make_meta(span, payload, parent_key=parent, start_position=position, **fields)
        segments.append((meta, payload))
        parent, position = meta.context_key, position + len(span)
    return segments


def make_store(lmdb_path: str | None = None) -> TieredStore:
    lmdb = None if lmdb_path is None else LMDBTierConfig(path=lmdb_path, sync=False)
    return build_store(StoreConfig(memory=MemoryTierConfig(max_bytes=64 << 20), lmdb=lmdb))


def make_service(
    store: TieredStore | None = None, config: SegmentServiceConfig | None = None
) -> SegmentService:
    return SegmentService(
        store or make_store(), ExactIndex(), SimilarityIndex(), config or SegmentServiceConfig()
    )
