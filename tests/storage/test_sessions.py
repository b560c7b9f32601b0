"""Session leases: renewal, expiry, end, segments shared by sessions, quota and lease clipping,
and the eviction order they imply (released first, then unheld LRU, then held)."""

from __future__ import annotations

from kvsplice.storage.sessions import HoldOutcome, SessionLeases


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def make_leases(
    clock: Clock, lease_s: float = 10.0, max_lease_s: float = 60.0, budget: int | None = None
) -> SessionLeases:
    return SessionLeases(lease_s, max_lease_s, lambda namespace: budget, clock)


def order(leases: SessionLeases, lru: list[bytes]) -> list[bytes]:
    return list(leases.eviction_order(lru, lambda key: key in lru))


def test_a_hold_lasts_one_lease_and_each_request_renews_it() -> None:
    clock = Clock()
    leases = make_leases(clock)
    assert leases.hold(("ns", "s"), [(b"a", 100)]).outcome is HoldOutcome.ACCEPTED
    clock.now_s = 9.0
    leases.hold(("ns", "s"), [])  # a request of the session: renewed to t=19
    clock.now_s = 18.0
    assert leases.expire() == 0 and leases.is_held(b"a")
    clock.now_s = 19.5
    assert leases.expire() == 1
    assert not leases.is_held(b"a")
    assert leases.num_live() == 0


def test_ending_a_session_releases_its_keys_first_in_line() -> None:
    clock = Clock()
    leases = make_leases(clock)
    leases.hold(("ns", "s"), [(b"a", 1), (b"b", 1)])
    lru = [b"x", b"a", b"b", b"y"]
    assert order(leases, lru) == [b"x", b"y", b"a", b"b"]  # held last
    assert leases.end(("ns", "s"))
    assert not leases.end(("ns", "s"))
    assert order(leases, lru) == [b"a", b"b", b"x", b"y"]  # released first


def test_a_key_shared_by_two_sessions_is_held_while_either_lives() -> None:
    clock = Clock()
    leases = make_leases(clock)
    leases.hold(("ns", "one"), [(b"shared", 1), (b"own", 1)])
    leases.hold(("ns", "two"), [(b"shared", 1)])
    leases.end(("ns", "one"))
    assert leases.is_held(b"shared") and not leases.is_held(b"own")
    assert leases.held_nbytes("ns") == 1  # counted once
    leases.end(("ns", "two"))
    assert not leases.is_held(b"shared")
    assert leases.held_nbytes("ns") == 0


def test_holds_beyond_the_quota_and_leases_beyond_the_max_are_clipped() -> None:
    clock = Clock()
    leases = make_leases(clock, budget=250)
    hold = leases.hold(("ns", "s"), [(b"a", 100), (b"b", 100), (b"c", 100)], lease_s=600.0)
    assert hold.outcome is HoldOutcome.CLIPPED
    assert (hold.num_held, hold.lease_s) == (2, 60.0)
    assert "quota" in hold.reason and "clipped" in hold.reason
    assert not leases.is_held(b"c") and leases.held_nbytes("ns") == 200
    assert leases.hold(("other", "s"), [(b"d", 200)]).outcome is HoldOutcome.ACCEPTED


def test_sessions_off_or_a_bad_lease_is_rejected_and_holds_nothing() -> None:
    clock = Clock()
    off = make_leases(clock, lease_s=0.0)
    assert off.hold(("ns", "s"), [(b"a", 1)]).outcome is HoldOutcome.REJECTED
    assert not off.is_held(b"a")
    on = make_leases(clock)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        assert on.hold(("ns", "s"), [(b"a", 1)], lease_s=bad).outcome is HoldOutcome.REJECTED
    assert not on.is_held(b"a")


def test_a_forgotten_key_leaves_every_session_and_the_released_line() -> None:
    clock = Clock()
    leases = make_leases(clock)
    leases.hold(("ns", "s"), [(b"a", 5), (b"b", 5)])
    leases.forget(b"a")
    assert leases.held_nbytes("ns") == 5
    leases.end(("ns", "s"))
    leases.forget(b"b")
    assert order(leases, [b"x"]) == [b"x"]
    assert leases.held_nbytes("ns") == 0


def test_a_released_key_used_again_goes_back_to_lru_order() -> None:
    clock = Clock()
    leases = make_leases(clock)
    leases.hold(("ns", "s"), [(b"a", 1), (b"b", 1)])
    leases.end(("ns", "s"))
    leases.touched(b"b")  # a request without a session read it: the newest in LRU order
    assert order(leases, [b"x", b"a", b"b"]) == [b"a", b"x", b"b"]


def test_a_released_key_held_again_leaves_the_released_line() -> None:
    clock = Clock()
    leases = make_leases(clock)
    leases.hold(("ns", "one"), [(b"a", 1)])
    leases.end(("ns", "one"))
    leases.hold(("ns", "two"), [(b"a", 1)])
    assert order(leases, [b"a", b"x"]) == [b"x", b"a"]
