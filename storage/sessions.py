"""Session leases: which segments live agent sessions hold, and the eviction order they imply.

Owns sessions (a namespace's `session_id`, its lease deadline, the keys it holds), which
keys no live session holds any more, and each namespace's held bytes. It does no I/O and
takes no locks: `TieredStore` calls it under its own lock, as it calls `Catalog`.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from kvsplice.storage.config import RetentionRules
from kvsplice.storage.reuse_forecast import ReuseForecast
from kvsplice.storage.reused_keys import ReusedKeys
from kvsplice.storage.session_chains import HeldChains

SessionRef = tuple[str, str]  # (namespace, session_id)
MAX_FORECAST_UNHELD = 4096  # re-used unheld keys ranked by forecast per pass (the oldest)


class HoldOutcome(StrEnum):
    """What became of a request to hold a session's segments (logged, returned on the wire)."""

    ACCEPTED = "accepted"
    CLIPPED = "clipped"  # held, but shorter than asked or not every key (the tenant's quota)
    REJECTED = "rejected"  # sessions are off, or the lease asked for is not a duration


@dataclass(frozen=True)
class Hold:
    outcome: HoldOutcome
    lease_s: float  # the lease granted (0 when rejected)
    num_held: int  # keys of this call the session holds now
    reason: str = ""


@dataclass
class _Session:
    keys: dict[bytes, None] = field(default_factory=dict)  # in the order first held
    latest_seq: int = 0  # the number of its latest hold call (`SessionLeases._num_holds`)
    expires_at_s: float = 0.0
    lease_s: float = 0.0
    renewed_at_s: float | None = None  # its latest request


class SessionLeases:
    """Live sessions and the segments they hold, for `lease_s` after their last request.

    A key is held while any live session holds it (a shared prefix stays while one of its
    sessions lives); the keys of ended and expired sessions are *released*, and eviction
    takes them first, oldest release first, then unheld keys in the caller's order, then held
    keys in that order, refined by `rules` (`eviction_order`). A namespace's held bytes never
    exceed `held_budget(namespace)`.
    """

    def __init__(
        self,
        lease_s: float,
        max_lease_s: float,
        held_budget: Callable[[str], int | None],
        clock: Callable[[], float],
        rules: RetentionRules | None = None,
    ) -> None:
        self.lease_s = lease_s
        self.rules = RetentionRules() if rules is None else rules
        self.max_lease_s = max(max_lease_s, lease_s)
        self._held_budget = held_budget
        self._clock = clock
        self._sessions: dict[SessionRef, _Session] = {}
        self._holders: dict[bytes, set[SessionRef]] = {}
        self._key_nbytes: dict[bytes, tuple[str, int]] = {}
        self._released: OrderedDict[bytes, None] = OrderedDict()
        self._held_nbytes: Counter[str] = Counter()
        self._deadlines: list[tuple[float, SessionRef]] = []  # heap; stale items skipped
        self._chains = HeldChains()
        self._num_holds = 0
        self._reused = ReusedKeys(self.rules.max_remembered)
        self._forecast = ReuseForecast(self.rules.max_remembered)

    @property
    def enabled(self) -> bool:
        return self.lease_s > 0

    def hold(
        self,
        ref: SessionRef,
        keys: Iterable[tuple[bytes, int]],
        lease_s: float | None = None,
        parents: Mapping[bytes, bytes] | None = None,
    ) -> Hold:
        """Renew `ref`'s lease (`lease_s`, else the default) and hold `keys` (key, nbytes);
        `parents`: the key each of them was stored after, where known (the chains)."""
        if not self.enabled:
            return Hold(HoldOutcome.REJECTED, 0.0, 0, "sessions are off (--session-lease-s 0)")
        if lease_s is not None and not (lease_s > 0 and math.isfinite(lease_s)):
            return Hold(HoldOutcome.REJECTED, 0.0, 0, f"lease_s {lease_s!r} is not a duration")
        self.expire()
        asked_s = self.lease_s if lease_s is None else lease_s
        granted_s = min(asked_s, self.max_lease_s)
        session = self._sessions.setdefault(ref, _Session())
        self._num_holds += 1
        session.latest_seq = self._num_holds
        self._renew(ref, session, granted_s)
        num_held, num_refused = self._hold_keys(ref, session, keys, parents or {})
        reasons = []
        if granted_s < asked_s:
            reasons.append(f"lease {asked_s:g} s clipped to {granted_s:g} s")
        if num_refused:
            reasons.append(f"{num_refused} segments over the namespace's quota not held")
        outcome = HoldOutcome.CLIPPED if reasons else HoldOutcome.ACCEPTED
        return Hold(outcome, granted_s, num_held, "; ".join(reasons))

    def end(self, ref: SessionRef) -> bool:
        """End `ref` now (its release hint); False if it was not live."""
        session = self._sessions.pop(ref, None)
        if session is None:
            return False
        for key in session.keys:
            self._let_go(ref, key)
        return True

    def expire(self) -> int:
        """End the sessions whose lease ran out; how many."""
        now_s = self._clock()
        num_expired = 0
        while self._deadlines and self._deadlines[0][0] <= now_s:
            deadline_s, ref = heapq.heappop(self._deadlines)
            session = self._sessions.get(ref)
            if session is not None and session.expires_at_s == deadline_s:
                self.end(ref)
                self._forecast.expired()
                num_expired += 1
        return num_expired

    def forget(self, key: bytes) -> None:
        """`key` left the store: no session holds it, nothing releases it."""
        holders = self._holders.pop(key, None)
        if holders is not None:
            for ref in holders:
                self._sessions[ref].keys.pop(key, None)
            namespace, nbytes = self._key_nbytes[key]
            self._held_nbytes[namespace] -= nbytes
        self._released.pop(key, None)
        self._key_nbytes.pop(key, None)
        self._chains.forget(key)
        self._reused.forget(key)
        self._forecast.forget(key)

    def touched(self, key: bytes) -> None:
        """`key` was used again (by any request): no longer first in line as released."""
        self._released.pop(key, None)
        self._chains.read(key)
        self._reused.read(key)
        self._forecast.read(key, self._clock())

    def inserted(self, key: bytes) -> None:
        """`key` was stored (put): put again soon after it was evicted, it is re-used."""
        self._reused.stored(key)
        self._forecast.stored(key, self._clock())

    def is_held(self, key: bytes) -> bool:
        return key in self._holders

    def num_live(self) -> int:
        return len(self._sessions)

    def held_nbytes(self, namespace: str) -> int:
        return self._held_nbytes[namespace]

    def eviction_order(
        self, lru_keys: Iterable[bytes], in_scope: Callable[[bytes], bool]
    ) -> Iterator[bytes]:
        """`lru_keys` (the catalog's order) reranked: released keys in scope first, then
        the unheld ones, then the held ones, each kind in `lru_keys`' order. While any
        session holds a key, `rules` refine it: tails right after the released keys;
        re-used unheld keys after the other unheld ones; each held key after its held
        descendants.

        NOTE: held keys are evicted last, not never: a put is refused only when nothing at
        all is evictable, as without sessions (a lease is a priority, not a pin). With nothing
        held the order stays lazy and exactly as without sessions.
        """
        self.expire()
        released = [key for key in self._released if in_scope(key)]
        yield from released
        skip = set(released)
        if not self._holders:
            yield from (key for key in lru_keys if key not in skip)
            return
        yield from self._held_order(lru_keys, skip, in_scope)

    # -- internals -----------------------------------------------------------------------

    def _held_order(
        self, lru_keys: Iterable[bytes], skip: set[bytes], in_scope: Callable[[bytes], bool]
    ) -> Iterator[bytes]:
        """Tails, then the unheld keys (once-used ones as `lru_keys` reaches them: lazy), then
        re-used unheld ones, then the held ones; with `forecast`, those two kinds together,
        the furthest forecast next use first."""
        rules, holders, reused = self.rules, self._holders, self._reused
        if rules.tails_first:
            # NOTE: in the order first held, which is LRU order for tails: never read again
            # since their put, their catalog place is their put's.
            tails = [key for key in holders if in_scope(key) and self._is_tail(key)]
            yield from tails
            skip.update(tails)
        unheld_reused: list[bytes] = []
        held: list[bytes] = []
        for key in lru_keys:
            if key in skip:
                continue
            if key in holders:
                held.append(key)
            elif rules.reused_last and key in reused:
                unheld_reused.append(key)
            else:
                yield key
        if rules.forecast:
            # NOTE: ranking costs ~2 us a key: past the oldest MAX_FORECAST_UNHELD re-used
            # unheld keys, the rest wait after the ranked ones in LRU order, so a pass over a
            # store of 100k re-used segments costs what the scan costs (tens of ms), not 10x
            forecast = unheld_reused[:MAX_FORECAST_UNHELD] + held
            held = self._forecast_order(forecast) + unheld_reused[MAX_FORECAST_UNHELD:]
        else:
            yield from unheld_reused
        if not rules.leaves_first:
            yield from held
            return

        def wanted(key: bytes) -> bool:
            return key in holders and key not in skip and in_scope(key)

        yield from self._chains.leaves_first(held, wanted)

    def _forecast_order(self, keys: list[bytes]) -> list[bytes]:
        """`keys` by their forecast next use, furthest first: a held key by its soonest
        holder's next request, an unheld one by its own uses (`ReuseForecast`)."""
        now_s, forecast, holders = self._clock(), self._forecast, self._holders
        session_wait_s = {
            ref: forecast.session_wait_s(now_s - (session.renewed_at_s or now_s))
            for ref, session in self._sessions.items()
        }

        def rank(item: tuple[int, bytes]) -> tuple[float, int]:
            position, key = item
            refs = holders.get(key)
            if refs is None:
                return forecast.segment_wait_s(key, now_s), position
            return min(session_wait_s[ref] for ref in refs), -position

        # NOTE: ties (one prompt's segments) of held keys in `keys`' order, whose chains
        # `leaves_first` knows; of unheld ones, whose chains it does not, most recently
        # used first: a prompt reads its segments in order, and evicting an earlier one
        # would strand the later ones
        return [key for _, key in sorted(enumerate(keys), key=rank, reverse=True)]

    def _is_tail(self, key: bytes) -> bool:
        latest_seq = max(self._sessions[ref].latest_seq for ref in self._holders[key])
        return self._chains.is_tail(key, latest_seq)

    def _renew(self, ref: SessionRef, session: _Session, lease_s: float) -> None:
        now_s = self._clock()
        if session.renewed_at_s is not None and now_s > session.renewed_at_s:
            self._forecast.returned(now_s - session.renewed_at_s)  # one instant's: no wait
        session.renewed_at_s = now_s
        session.lease_s = lease_s
        session.expires_at_s = now_s + lease_s
        heapq.heappush(self._deadlines, (session.expires_at_s, ref))

    def _hold_keys(
        self,
        ref: SessionRef,
        session: _Session,
        keys: Iterable[tuple[bytes, int]],
        parents: Mapping[bytes, bytes],
    ) -> tuple[int, int]:
        namespace = ref[0]
        budget = self._held_budget(namespace)
        num_held = num_refused = 0
        for key, nbytes in keys:
            holders = self._holders.get(key)
            if holders is None:
                if budget is not None and self._held_nbytes[namespace] + nbytes > budget:
                    num_refused += 1
                    continue
                holders = self._holders[key] = set()
                self._released.pop(key, None)
                self._key_nbytes[key] = (namespace, nbytes)
                self._held_nbytes[namespace] += nbytes
            holders.add(ref)
            session.keys[key] = None
            self._chains.held(key, parents.get(key), session.latest_seq)
            num_held += 1
        return num_held, num_refused

    def _let_go(self, ref: SessionRef, key: bytes) -> None:
        holders = self._holders.get(key)
        if holders is None:
            return
        holders.discard(ref)
        if holders:
            return
        del self._holders[key]
        self._released[key] = None
        namespace, nbytes = self._key_nbytes[key]
        self._held_nbytes[namespace] -= nbytes
