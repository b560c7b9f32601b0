"""How the store clients treat failures: status → error class, retries (tenacity), one warning.

Transport failures (UNAVAILABLE, DEADLINE_EXCEEDED) become misses; server faults raise
our own errors. Used by the store client; knows nothing about messages.
"""

from __future__ import annotations

import logging

import grpc
from tenacity import (
    AsyncRetrying,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_before_delay,
    wait_random_exponential,
)

from kvsplice.common.errors import (
    AlreadyExists,
    CorruptPayload,
    FingerprintMismatch,
    InvalidRequest,
    KvspliceError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    StoreUnavailable,
    Unauthenticated,
)
from kvsplice.common.log_limits import RateLimitedLog
from kvsplice.storeclient.config import StoreClientConfig

logger = logging.getLogger(__name__)

# An attempt started this close to the deadline still gets a chance to answer.
MIN_ATTEMPT_TIMEOUT_S = 1e-3
TRANSIENT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
_CODE_TO_ERROR: dict[grpc.StatusCode, type[KvspliceError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.FAILED_PRECONDITION: FingerprintMismatch,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.DATA_LOSS: CorruptPayload,
    grpc.StatusCode.UNAVAILABLE: StoreUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: StoreUnavailable,
}


def error_from_rpc(error: grpc.RpcError) -> KvspliceError:
    """Our error for a failed call; FAILED_PRECONDITION is reported as FingerprintMismatch.

    (The server raises FAILED_PRECONDITION for fingerprint and layout mismatches
    alike; the details string says which.)
    """
    code = error.code()  # type: ignore[attr-defined]
    details = error.details() or code.name  # type: ignore[attr-defined]
    cls = _CODE_TO_ERROR.get(code, KvspliceError)
    return cls(f"store answered {code.name}: {details}")


# NOTE: refused credentials are a mistake, not a fault: the error says what to do.
_CREDENTIAL_HINTS: dict[type[KvspliceError], str] = {
    Unauthenticated: "pass the tenant's token: StoreClient(..., token=TOKEN) "
    "(`kvsplice tenants add` prints it once)",
    PermissionDenied: "this token's tenant may not do this in the namespace "
    "(`kvsplice tenants list` shows its namespaces and role)",
}


def credential_error(error: KvspliceError, target: str, namespace: str) -> KvspliceError | None:
    """For refused credentials, `error` again saying what to do about them; else None."""
    hint = _CREDENTIAL_HINTS.get(type(error))
    if hint is None:
        return None
    return type(error)(f"{target} refused namespace {namespace!r}: {error}; {hint}")


def is_transient(error: grpc.RpcError) -> bool:
    return error.code() in TRANSIENT_CODES  # type: ignore[attr-defined]


def _retry_policy(config: StoreClientConfig, timeout_s: float) -> dict[str, object]:
    """Transient failures only; exponential backoff with full jitter, capped; never a sleep
    that would end past the call's deadline (`timeout_s` from now); the last error re-raised."""
    return {
        "stop": stop_after_attempt(config.max_attempts) | stop_before_delay(timeout_s),
        "wait": wait_random_exponential(
            multiplier=config.backoff_initial_s,
            max=config.backoff_max_s,
            exp_base=config.backoff_multiplier,
        ),
        "retry": retry_if_exception(
            lambda error: isinstance(error, grpc.RpcError) and is_transient(error)
        ),
        "reraise": True,
    }


def retrying(config: StoreClientConfig, timeout_s: float) -> Retrying:
    """`for attempt in retrying(...): with attempt: ...` for the sync client."""
    return Retrying(**_retry_policy(config, timeout_s))  # type: ignore[arg-type]


def async_retrying(config: StoreClientConfig, timeout_s: float) -> AsyncRetrying:
    """`async for attempt in async_retrying(...): with attempt: ...` for the asyncio client."""
    return AsyncRetrying(**_retry_policy(config, timeout_s))  # type: ignore[arg-type]


# One rate limit per target for the whole process: a run opens a client per mode and per
# agent, and each would otherwise warn once on its own about the same dead store.
DEGRADED_LOG = RateLimitedLog(logger, interval_s=30.0)


def warn_degraded(target: str, interval_s: float, operation: str, reason: str) -> None:
    """At most one warning per `interval_s` per target about calls served as misses."""
    due = DEGRADED_LOG.due(target, interval_s)
    if due is None:
        return
    suppressed = f" ({due.held_back} more since the last warning)" if due.held_back else ""
    logger.warning(
        "kvsplice store %s: %s served as a miss (%s); workers fall back to dense prefill%s",
        target,
        operation,
        reason,
        suppressed,
    )
