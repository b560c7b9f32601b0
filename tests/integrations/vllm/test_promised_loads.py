"""Promised loads: built over the looked-up pieces, handed over once, in the step or beside it."""

from __future__ import annotations

from kvsplice.common.keys import chunk_links
from kvsplice.integrations.vllm.promised_loads import PromisedLoads
from kvsplice.integrations.vllm.sidecar_faults import FaultLog
from kvsplice.integrations.vllm.span_cover import ReusedSpan
from kvsplice.storeclient.results import PrefixLookup, SegmentRef

FINGERPRINT = "kvfp1-" + "12" * 16
BLOCK = 4
TOKENS = list(range(40, 60))
LINKS = chunk_links(FINGERPRINT, TOKENS, BLOCK)
LOOKUP = PrefixLookup(
    tuple(SegmentRef(ln.key, ln.start, ln.num_tokens, 0, 2, 100) for ln in LINKS[:3]), 12
)


def test_a_load_names_the_overlapping_pieces_with_their_parents_and_the_runs_after() -> None:
    loads = PromisedLoads(BLOCK, "never", FaultLog())
    run = (ReusedSpan("run", 12, 4, 0, 100),)
    load = loads.promise(
        "r", "ns", FINGERPRINT, LOOKUP, TOKENS, [9, 8, 7, 6, 5], 4, 16, run, is_async=False
    )
    assert [(p.start, p.parent_key) for p in load.pieces] == [
        (ln.start, ln.parent_key) for ln in LINKS[1:3]
    ]
    assert (load.block_ids, load.token_ids, load.spans) == ((8, 7, 6), tuple(TOKENS[:16]), run)
    assert loads.pending("r") and loads.take("r") is load and loads.take("r") is None


def test_a_load_whose_pieces_cannot_be_built_still_goes_out_without_them() -> None:
    faults = FaultLog()
    broken = PrefixLookup((object(),), 12)  # type: ignore[arg-type]
    load = PromisedLoads(BLOCK, "never", faults).promise(
        "r", "ns", FINGERPRINT, broken, TOKENS, [1, 2, 3], 0, 12, (), is_async=False
    )
    assert load.pieces == () and load.block_ids == (1, 2, 3)  # reported failed, recomputed
    assert faults.counts["building a load failed"] == 1


def test_async_loads_go_out_with_the_step_that_promised_them() -> None:
    loads = PromisedLoads(BLOCK, "always", FaultLog())
    assert loads.is_async("r")
    load = loads.promise(
        "r", "ns", FINGERPRINT, LOOKUP, TOKENS, [1, 2, 3], 0, 12, (), is_async=True
    )
    assert not loads.pending("r") and loads.take_async() == [load] and loads.take_async() == []


def test_auto_goes_beside_the_steps_only_while_others_run() -> None:
    loads = PromisedLoads(BLOCK, "auto", FaultLog())
    assert not loads.is_async("r")
    loads.ran({"other"})
    assert loads.is_async("r")
    loads.forget("other")
    assert not loads.is_async("r") and not PromisedLoads(BLOCK, "never", FaultLog()).is_async("r")


def test_a_promise_ending_inside_its_last_piece_carries_that_piece_s_tokens_whole() -> None:
    """A prompt as long as a stored chunk is promised one block short (vLLM computes its
    last token); the piece is checked whole, so its tokens go with the load."""
    links = chunk_links(FINGERPRINT, TOKENS, 2 * BLOCK)  # chunks of two blocks
    lookup = PrefixLookup(
        tuple(SegmentRef(ln.key, ln.start, ln.num_tokens, 0, 2, 100) for ln in links[:2]), 16
    )
    load = PromisedLoads(BLOCK, "never", FaultLog()).promise(
        "r", "ns", FINGERPRINT, lookup, TOKENS[:16], [1, 2, 3], 0, 12, (), is_async=False
    )
    assert [p.start for p in load.pieces] == [0, 8] and load.end == 12
    assert load.token_ids == tuple(TOKENS[:16]) and load.block_ids == (1, 2, 3)
