"""Oracles for kvmath.payload: round trips, sub-range decode, and that no damage decodes."""

from __future__ import annotations

import itertools
import json
import struct

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsplice.common.errors import CorruptPayload, FingerprintMismatch, LayoutMismatch
from kvsplice.kvmath.payload import (
    MAX_HEADER_NBYTES,
    PREFIX,
    SECTION_ALIGN,
    PayloadHeader,
    decode_payload,
    encode_payload,
    payload_sections,
    read_payload_header,
)
from kvsplice.kvmath.quant import SCALE_FLOOR
from kvsplice.kvmath.segment_kv import SegmentKV

FP = "kvfp1-" + "ab" * 16
OTHER_FP = "kvfp1-" + "cd" * 16
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def make_segment(
    shape: tuple[int, int, int, int] = (2, 1, 3, 4),
    *,
    dtype: torch.dtype = torch.float32,
    layer_start: int = 0,
    start_position: int = 7,
    boundary_offsets: tuple[int, ...] = (1,),
    hidden_size: int = 6,
    seed: int = 0,
) -> SegmentKV:
    """A segment with K/V `shape` [L, H, T, D] and boundary states at `layer_start + offset`."""
    g = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    states = {
        layer_start + off: torch.randn(shape[2], hidden_size, generator=g).to(dtype)
        for off in boundary_offsets
    }
    return SegmentKV(keys, values, start_position, layer_start, states)


@st.composite
def segments(draw: st.DrawFn) -> SegmentKV:
    shape = tuple(draw(st.integers(1, n)) for n in (4, 3, 9, 8))
    offsets = draw(st.lists(st.integers(0, shape[0]), unique=True, max_size=3))
    return make_segment(
        shape,  # type: ignore[arg-type]
        dtype=draw(st.sampled_from(DTYPES)),
        layer_start=draw(st.integers(0, 5)),
        start_position=draw(st.integers(0, 10_000)),
        boundary_offsets=tuple(offsets),
        hidden_size=draw(st.integers(1, 12)),
        seed=draw(st.integers(0, 2**31)),
    )


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int8)


def assert_bit_equal(a: SegmentKV, b: SegmentKV) -> None:
    assert (a.start_position, a.layer_start) == (b.start_position, b.layer_start)
    assert torch.equal(bits(a.keys), bits(b.keys)) and torch.equal(bits(a.values), bits(b.values))
    assert sorted(a.boundary_states) == sorted(b.boundary_states)
    for layer, state in a.boundary_states.items():
        assert torch.equal(bits(state), bits(b.boundary_states[layer]))


def int8_bound(x: torch.Tensor, group_dim: int) -> torch.Tensor:
    """kvmath.quant's bound: scale * (1/2 + 2**-16), scale = max(max|group|, floor) / 127."""
    amax = x.double().abs().amax(dim=group_dim, keepdim=True).clamp(min=SCALE_FLOOR)
    return amax / 127 * (1 + 2.0**-23) * (0.5 + 2.0**-16)


@settings(max_examples=40, deadline=None)
@given(seg=segments())
def test_none_round_trips_bit_exact_from_bytes_and_bytearray(seg: SegmentKV) -> None:
    data = encode_payload(seg, model_fingerprint=FP, quant="none")
    for buffer in (data, bytearray(data), memoryview(bytearray(data))):
        assert_bit_equal(decode_payload(buffer, dtype=seg.keys.dtype), seg)


@settings(max_examples=40, deadline=None)
@given(seg=segments())
def test_int8_round_trip_is_within_the_quant_bound(seg: SegmentKV) -> None:
    out = decode_payload(encode_payload(seg, model_fingerprint=FP, quant="int8"))
    assert out.keys.dtype == torch.float32
    for x, x_hat, dim in ((seg.keys, out.keys, -2), (seg.values, out.values, -1)):
        assert bool(((x.double() - x_hat.double()).abs() <= int8_bound(x, dim)).all())
    for layer, state in seg.boundary_states.items():  # boundary states are never quantized
        assert torch.equal(out.boundary_states[layer], state.float())


@settings(max_examples=30, deadline=None)
@given(seg=segments(), quant=st.sampled_from(["none", "fp16", "int8"]))
def test_every_header_field_round_trips(seg: SegmentKV, quant: str) -> None:
    header = read_payload_header(encode_payload(seg, model_fingerprint=FP, quant=quant))
    hidden = next(iter(seg.boundary_states.values())).shape[1] if seg.boundary_states else 0
    assert header == PayloadHeader(
        format_version=1,
        model_fingerprint=FP,
        layer_start=seg.layer_start,
        layer_end=seg.layer_end,
        num_kv_heads=seg.keys.shape[1],
        head_dim=seg.keys.shape[3],
        hidden_size=hidden,
        dtype=str(seg.keys.dtype).removeprefix("torch."),
        quant=quant,
        num_tokens=seg.num_tokens,
        start_position=seg.start_position,
        boundary_layers=tuple(sorted(seg.boundary_states)),
    )


@settings(max_examples=40, deadline=None)
@given(seg=segments(), quant=st.sampled_from(["none", "int8"]), data=st.data())
def test_layer_subrange_equals_slicing_the_full_decode(
    seg: SegmentKV, quant: str, data: st.DataObject
) -> None:
    first = data.draw(st.integers(seg.layer_start, seg.layer_end - 1))
    end = data.draw(st.integers(first + 1, seg.layer_end))
    payload = encode_payload(seg, model_fingerprint=FP, quant=quant)
    full, part = decode_payload(payload), decode_payload(payload, layers=(first, end))
    rows = slice(first - seg.layer_start, end - seg.layer_start)
    expected_states = {k: v for k, v in full.boundary_states.items() if first <= k <= end}
    assert_bit_equal(
        part,
        SegmentKV(full.keys[rows], full.values[rows], full.start_position, first, expected_states),
    )


@pytest.mark.parametrize("layers", [(1, 4), (2, 7), (4, 4), (5, 3), (0, 9)])
def test_layers_outside_the_stored_range_are_a_layout_mismatch(layers: tuple[int, int]) -> None:
    payload = encode_payload(make_segment((4, 1, 2, 4), layer_start=2), model_fingerprint=FP)
    with pytest.raises(LayoutMismatch, match="not within stored"):
        decode_payload(payload, layers=layers)


def test_fingerprint_is_checked_only_when_expected() -> None:
    payload = encode_payload(make_segment(), model_fingerprint=FP)
    assert decode_payload(payload, expect_fingerprint=FP).num_layers == 2
    with pytest.raises(FingerprintMismatch, match=OTHER_FP):
        decode_payload(payload, expect_fingerprint=OTHER_FP)


@pytest.mark.parametrize("quant", ["none", "fp16", "int8"])
def test_flipping_any_byte_never_decodes(quant: str) -> None:
    payload = encode_payload(make_segment(), model_fingerprint=FP, quant=quant)
    for position in range(len(payload)):
        for mask in (0x01, 0x80, 0xFF):
            damaged = bytearray(payload)
            damaged[position] ^= mask
            with pytest.raises(CorruptPayload):
                decode_payload(damaged, expect_fingerprint=FP)


def test_every_truncation_and_any_extension_is_corrupt() -> None:
    payload = encode_payload(make_segment(), model_fingerprint=FP)
    for length in range(len(payload)):
        with pytest.raises(CorruptPayload):
            decode_payload(payload[:length])
        with pytest.raises(CorruptPayload):
            read_payload_header(payload[:length])
    for tail in (b"\0", b"x" * SECTION_ALIGN, payload):
        with pytest.raises(CorruptPayload, match="declares"):
            decode_payload(payload + tail)


def test_read_payload_header_does_not_hash_tensor_sections() -> None:
    payload = bytearray(encode_payload(make_segment(), model_fingerprint=FP))
    payload[-20] ^= 0xFF  # inside the last section
    assert read_payload_header(payload).model_fingerprint == FP
    with pytest.raises(CorruptPayload, match="checksum"):
        decode_payload(payload)


def forge(
    payload: bytes,
    *,
    magic: bytes = b"KVSPLICE",
    version: int = 1,
    header: dict | None = None,
    raw_header: bytes | None = None,
) -> bytes:
    """`payload` with its prefix or header replaced and every checksum made valid again."""
    _, _, body_nbytes, _ = PREFIX.unpack_from(payload, 0)
    fields = json.loads(payload[PREFIX.size : PREFIX.size + body_nbytes])
    fields.update(header or {})
    body = raw_header or json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    head = PREFIX.pack(magic, version, len(body), xxhash.xxh3_64_intdigest(body)) + body
    sections = payload[align(PREFIX.size + body_nbytes) : -8]
    forged = head + bytes(align(len(head)) - len(head)) + sections
    return forged + struct.pack("<Q", xxhash.xxh3_64_intdigest(forged))


def align(offset: int) -> int:
    return -(-offset // SECTION_ALIGN) * SECTION_ALIGN


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"magic": b"KVSPLICX"}, "magic"),
        ({"version": 2}, "version"),
        ({"header": {"hidden_size": 0}}, "hidden_size"),
        ({"header": {"layer_end": 0}}, "empty"),
        ({"header": {"quant": "int4"}}, "quant"),
        ({"header": {"dtype": "float64"}}, "dtype"),
        ({"header": {"num_tokens": True}}, "num_tokens"),
        ({"header": {"boundary_layers": [1, 1]}}, "sorted"),
        ({"header": {"model_fingerprint": "kvfp1-xyz"}}, "fingerprint"),
        ({"header": {"extra": 1}}, "fields"),
        ({"header": {"num_tokens": 4}}, "declares"),
        ({"raw_header": b"[1, 2]"}, "object"),
        ({"raw_header": b"{not json"}, "invalid"),
        ({"raw_header": b"\xff"}, "invalid"),
        ({"raw_header": b" " * (MAX_HEADER_NBYTES + 1)}, "length"),
    ],
)
def test_consistently_checksummed_but_invalid_headers_are_corrupt(
    kwargs: dict, message: str
) -> None:
    payload = encode_payload(make_segment(), model_fingerprint=FP, quant="none")
    with pytest.raises(CorruptPayload, match=message):
        decode_payload(forge(payload, **kwargs))


def test_non_canonical_header_is_corrupt() -> None:
    payload = encode_payload(make_segment(), model_fingerprint=FP, quant="none")
    _, _, body_nbytes, _ = PREFIX.unpack_from(payload, 0)
    body = json.loads(payload[PREFIX.size : PREFIX.size + body_nbytes])
    spaced = json.dumps(body, sort_keys=True).encode()  # same fields, other bytes
    with pytest.raises(CorruptPayload):
        decode_payload(forge(payload, raw_header=spaced))


def test_sections_are_aligned_disjoint_and_fill_the_payload() -> None:
    payload = encode_payload(make_segment(boundary_offsets=(0, 2)), model_fingerprint=FP)
    header = read_payload_header(payload)
    _, _, body_nbytes, _ = PREFIX.unpack_from(payload, 0)
    sections = payload_sections(header, PREFIX.size + body_nbytes)
    names = [s.name for s in sections]
    assert names == ["keys", "key_scales", "values", "value_scales", "state_0", "state_2"]
    assert all(s.offset % SECTION_ALIGN == 0 for s in sections)
    assert all(a.end <= b.offset for a, b in itertools.pairwise(sections))
    assert sections[-1].end + 8 == len(payload)


@pytest.mark.filterwarnings("error")
def test_none_decode_views_a_writable_buffer_and_copies_read_only_bytes() -> None:
    seg = make_segment((2, 1, 3, 4))
    data = encode_payload(seg, model_fingerprint=FP, quant="none")
    shared = bytearray(data)
    viewed = decode_payload(shared)
    np.frombuffer(shared, np.uint8)[:-8].fill(0)  # zero the buffer behind the decode
    assert bool((viewed.keys == 0).all()) and bool((viewed.values == 0).all())
    copied = decode_payload(data)
    assert torch.equal(copied.keys, seg.keys)
    copied.keys.add_(1.0)  # writable, and owns its memory
    assert torch.equal(decode_payload(data).keys, seg.keys)


def test_unaligned_buffers_decode_by_copying() -> None:
    seg = make_segment((2, 1, 3, 4))
    data = encode_payload(seg, model_fingerprint=FP, quant="none")
    unaligned = memoryview(bytearray(b"\0" + data))[1:]
    assert_bit_equal(decode_payload(unaligned), seg)


def test_encoding_is_deterministic() -> None:
    seg = make_segment(boundary_offsets=(0, 1))
    assert encode_payload(seg, model_fingerprint=FP) == encode_payload(seg, model_fingerprint=FP)


@pytest.mark.parametrize(
    ("seg", "kwargs", "message"),
    [
        (make_segment(), {"model_fingerprint": "nope"}, "fingerprint"),
        (make_segment(), {"model_fingerprint": FP, "quant": "int4"}, "quant"),
        (
            SegmentKV(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4, dtype=torch.float16), 0),
            {"model_fingerprint": FP},
            "dtype",
        ),
        (
            SegmentKV(torch.full((1, 1, 2, 4), float("nan")), torch.zeros(1, 1, 2, 4), 0),
            {"model_fingerprint": FP},
            "finite",
        ),
    ],
)
def test_encode_refuses_what_it_cannot_store(seg: SegmentKV, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        encode_payload(seg, **kwargs)


@pytest.mark.parametrize("quant", ["none", "int8"])
def test_smollm2_sized_payload_overhead(quant: str) -> None:
    """A [30, 3, 1024, 64] float32 segment costs its elements plus scales and a small header."""
    seg = make_segment((30, 3, 1024, 64), boundary_offsets=())
    raw_nbytes = 2 * seg.keys.numel() * 4
    element_nbytes = raw_nbytes // 4 if quant == "int8" else raw_nbytes
    payload = encode_payload(seg, model_fingerprint=FP, quant=quant)
    overhead = len(payload) / element_nbytes - 1
    # int8: float32 value scales are 4 B per 64 values of V; key scales 4 B per 1024 of K.
    assert overhead <= (4 / 64 + 4 / 1024) / 2 + 0.001 if quant == "int8" else overhead <= 0.001
