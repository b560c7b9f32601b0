"""The one exception hierarchy of kvsplice.

A miss is never an exception (it is `None`); these are faults. The server maps
each class to one gRPC status code in a single interceptor (`status_name`).
"""

from __future__ import annotations


class KvspliceError(Exception):
    """Base of every fault raised by kvsplice code."""

    status_name = "INTERNAL"


class InvalidRequest(KvspliceError, ValueError):
    """A request is malformed: bad field, bad size, bogus token ids."""

    status_name = "INVALID_ARGUMENT"


class FingerprintMismatch(KvspliceError):
    """A segment, policy or anchor belongs to another model."""

    status_name = "FAILED_PRECONDITION"


class LayoutMismatch(KvspliceError):
    """A payload's layers, heads, head_dim or dtype do not fit the target."""

    status_name = "FAILED_PRECONDITION"


class CorruptPayload(KvspliceError):
    """Bytes failed verification (checksum, truncation, bad header).

    Readers turn this into a miss after counting it; it is never spliced.
    """

    status_name = "DATA_LOSS"


class ResourceExhausted(KvspliceError):
    """A quota, memory budget or disk map is full."""

    status_name = "RESOURCE_EXHAUSTED"


class Unauthenticated(KvspliceError):
    """Missing or wrong bearer token."""

    status_name = "UNAUTHENTICATED"


class PermissionDenied(KvspliceError):
    """A known credential that may not do this (another tenant's namespace, a reader writing)."""

    status_name = "PERMISSION_DENIED"


class AlreadyExists(KvspliceError):
    """A put names a key that already holds other bytes (keys are immutable once written)."""

    status_name = "ALREADY_EXISTS"


class StreamStalled(KvspliceError):
    """A client stream sent nothing for longer than the server's idle timeout."""

    status_name = "DEADLINE_EXCEEDED"


class NotFound(KvspliceError):
    """An operation (not a lookup) names something that does not exist."""

    status_name = "NOT_FOUND"


class StoreUnavailable(KvspliceError):
    """The store could not be reached within its deadline (client side)."""

    status_name = "UNAVAILABLE"


class ServeRefused(KvspliceError):
    """`serve` cannot do what it was given: unusable TLS material, a socket path or an
    address it cannot bind. Raised before anything is created."""

    status_name = "FAILED_PRECONDITION"


class UnsupportedRope(KvspliceError):
    """A RoPE variant where a Δ-shift is not a pure function of Δ."""

    status_name = "FAILED_PRECONDITION"
