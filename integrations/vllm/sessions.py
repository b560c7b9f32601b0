"""A request's agent session, read from vLLM's own fields: `Request.session_id` (a chat body's
`session_id` or its `X-Session-ID` header) and `Request.kv_hints` (a versioned
`KvHintsEnvelope`), whose `retain` and `release` actions this connector implements.

Owns what a request asks of its session (`SessionScope`), the outcome of each hint action
(accepted, clipped or rejected: logged, rate-limited) and ending sessions off the scheduler's
thread. The sidecar holds the segments (`storage.sessions`); the lookups and puts carry the id.
"""

from __future__ import annotations

import logging
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvsplice.common.log_limits import RateLimitedLog
from kvsplice.storeclient.namespaces import NamespaceClients
from kvsplice.storeclient.results import SessionRenewal

logger = logging.getLogger(__name__)
HINTS_PROTOCOL_VERSION = "1"
RETAIN, RELEASE = "retain", "release"  # KvHintAction.action_type, action_version "1"
ACTION_VERSION = "1"
MAX_SESSION_ID_CHARS = 256  # the sidecar's limit (server.session_service)
LOG_INTERVAL_S = 30.0
_log = RateLimitedLog(logger, LOG_INTERVAL_S)


@dataclass(frozen=True)
class SessionScope:
    """What a request asks of its session: renewed by its lookup (for `lease_s`, a retain
    hint's, else the sidecar's default) and, with `release`, ended when it finishes."""

    session_id: str
    lease_s: float | None = None
    release: bool = False


def session_scope(request: Any) -> SessionScope | None:
    """The request's session (None: it names none, or a name the sidecar would refuse)."""
    session_id = getattr(request, "session_id", None)
    hints = getattr(request, "kv_hints", None)
    if not session_id:
        if hints is not None and hints.actions:
            _outcome(hints.actions[0], "rejected", "the request names no session_id")
        return None
    if len(session_id) > MAX_SESSION_ID_CHARS or not session_id.isprintable():
        _log.log("bad id", logging.WARNING, "session_id %r ignored: not 1-%d printable "
                 "characters", session_id[:40], MAX_SESSION_ID_CHARS)  # fmt: skip
        return None
    lease_s, release = None, False
    if hints is not None:
        lease_s, release = _read_hints(hints)
    return SessionScope(session_id, lease_s, release)


def log_renewal(scope: SessionScope, renewal: SessionRenewal | None) -> None:
    """The sidecar's answer to a retain hint's lease: accepted, clipped or rejected."""
    if renewal is None:
        return  # unreachable: the lookup's own fault path says so
    level = logging.INFO if renewal.outcome == "accepted" else logging.WARNING
    _log.log(("retain", renewal.outcome), level, "kv_hints retain of session %s (lease %s s): "
             "%s, %g s %s", scope.session_id, scope.lease_s, renewal.outcome, renewal.lease_s,
             renewal.reason)  # fmt: skip


class SessionEnds:
    """Release hints sent after their request finished, one thread, never on the scheduler's."""

    def __init__(self, clients: NamespaceClients) -> None:
        self._clients = clients
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvsplice-session-end")

    def end(self, namespace: str, scope: SessionScope) -> None:
        self._pool.submit(self._end, namespace, scope.session_id)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _end(self, namespace: str, session_id: str) -> None:
        try:
            self._clients.for_namespace(namespace).end_session(session_id)
        except Exception as error:  # a release not sent: the session expires instead
            _log.log("end", logging.WARNING, "ending session %s failed: %s", session_id, error)


def _read_hints(hints: Any) -> tuple[float | None, bool]:
    """A retain's lease and whether a release was asked; every action's outcome logged."""
    if hints.protocol_version != HINTS_PROTOCOL_VERSION:
        for action in hints.actions:
            _outcome(action, "rejected", f"protocol_version {hints.protocol_version!r} != '1'")
        return None, False
    lease_s, release = None, False
    for action in hints.actions:
        problem = _problem(action)
        if problem is not None:
            _outcome(action, "rejected", problem)
        elif action.action_type == RETAIN:
            lease_s = action.payload.get("lease_s")  # the sidecar clips it, or grants it
        else:
            release = True
            _outcome(action, "accepted", "the session ends when this request finishes")
    return (None if lease_s is None else float(lease_s)), release


def _problem(action: Any) -> str | None:
    if action.action_type not in (RETAIN, RELEASE):
        return f"action_type {action.action_type!r} is not {RETAIN!r} or {RELEASE!r}"
    if action.action_version != ACTION_VERSION:
        return f"action_version {action.action_version!r} != {ACTION_VERSION!r}"
    lease_s = action.payload.get("lease_s") if action.action_type == RETAIN else None
    valid = isinstance(lease_s, int | float) and not isinstance(lease_s, bool)
    if lease_s is not None and not (valid and lease_s > 0 and math.isfinite(lease_s)):
        return f"lease_s {lease_s!r} is not a positive number of seconds"
    return None


def _outcome(action: Any, outcome: str, reason: str) -> None:
    level = logging.INFO if outcome == "accepted" else logging.WARNING
    _log.log((action.action_type, outcome), level, "kv_hints %s %s (%s): %s: %s",
             action.action_type, action.action_id, action.action_version, outcome, reason)  # fmt: skip
