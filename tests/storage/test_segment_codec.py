"""Segment bodies: meta round trips, meta readable from a prefix, corruption detected."""

from __future__ import annotations

import dataclasses
import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsplice.common.errors import CorruptPayload
from kvsplice.common.segment import SEGMENT_KINDS
from kvsplice.storage.segment_codec import (
    decode_blob,
    decode_meta,
    encode_blob,
    encode_meta,
    encode_segment,
    meta_span,
    read_meta,
    segment_payload,
)

token_lists = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=300)


@settings(max_examples=50, deadline=None)
@given(
    token_ids=token_lists,
    left_tail=st.lists(st.integers(0, 2**31 - 1), max_size=50),
    ttl_s=st.none() | st.floats(0.001, 1e9),
    text=st.text(max_size=100),
    labels=st.lists(st.tuples(st.text(max_size=10), st.text(max_size=10)), max_size=3),
    kind=st.sampled_from(SEGMENT_KINDS),
    exact=st.booleans(),
)
def test_meta_round_trips(
    make_segment, token_ids, left_tail, ttl_s, text, labels, kind, exact
) -> None:
    meta, _ = make_segment(token_ids=token_ids)
    meta = dataclasses.replace(
        meta, left_tail_ids=tuple(left_tail), ttl_s=ttl_s, index_text=text, labels=tuple(labels),
        kind=kind, exact=exact,
    )  # fmt: skip
    assert decode_meta(encode_meta(meta)) == meta


def test_a_version_1_meta_reads_its_kind_and_exactness_from_its_labels(make_segment) -> None:
    meta, _ = make_segment()
    typed = dataclasses.replace(meta, kind="base", exact=True)
    encoded = encode_meta(typed)
    _, text_nbytes = struct.unpack_from("<BI", encoded)
    fields = json.loads(encoded[5 : 5 + text_nbytes])
    del fields["kind"], fields["exact"]
    fields["labels"] = [["kind", "base"], *fields["labels"], ["exact", "1"]]
    text = json.dumps(fields).encode()
    version_1 = struct.pack("<BI", 1, len(text)) + text + encoded[5 + text_nbytes :]
    assert decode_meta(version_1) == typed  # the typed labels gone, the others kept


def test_meta_is_read_from_a_prefix_without_the_payload(make_segment) -> None:
    meta, payload = make_segment(nbytes=100_000)
    body = encode_segment(meta, payload)
    head = body[: meta_span(body)]
    assert read_meta(head) == meta
    assert bytes(segment_payload(body, meta)) == payload


def test_a_short_prefix_says_how_much_more_it_needs(make_segment) -> None:
    meta, payload = make_segment()
    body = encode_segment(meta, payload)
    with pytest.raises(CorruptPayload, match="shorter than its meta"):
        read_meta(body[:20])
    assert meta_span(body[:20]) == meta_span(body)


def test_any_flipped_meta_byte_is_caught(make_segment) -> None:
    meta, payload = make_segment()
    body = encode_segment(meta, payload)
    for position in range(meta_span(body)):
        damaged = bytearray(body)
        damaged[position] ^= 0x40
        with pytest.raises(CorruptPayload):
            assert read_meta(bytes(damaged)) == meta


def test_payload_size_must_match_the_meta(make_segment) -> None:
    meta, payload = make_segment(nbytes=64)
    body = encode_segment(meta, payload + b"extra")
    with pytest.raises(CorruptPayload, match="payload holds"):
        segment_payload(body, meta)


def test_blob_round_trip_and_expiry() -> None:
    header, data = decode_blob(encode_blob(b"anchor", created_at_s=100.0, ttl_s=5.0))
    assert bytes(data) == b"anchor"
    assert not header.expired(105.0) and header.expired(105.5)
    forever, _ = decode_blob(encode_blob(b"", created_at_s=0.0, ttl_s=None))
    assert forever.ttl_s is None and not forever.expired(1e18)
