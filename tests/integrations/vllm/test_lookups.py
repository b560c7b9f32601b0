"""Lookups off the scheduler loop: one wait budget per scheduler step, not per request."""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvsplice.integrations.vllm.lookups import MISS, Found, LookupQuery, Lookups
from kvsplice.integrations.vllm.sidecar_faults import FaultLog, sidecar_breaker

QUERY = LookupQuery("ns", "kvfp1-" + "ab" * 16, 64)


def _slow(query: LookupQuery, token_ids: Sequence[int]) -> Found:
    time.sleep(0.2)  # a sidecar answering lookups after 200 ms
    return MISS


def _lookups(wait_s: float) -> Lookups:
    return Lookups(_slow, wait_s=wait_s, timeout_s=5.0, breaker=sidecar_breaker(), faults=FaultLog(),
                   max_workers=16)  # fmt: skip


def test_new_requests_of_one_step_share_its_wait_budget() -> None:
    lookups = _lookups(wait_s=0.02)
    answers = [lookups.poll(f"r{i}", QUERY, range(64)) for i in range(16)]
    assert answers == [None] * 16  # none answered within the step: asked again later
    assert lookups.waited_s <= 0.02 + 1e-9  # at most one lookup_wait for the whole step
    lookups.new_step()
    assert lookups.poll("r16", QUERY, range(64)) is None
    assert lookups.waited_s > 0.02  # the next step waits again, once
    lookups.close()


def test_a_fast_sidecar_still_answers_in_the_step() -> None:
    fast = Lookups(lambda q, t: MISS, wait_s=1.0, timeout_s=5.0, breaker=sidecar_breaker(),
                   faults=FaultLog())  # fmt: skip
    assert [fast.poll(f"r{i}", QUERY, range(64)) for i in range(8)] == [MISS] * 8
    fast.close()


def step_stall_s(num_requests: int = 16, wait_s: float = 0.02) -> float:
    """How long one step's `num_requests` first polls block against the 200 ms sidecar."""
    lookups = _lookups(wait_s)
    start = time.perf_counter()
    for i in range(num_requests):
        lookups.poll(f"r{i}", QUERY, range(64))
    stalled = time.perf_counter() - start
    lookups.close()
    return stalled


if __name__ == "__main__":  # the measurement: python tests/integrations/vllm/test_lookups.py
    print(
        f"16 new requests, lookup_wait_ms 20, sidecar at 200 ms: step stalled {1000 * step_stall_s():.0f} ms"
    )
