"""Agent sessions on the wire: session ids checked, holds and ends passed to the store,
their clipped and rejected outcomes logged (rate-limited). What a hold means is `storage.sessions`'."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvsplice.common.errors import InvalidRequest
from kvsplice.common.log_limits import RateLimitedLog
from kvsplice.storage.sessions import Hold, HoldOutcome
from kvsplice.storage.tiered_store import TieredStore

logger = logging.getLogger(__name__)
MAX_SESSION_ID_CHARS = 256
LOG_INTERVAL_S = 30.0


def check_session_id(session_id: str) -> str:
    if not session_id or len(session_id) > MAX_SESSION_ID_CHARS or not session_id.isprintable():
        raise InvalidRequest(
            f"session_id must be 1-{MAX_SESSION_ID_CHARS} printable characters, "
            f"got {session_id[:40]!r}"
        )
    return session_id


def checked_session(session_id: str) -> str:
    """A request's optional session id: empty (none) or a valid one (else InvalidRequest)."""
    return session_id and check_session_id(session_id)


class SessionService:
    def __init__(self, store: TieredStore) -> None:
        self._store = store
        self._log = RateLimitedLog(logger, LOG_INTERVAL_S)

    def hold(
        self,
        namespace: str,
        session_id: str,
        context_keys: Sequence[bytes] = (),
        lease_s: float | None = None,
    ) -> Hold:
        """Renew the session's lease (`lease_s`: asked by a retain hint) and hold `context_keys`."""
        hold = self._store.sessions.hold(
            namespace, check_session_id(session_id), context_keys, lease_s
        )
        if hold.outcome is not HoldOutcome.ACCEPTED:
            self._log.log(
                ("hold", hold.outcome), logging.WARNING, "session %s/%s: hold %s: %s",
                namespace, session_id, hold.outcome.value, hold.reason,
            )  # fmt: skip
        return hold

    def end(self, namespace: str, session_id: str) -> bool:
        """Release the session's segments (its release hint); False if it was not live."""
        return self._store.sessions.end(namespace, check_session_id(session_id))

    def num_live(self) -> int:
        return self._store.sessions.num_live()
