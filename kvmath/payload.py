"""The segment payload: one self-describing, checksummed byte string per `SegmentKV`.

Owns the prefix/header codec, section layout, encode/decode and integrity checks (every
header field validated here); the numeric schemes belong to `kvmath.quant`.

Layout: a prefix (little-endian, 22 bytes: magic b"KVSPLICE", format version u16, header
length u32 (<= 64 KiB), xxh3-64 of the header bytes u64), then the header: canonical JSON
(sorted keys, no whitespace, ASCII) of `PayloadHeader`, then tensor sections, each at a
64-byte-aligned offset (zero padding between): keys [L, H_kv, T, D], key scales
[L, H_kv, 1, D] (int8 only), values [L, H_kv, T, D], value scales [L, H_kv, T, 1]
(int8 only), then one boundary state [T, hidden] per boundary layer, ascending;
last, the xxh3-64 (u64 little-endian) of every byte before it.

Zero-copy: decoding a "none" payload into its captured dtype returns tensors
that view the caller's buffer when it is writable (bytearray, writable
memoryview) and aligned; they share its memory and keep it alive. Read-only
`bytes` cost one copy into the output (torch cannot safely view read-only
memory); int8 and dtype conversions always write new tensors in one pass over
the output (two for bfloat16 outputs or reading bfloat16 from read-only bytes).
"""

from __future__ import annotations

import json
import logging
import math
import struct
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, TypeAlias

import numpy as np
import torch
import xxhash

from kvsplice.common.errors import CorruptPayload, FingerprintMismatch, LayoutMismatch
from kvsplice.common.keys import is_fingerprint
from kvsplice.kvmath.quant import (
    KEY_GROUP_DIM,
    SCALE_NUMPY_DTYPE,
    STORED_NUMPY_DTYPES,
    TORCH_DTYPES,
    VALUE_GROUP_DIM,
    StoredTensor,
    check_quant,
    dequantize,
    dtype_name,
    quantize,
    store_exact,
    stored_kind,
)
from kvsplice.kvmath.segment_kv import SegmentKV

logger = logging.getLogger(__name__)

MAGIC = b"KVSPLICE"
FORMAT_VERSION = 1
MAX_HEADER_NBYTES = 64 * 1024
PREFIX = struct.Struct("<8sHIQ")  # magic, format version, header length, header xxh3-64

_INT_FIELDS = (
    "format_version",
    "layer_start",
    "layer_end",
    "num_kv_heads",
    "head_dim",
    "hidden_size",
    "num_tokens",
    "start_position",
)


@dataclass(frozen=True)
class PayloadHeader:
    """What a payload holds. `layer_end` is exclusive; `hidden_size` is 0 without boundary states.

    `dtype` is the captured dtype name; `boundary_layers` are sorted, unique and
    within [layer_start, layer_end] (a cut at l needs the K/V of layers < l).
    """

    format_version: int
    model_fingerprint: str
    layer_start: int
    layer_end: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    dtype: str
    quant: str
    num_tokens: int
    start_position: int
    boundary_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if self.format_version != FORMAT_VERSION:
            raise ValueError(f"format_version {self.format_version} != {FORMAT_VERSION}")
        if not is_fingerprint(self.model_fingerprint):
            raise ValueError(f"model_fingerprint {self.model_fingerprint!r} is malformed")
        if self.layer_end <= self.layer_start:
            raise ValueError(f"layer range [{self.layer_start}, {self.layer_end}) is empty")
        for name in ("num_kv_heads", "head_dim", "num_tokens"):
            if getattr(self, name) == 0:
                raise ValueError(f"{name} must be positive")
        if self.dtype not in TORCH_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} not in {tuple(TORCH_DTYPES)}")
        check_quant(self.quant)
        self._check_boundaries()

    def _check_boundaries(self) -> None:
        layers = self.boundary_layers
        if type(layers) is not tuple or any(type(x) is not int for x in layers):
            raise ValueError(f"boundary_layers must be a tuple of ints, got {layers!r}")
        if list(layers) != sorted(set(layers)):
            raise ValueError(f"boundary_layers {layers} must be sorted and unique")
        if layers and not self.layer_start <= layers[0] <= layers[-1] <= self.layer_end:
            raise ValueError(
                f"boundary_layers {layers} outside [{self.layer_start}, {self.layer_end}]"
            )
        if bool(layers) != (self.hidden_size > 0):
            raise ValueError(f"hidden_size {self.hidden_size} must be > 0 iff boundary_layers")

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start


def encode_header(header: PayloadHeader) -> bytes:
    """Prefix + canonical JSON header bytes (no padding)."""
    body = _canonical(asdict(header))
    if len(body) > MAX_HEADER_NBYTES:
        raise ValueError(f"header of {len(body)} bytes exceeds {MAX_HEADER_NBYTES}")
    return PREFIX.pack(MAGIC, FORMAT_VERSION, len(body), xxhash.xxh3_64_intdigest(body)) + body


def decode_header(data: memoryview) -> tuple[PayloadHeader, int]:
    """(header, end offset of the header bytes) from a payload's leading bytes.

    data: 1-D unsigned-byte view of the payload. Checks magic, version, header
    length and the header's own xxh3 before parsing; raises CorruptPayload.
    """
    if len(data) < PREFIX.size:
        raise CorruptPayload(
            f"payload of {len(data)} bytes is shorter than its {PREFIX.size}-byte prefix"
        )
    magic, version, body_nbytes, body_hash = PREFIX.unpack_from(data, 0)
    if magic != MAGIC:
        raise CorruptPayload(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CorruptPayload(
            f"unsupported payload format version {version} (this reader: {FORMAT_VERSION})"
        )
    end = PREFIX.size + body_nbytes
    if body_nbytes > MAX_HEADER_NBYTES or end > len(data):
        raise CorruptPayload(f"header length {body_nbytes} exceeds the limit or the payload")
    body = bytes(data[PREFIX.size : end])
    if xxhash.xxh3_64_intdigest(body) != body_hash:
        raise CorruptPayload("header checksum mismatch")
    return _parse(body), end


def _parse(body: bytes) -> PayloadHeader:
    """PayloadHeader from canonical JSON bytes, or CorruptPayload saying why not."""
    try:
        fields = json.loads(body.decode("ascii"))
        if not isinstance(fields, dict):
            raise ValueError(f"header is a JSON {type(fields).__name__}, not an object")
        if set(fields) != set(PayloadHeader.__dataclass_fields__):
            raise ValueError(f"header fields {sorted(fields)} are not the format's")
        fields["boundary_layers"] = tuple(fields["boundary_layers"])
        header = PayloadHeader(**fields)
    except (ValueError, TypeError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CorruptPayload(f"invalid payload header: {exc}") from exc
    if _canonical(asdict(header)) != body:
        raise CorruptPayload("payload header is not in canonical form")
    return header


def _canonical(fields: dict[str, Any]) -> bytes:
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode(
        "ascii"
    )


SECTION_ALIGN = 64
CHECKSUM = struct.Struct("<Q")
Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class Section:
    """One tensor section: `shape` elements of numpy `dtype` at byte `offset`."""

    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def payload_sections(header: PayloadHeader, header_end: int) -> tuple[Section, ...]:
    """The sections `header` declares, laid out from byte `header_end` on (see module doc)."""
    kv_shape = (header.num_layers, header.num_kv_heads, header.num_tokens, header.head_dim)
    kv_dtype = STORED_NUMPY_DTYPES[stored_kind(header.quant, header.dtype)]
    specs: list[tuple[str, tuple[int, ...], np.dtype]] = [("keys", kv_shape, kv_dtype)]
    if header.quant == "int8":
        specs.append(("key_scales", (*kv_shape[:2], 1, kv_shape[3]), SCALE_NUMPY_DTYPE))
    specs.append(("values", kv_shape, kv_dtype))
    if header.quant == "int8":
        specs.append(("value_scales", (*kv_shape[:3], 1), SCALE_NUMPY_DTYPE))
    state_dtype = STORED_NUMPY_DTYPES[header.dtype]
    for layer in header.boundary_layers:
        specs.append((f"state_{layer}", (header.num_tokens, header.hidden_size), state_dtype))
    sections, offset = [], header_end
    for name, shape, dtype in specs:
        sections.append(Section(name, _align(offset), shape, dtype))
        offset = sections[-1].end
    return tuple(sections)


def encode_payload(seg: SegmentKV, *, model_fingerprint: str, quant: str = "int8") -> bytes:
    """The payload bytes of `seg` (keys/values [L, H_kv, T, D], states [T, hidden]).

    K/V are stored under `quant` ("none" | "fp16" | "int8", see `kvmath.quant`);
    boundary states always bit-exact. Raises ValueError on a malformed
    fingerprint, mixed dtypes or values the scheme cannot store (inf/nan).
    """
    header = _header_for(seg, model_fingerprint, quant)
    head = encode_header(header)
    arrays = _stored_arrays(seg, quant)
    pieces: list[bytes | memoryview] = [head]
    position = len(head)
    for section, array in zip(payload_sections(header, len(head)), arrays, strict=True):
        assert array.dtype == section.dtype and array.shape == section.shape, section.name
        pieces += [bytes(section.offset - position), array.data]
        position = section.end
    hasher = xxhash.xxh3_64()
    for piece in pieces:
        hasher.update(piece)
    pieces.append(CHECKSUM.pack(hasher.intdigest()))
    return b"".join(pieces)


def read_payload_header(data: Buffer) -> PayloadHeader:
    """The header of payload `data`, after checking magic, version, header checksum and total length.

    Cheap: does not hash the tensor sections. Raises CorruptPayload.
    """
    return _checked_layout(_byte_view(data))[0]


@dataclass(frozen=True)
class StoredKV:
    """A verified payload's K/V (and boundary states) still in stored form, not decoded.

    keys, values: [L, H_kv, T, D] views of the payload bytes (read-only when they are);
    boundary_states: cut layer -> [T, hidden], stored exact. `kvmath.fused_decode`
    writes K/V into a cache in as few passes as it can; `decode` makes tensors of it all.
    """

    keys: StoredTensor
    values: StoredTensor
    start_position: int
    layer_start: int
    boundary_states: Mapping[int, StoredTensor] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return int(self.keys.data.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.keys.data.shape[2])

    @property
    def layer_end(self) -> int:
        return self.layer_start + self.num_layers

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        num_layers, num_heads, num_tokens, head_dim = self.keys.data.shape
        return num_layers, num_heads, num_tokens, head_dim

    @property
    def nbytes(self) -> int:
        """Bytes of the stored sections it views (scales and states included)."""
        tensors = (self.keys, self.values, *self.boundary_states.values())
        return sum(t.data.nbytes + (0 if t.scale is None else t.scale.nbytes) for t in tensors)

    def tokens(self, start: int, end: int) -> StoredKV:
        """Tokens [start, end) (indices within the segment) at their own positions: views.

        Key scales are per channel over the whole segment, so they stay as they are.
        """
        if not 0 <= start < end <= self.num_tokens:
            raise ValueError(
                f"slice [{start}, {end}) outside the segment's {self.num_tokens} tokens"
            )
        rows = (slice(None), slice(None), slice(start, end))
        values_scale = None if self.values.scale is None else self.values.scale[rows]
        return StoredKV(
            StoredTensor(self.keys.data[rows], self.keys.kind, self.keys.scale),
            StoredTensor(self.values.data[rows], self.values.kind, values_scale),
            self.start_position + start,
            self.layer_start,
            {
                layer: StoredTensor(s.data[start:end], s.kind)
                for layer, s in self.boundary_states.items()
            },
        )

    def copy(self) -> StoredKV:
        """The same K/V and states in memory of their own (the payload can then go)."""

        def own(t: StoredTensor) -> StoredTensor:
            return StoredTensor(t.data.copy(), t.kind, None if t.scale is None else t.scale.copy())

        states = {layer: own(s) for layer, s in self.boundary_states.items()}
        return StoredKV(
            own(self.keys), own(self.values), self.start_position, self.layer_start, states
        )

    def decode(self, dtype: torch.dtype = torch.float32) -> SegmentKV:
        """K/V and boundary states as new CPU tensors in `dtype` (a bit-exact dequantize)."""
        states = {layer: dequantize(s, dtype) for layer, s in self.boundary_states.items()}
        keys, values = dequantize(self.keys, dtype), dequantize(self.values, dtype)
        return SegmentKV(keys, values, self.start_position, self.layer_start, states)


# What a splice writes into a cache: tensors (computed, corrected, or a tier's), or a
# verified payload's stored form (`kvmath.fused_decode.decode_into` takes either).
KVSource: TypeAlias = SegmentKV | StoredKV


def decode_payload(
    data: Buffer,
    *,
    expect_fingerprint: str | None = None,
    dtype: torch.dtype = torch.float32,
    layers: tuple[int, int] | None = None,
) -> SegmentKV:
    """The `SegmentKV` stored in `data`, K/V and boundary states in `dtype`.

    Verifies magic, version, lengths and the full checksum before building any
    tensor (CorruptPayload), then the fingerprint (FingerprintMismatch).
    `layers=(a, b)` (absolute, b exclusive, within the stored range, else
    LayoutMismatch) decodes keys/values [b - a, H_kv, T, D] and the boundary
    states of layers a..b inclusive; the result has `layer_start == a`.
    """
    dtype_name(dtype)  # ValueError for a dtype K/V never has
    stored = decode_stored(data, expect_fingerprint=expect_fingerprint)
    return _layer_window(stored, layers).decode(dtype)


def decode_stored(
    data: Buffer, *, expect_fingerprint: str | None = None, verified: bool = False
) -> StoredKV:
    """The K/V and boundary states of payload `data` in stored form, after every check
    `decode_payload` makes. Costs one checksum pass and no copy; none with `verified`:
    the caller already matched these very bytes to the checksum their segment's meta
    carries (a store client's get does), so the payload's own checksum adds nothing.
    """
    header, arrays = _verified_arrays(data, expect_fingerprint, verified)
    kind = stored_kind(header.quant, header.dtype)
    states = {
        layer: StoredTensor(arrays[f"state_{layer}"], header.dtype)
        for layer in header.boundary_layers
    }
    return StoredKV(
        StoredTensor(arrays["keys"], kind, arrays.get("key_scales")),
        StoredTensor(arrays["values"], kind, arrays.get("value_scales")),
        header.start_position,
        header.layer_start,
        states,
    )


def _verified_arrays(
    data: Buffer, expect_fingerprint: str | None, verified: bool = False
) -> tuple[PayloadHeader, dict[str, np.ndarray]]:
    """Header and section views of `data` once layout, checksum (unless `verified`) and
    fingerprint hold."""
    view = _byte_view(data)
    header, sections = _checked_layout(view)
    stored_sum = CHECKSUM.unpack_from(view, len(view) - CHECKSUM.size)[0]
    if not verified and xxhash.xxh3_64_intdigest(view[: len(view) - CHECKSUM.size]) != stored_sum:
        raise CorruptPayload("payload checksum mismatch")
    if expect_fingerprint is not None and header.model_fingerprint != expect_fingerprint:
        raise FingerprintMismatch(
            f"payload is for model {header.model_fingerprint}, expected {expect_fingerprint}"
        )
    arrays = {
        s.name: np.frombuffer(view, s.dtype, _count(s), s.offset).reshape(s.shape) for s in sections
    }
    return header, arrays


def _header_for(seg: SegmentKV, model_fingerprint: str, quant: str) -> PayloadHeader:
    """The header describing `seg`; ValueError if its tensors disagree on dtype or hidden size."""
    kv_dtype = seg.keys.dtype
    state_specs = {(s.dtype, int(s.shape[1])) for s in seg.boundary_states.values()}
    if seg.values.dtype != kv_dtype or state_specs - {(kv_dtype, _hidden(seg))}:
        raise ValueError(
            f"keys {kv_dtype}, values {seg.values.dtype} and boundary states {state_specs} "
            "must share one dtype and one hidden size"
        )
    return PayloadHeader(
        format_version=FORMAT_VERSION,
        model_fingerprint=model_fingerprint,
        layer_start=seg.layer_start,
        layer_end=seg.layer_end,
        num_kv_heads=int(seg.keys.shape[1]),
        head_dim=int(seg.keys.shape[3]),
        hidden_size=_hidden(seg),
        dtype=dtype_name(kv_dtype),
        quant=quant,
        num_tokens=seg.num_tokens,
        start_position=seg.start_position,
        boundary_layers=tuple(sorted(seg.boundary_states)),
    )


def _hidden(seg: SegmentKV) -> int:
    """Hidden size of the first boundary state, 0 without any."""
    return next((int(s.shape[1]) for s in seg.boundary_states.values()), 0)


def _stored_arrays(seg: SegmentKV, quant: str) -> list[np.ndarray]:
    """Section arrays of `seg` in layout order (see `payload_sections`)."""
    keys = quantize(seg.keys, quant, KEY_GROUP_DIM)
    values = quantize(seg.values, quant, VALUE_GROUP_DIM)
    arrays = [a for a in (keys.data, keys.scale, values.data, values.scale) if a is not None]
    states = [store_exact(seg.boundary_states[layer]).data for layer in sorted(seg.boundary_states)]
    return arrays + states


def _checked_layout(view: memoryview) -> tuple[PayloadHeader, tuple[Section, ...]]:
    """Header and sections of `view`, whose length must be exactly what they declare."""
    header, header_end = decode_header(view)
    sections = payload_sections(header, header_end)
    expected = sections[-1].end + CHECKSUM.size
    if len(view) != expected:
        raise CorruptPayload(f"payload is {len(view)} bytes but its header declares {expected}")
    return header, sections


def _layer_window(stored: StoredKV, layers: tuple[int, int] | None) -> StoredKV:
    """Absolute layers [first, end) of `stored` (views) with the boundary states of layers
    first..end inclusive; LayoutMismatch outside the stored range."""
    if layers is None:
        return stored
    first, end = layers
    if not stored.layer_start <= first < end <= stored.layer_end:
        raise LayoutMismatch(
            f"layers [{first}, {end}) not within stored [{stored.layer_start}, {stored.layer_end})"
        )
    rows = slice(first - stored.layer_start, end - stored.layer_start)

    def window(t: StoredTensor) -> StoredTensor:
        return StoredTensor(t.data[rows], t.kind, None if t.scale is None else t.scale[rows])

    states = {layer: s for layer, s in stored.boundary_states.items() if first <= layer <= end}
    return StoredKV(
        window(stored.keys), window(stored.values), stored.start_position, first, states
    )


def _byte_view(data: Buffer) -> memoryview:
    """A flat unsigned-byte view of `data` (must be C-contiguous)."""
    return memoryview(data).cast("B")


def _count(section: Section) -> int:
    return section.nbytes // section.dtype.itemsize


def _align(offset: int) -> int:
    return -(-offset // SECTION_ALIGN) * SECTION_ALIGN
