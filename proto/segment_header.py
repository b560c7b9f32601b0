"""`SegmentMeta` ⇄ protobuf `SegmentHeader`: the one mapping both client and server use.

It owns the field mapping only; each side decides which of our errors a
malformed header is (the server: the caller's `InvalidRequest`; the client: a
corrupt reply) by catching the `ValueError` raised here.
"""

from __future__ import annotations

from typing import cast

from kvsplice.common.segment import SegmentKind, SegmentMeta
from kvsplice.proto import store_pb2 as pb


def meta_to_header(meta: SegmentMeta) -> pb.SegmentHeader:
    return pb.SegmentHeader(
        namespace=meta.namespace,
        model_fingerprint=meta.model_fingerprint,
        context_key=meta.context_key,
        parent_key=meta.parent_key,
        content_key=meta.content_key,
        token_ids=meta.token_ids,
        start_position=meta.start_position,
        layer_start=meta.layer_start,
        layer_end=meta.layer_end,
        boundary_layers=meta.boundary_layers,
        payload_nbytes=meta.payload_nbytes,
        checksum=meta.checksum,
        ttl_s=meta.ttl_s or 0.0,
        left_tail_ids=meta.left_tail_ids,
        index_text=meta.index_text,
        created_at_s=meta.created_at_s,
        labels=[pb.Label(key=k, value=v) for k, v in meta.labels],
        kind=meta.kind,
        exact=meta.exact,
    )


def header_to_meta(header: pb.SegmentHeader, *, keep_created_at: bool) -> SegmentMeta:
    """The header as `SegmentMeta`; raises `ValueError` naming the bad field.

    `keep_created_at=False` drops the sender's timestamp (the server stamps its own).
    """
    return SegmentMeta(
        namespace=header.namespace,
        model_fingerprint=header.model_fingerprint,
        context_key=header.context_key,
        parent_key=header.parent_key,
        content_key=header.content_key,
        token_ids=tuple(header.token_ids),
        start_position=header.start_position,
        layer_start=header.layer_start,
        layer_end=header.layer_end,
        boundary_layers=tuple(header.boundary_layers),
        payload_nbytes=header.payload_nbytes,
        checksum=header.checksum,
        ttl_s=header.ttl_s or None,
        created_at_s=header.created_at_s if keep_created_at else 0.0,
        left_tail_ids=tuple(header.left_tail_ids),
        index_text=header.index_text,
        labels=tuple((label.key, label.value) for label in header.labels),
        kind=cast(SegmentKind, header.kind or "prompt"),
        exact=header.exact,
    )
