"""The payload header: fixed prefix, canonical JSON header, and their validation.

Owns the bytes before the first tensor section; tensor sections, the trailing
checksum and tensors belong to `kvmath.payload`. Every field is validated here.

Prefix (little-endian, 22 bytes): magic b"KVSPLICE", format version u16,
header length u32 (<= 64 KiB), xxh3-64 of the header bytes u64; then the
header: canonical JSON (sorted keys, no whitespace, ASCII) of `PayloadHeader`.
"""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import asdict, dataclass
from typing import Any

import xxhash

from kvsplice.common.errors import CorruptPayload
from kvsplice.common.keys import is_fingerprint
from kvsplice.kvmath.quant import QUANT_SCHEMES, TORCH_DTYPES

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
        if self.quant not in QUANT_SCHEMES:
            raise ValueError(f"quant {self.quant!r} not in {QUANT_SCHEMES}")
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
