"""The retention rules beside the lease (`RetentionRules`), each against the order without it:
a session's passed-over tails go right after released segments, held segments after their held
descendants, segments re-used without a session after other unheld ones while sessions hold
any, and those and the held ones by forecast next use; none of them changes the order of a
store where no session holds anything."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from kvsplice.storage import sessions
from kvsplice.storage.config import RetentionRules
from kvsplice.storage.sessions import SessionLeases

ALL = RetentionRules()
NONE = RetentionRules(
    tails_first=False, leaves_first=False, reused_last=False, forecast=False, max_remembered=0
)


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def make_leases(rules: RetentionRules) -> SessionLeases:
    return SessionLeases(60.0, 60.0, lambda namespace: None, Clock(), rules)


def order(leases: SessionLeases, lru: list[bytes]) -> list[bytes]:
    return list(leases.eviction_order(lru, lambda key: key in lru))


def pipeline(leases: SessionLeases) -> None:
    """Planner: puts task (after root) and its instruction; solver: re-reads task, puts plan."""
    ref = ("ns", "s")
    leases.hold(ref, [])  # the planner's lookup: nothing matched
    leases.hold(ref, [(b"task", 1)], parents={b"task": b"root"})
    leases.hold(ref, [(b"instr-p", 1)], parents={b"instr-p": b"task"})
    leases.hold(ref, [(b"task", 1)])  # the solver's lookup matched the task
    leases.touched(b"task")
    leases.hold(ref, [(b"plan", 1)], parents={b"plan": b"task"})


def test_a_tail_the_session_went_on_without_goes_before_unheld_segments() -> None:
    lru = [b"task", b"instr-p", b"x", b"plan"]
    with_rule = make_leases(replace(NONE, tails_first=True))
    pipeline(with_rule)
    assert order(with_rule, lru) == [b"instr-p", b"x", b"task", b"plan"]
    without = make_leases(NONE)  # negative control: the tail waits with the held ones
    pipeline(without)
    assert order(without, lru) == [b"x", b"task", b"instr-p", b"plan"]


def test_the_latest_put_is_no_tail_yet() -> None:
    """The segment just put (the chain being written, a chat's last turn) is not demoted."""
    leases = make_leases(ALL)
    ref = ("ns", "s")
    leases.hold(ref, [(b"a", 1)], parents={b"a": b"root"})
    assert order(leases, [b"a", b"x"]) == [b"x", b"a"]
    leases.hold(ref, [(b"b", 1)], parents={b"b": b"a"})  # extends a: a is a prefix
    assert order(leases, [b"a", b"b", b"x"]) == [b"x", b"b", b"a"]


def test_a_held_segment_goes_after_its_held_descendants() -> None:
    lru = [b"task", b"plan", b"x"]  # task least recently used: its eviction strands plan
    with_rule = make_leases(replace(NONE, leaves_first=True))
    pipeline(with_rule)
    assert order(with_rule, lru) == [b"x", b"plan", b"task"]
    without = make_leases(NONE)  # negative control: LRU order strands plan
    pipeline(without)
    assert order(without, lru) == [b"x", b"task", b"plan"]


def test_segments_re_used_without_a_session_go_after_the_other_unheld_ones() -> None:
    lru = [b"doc", b"held", b"one-shot"]
    with_rule = make_leases(replace(NONE, reused_last=True))
    without = make_leases(NONE)
    for leases in (with_rule, without):
        leases.touched(b"doc")  # read again by a request without a session
        leases.hold(("ns", "s"), [(b"held", 1)], parents={b"held": b"root"})
    assert order(with_rule, lru) == [b"one-shot", b"doc", b"held"]
    assert order(without, lru) == [b"doc", b"one-shot", b"held"]  # negative control


def test_a_segment_put_again_soon_after_its_eviction_is_re_used() -> None:
    lru = [b"doc", b"held", b"one-shot"]
    with_rule = make_leases(replace(NONE, reused_last=True, max_remembered=4))
    without = make_leases(replace(NONE, reused_last=True))  # nothing remembered
    for leases in (with_rule, without):
        leases.hold(("ns", "s"), [(b"held", 1)], parents={b"held": b"root"})
        leases.forget(b"doc")  # evicted
        leases.inserted(b"doc")  # put again: its next reader missed it
        leases.inserted(b"one-shot")
    assert order(with_rule, lru) == [b"one-shot", b"doc", b"held"]
    assert order(without, lru) == [b"doc", b"one-shot", b"held"]


def test_only_the_latest_evictions_are_remembered() -> None:
    leases = make_leases(replace(NONE, reused_last=True, max_remembered=2))
    leases.hold(("ns", "s"), [(b"held", 1)], parents={b"held": b"root"})
    for key in (b"old", b"mid", b"new"):
        leases.forget(key)
    for key in (b"old", b"mid"):
        leases.inserted(key)
    # old was forgotten (only 2 remembered): a first put, it goes first
    assert order(leases, [b"mid", b"old", b"held"]) == [b"old", b"mid", b"held"]


def test_with_nothing_held_every_rule_leaves_lru_order() -> None:
    leases = make_leases(ALL)
    leases.touched(b"b")
    leases.forget(b"c")
    leases.inserted(b"c")
    lru = [b"a", b"b", b"c", b"d"]
    assert order(leases, lru) == lru


def test_the_order_stays_lazy_while_sessions_hold_segments() -> None:
    """The first victim costs one step of the LRU scan, not a pass over the whole store."""
    leases = make_leases(ALL)
    pipeline(leases)
    scanned: list[bytes] = []

    def lru() -> Iterator[bytes]:
        for key in [b"one-shot", *(b"k%d" % i for i in range(1000)), b"task", b"plan"]:
            scanned.append(key)
            yield key

    victims = leases.eviction_order(lru(), lambda key: True)
    assert next(victims) == b"instr-p"  # the tail, from the held keys
    assert next(victims) == b"one-shot"
    assert len(scanned) == 1


def forecast_history(rules: RetentionRules) -> tuple[SessionLeases, Clock]:
    """Sessions came back within 10 s or never; a document used twice in 65 s; at 65 s one
    session has been quiet for 45 s, another asked 1 s ago."""
    clock = Clock()
    leases = SessionLeases(60.0, 60.0, lambda namespace: None, clock, rules)
    leases.hold(("ns", "gone"), [])  # never comes back: expires at 60 s
    leases.hold(("ns", "back"), [])
    for key in (b"doc-0", b"doc-1"):
        leases.inserted(key)
    clock.now_s = 10.0
    leases.hold(("ns", "back"), [])  # a 10 s wait
    clock.now_s = 20.0
    leases.hold(("ns", "quiet"), [(b"quiet", 1)], parents={b"quiet": b"root"})
    for clock.now_s in (20.0, 30.0):
        for key in (b"doc-0", b"doc-1"):  # one prompt reads both, in order
            leases.touched(key)
    clock.now_s = 64.0
    leases.hold(("ns", "busy"), [(b"busy", 1)], parents={b"busy": b"root"})
    clock.now_s = 65.0
    return leases, clock


def test_the_forecast_puts_a_session_quiet_past_every_return_before_a_re_used_document() -> None:
    """Forecasts at 65 s: quiet never (no session came back after 45 s, one never did), the
    document in 32.5 s (65 s / 2 uses), busy in 18 s (9 s left of a 10 s wait, 1 in 2 back)."""
    lru = [b"x", b"doc-0", b"doc-1", b"quiet", b"busy"]
    with_rule, _ = forecast_history(replace(NONE, reused_last=True, forecast=True))
    assert order(with_rule, lru) == [b"x", b"quiet", b"doc-1", b"doc-0", b"busy"]
    without, _ = forecast_history(replace(NONE, reused_last=True))  # negative control
    assert order(without, lru) == [b"x", b"doc-0", b"doc-1", b"quiet", b"busy"]


def test_the_forecast_keeps_a_session_that_just_asked_until_it_is_quiet_too_long() -> None:
    """busy outranks the document until it has been quiet for longer than sessions came back
    after (10 s)."""
    leases, clock = forecast_history(replace(NONE, reused_last=True, forecast=True))
    lru = [b"doc-0", b"busy"]
    assert order(leases, lru) == [b"doc-0", b"busy"]
    clock.now_s = 75.5  # busy quiet for 11.5 s: longer than any session came back after
    assert order(leases, lru) == [b"busy", b"doc-0"]


def test_the_forecast_ranks_only_the_oldest_re_used_unheld_keys(monkeypatch) -> None:
    """Its cost bound: past `MAX_FORECAST_UNHELD` of them, the rest wait after in LRU order."""
    monkeypatch.setattr(sessions, "MAX_FORECAST_UNHELD", 1)
    leases, _ = forecast_history(replace(NONE, reused_last=True, forecast=True))
    lru = [b"x", b"doc-0", b"doc-1", b"quiet", b"busy"]
    assert order(leases, lru) == [b"x", b"quiet", b"doc-0", b"busy", b"doc-1"]
