"""Tier keys: every key is scoped by its namespace; segments, blobs and counters never
share keys.

Segment:  b"s\\x00" + namespace + b"\\x00" + context_key (16 bytes).
Blob:     b"b\\x00" + namespace + b"\\x00" + utf-8 name.
Counters: b"c\\x00" + namespace (the sidecar's own, `counter_records`).
Namespaces cannot contain NUL (`validate_namespace`), so no key is readable
from another namespace. Validation failures raise `InvalidRequest`.
"""

from __future__ import annotations

from kvsplice.common.errors import InvalidRequest
from kvsplice.common.keys import KEY_NBYTES
from kvsplice.common.segment import validate_namespace

SEGMENT_SPACE = b"s\x00"
BLOB_SPACE = b"b\x00"
COUNTER_SPACE = b"c\x00"
MAX_BLOB_NAME_NBYTES = 256


def _namespace_bytes(namespace: str) -> bytes:
    try:
        return validate_namespace(namespace).encode()
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc


def segment_key(namespace: str, context_key: bytes) -> bytes:
    if not isinstance(context_key, bytes) or len(context_key) != KEY_NBYTES:
        raise InvalidRequest(f"context_key must be {KEY_NBYTES} bytes")
    return SEGMENT_SPACE + _namespace_bytes(namespace) + b"\x00" + context_key


def blob_prefix(namespace: str, name_prefix: str = "") -> bytes:
    return BLOB_SPACE + _namespace_bytes(namespace) + b"\x00" + name_prefix.encode()


def blob_key(namespace: str, name: str) -> bytes:
    encoded = name.encode()
    if not 0 < len(encoded) <= MAX_BLOB_NAME_NBYTES:
        raise InvalidRequest(f"blob name {name!r} must be 1..{MAX_BLOB_NAME_NBYTES} utf-8 bytes")
    return blob_prefix(namespace) + encoded


def blob_name(key: bytes, namespace: str) -> str:
    """The name inside a blob key of `namespace` (inverse of `blob_key`)."""
    return key[len(blob_prefix(namespace)) :].decode()


def counters_key(namespace: str) -> bytes:
    return COUNTER_SPACE + _namespace_bytes(namespace)


def counters_namespace(key: bytes) -> str:
    """The namespace a counters key names (inverse of `counters_key`)."""
    return key[len(COUNTER_SPACE) :].decode()
