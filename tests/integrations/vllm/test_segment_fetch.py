"""One fetch-and-verify for both kinds of loaded run: a chain link (piece) and a run by content.

A piece that fails is corrupt (named, so it is deleted and never promised again); a run found
by content that fails is only refused.
"""

from __future__ import annotations

import pytest
from helpers.vllm_worker import (
    DIM,
    HEADS,
    LAYERS,
    TOKENS,
    FakeClients,
    FakeStore,
    load_spec,
    store_three_chunks,
)

from kvsplice.integrations.vllm.segment_fetch import LoadFault, SegmentFetch
from kvsplice.integrations.vllm.span_cover import ReusedSpan
from kvsplice.integrations.vllm.transfer_specs import LoadSpec

DIMS = (LAYERS, HEADS, DIM)


def stored() -> tuple[FakeStore, LoadSpec]:
    store = FakeStore()
    store_three_chunks(store)
    return store, load_spec((5, 9, 4), 3)


def span_spec(spec: LoadSpec, tokens: tuple[int, ...]) -> tuple[LoadSpec, ReusedSpan]:
    """The second chunk (tokens 4..8, computed at 4) as a run at 8..12 of a request."""
    span = ReusedSpan(spec.pieces[1].segment_id, 8, 4, 0, 4)
    return LoadSpec("r", spec.namespace, spec.root, 8, 12, (5,), tokens, (), spans=(span,)), span


def fault_of(fetch: object) -> LoadFault:
    with pytest.raises(LoadFault) as caught:
        fetch()  # type: ignore[operator]
    return caught.value


def test_a_verified_piece_and_run_come_back_in_stored_form() -> None:
    store, spec = stored()
    fetch = SegmentFetch(FakeClients(store), DIMS)  # type: ignore[arg-type]
    assert fetch.piece(spec, spec.pieces[0]).kv_shape == (LAYERS, HEADS, 4, DIM)
    run_spec, span = span_spec(spec, (7,) * 8 + TOKENS[4:8])
    assert fetch.span(run_spec, span).start_position == 4


def test_a_piece_that_fails_is_named_corrupt_a_run_is_only_refused() -> None:
    store, spec = stored()
    fetch = SegmentFetch(FakeClients(store), DIMS)  # type: ignore[arg-type]
    piece = spec.pieces[1]
    store.corrupt.add(piece.segment_id)
    fault = fault_of(lambda: fetch.piece(spec, piece))
    assert (fault.position, fault.corrupt_segment_id) == (4, piece.segment_id)
    run_spec, span = span_spec(spec, (7,) * 8 + TOKENS[4:8])
    assert fault_of(lambda: fetch.span(run_spec, span)).corrupt_segment_id is None
    store.corrupt.clear()
    store.gone.add(piece.segment_id)
    assert fault_of(lambda: fetch.piece(spec, piece)).corrupt_segment_id is None  # evicted


def test_a_segment_that_is_not_what_was_promised_is_refused() -> None:
    store, spec = stored()
    fetch = SegmentFetch(FakeClients(store), DIMS)  # type: ignore[arg-type]
    lying = spec.pieces[2]
    store.segments[lying.segment_id] = store.segments[spec.pieces[1].segment_id]
    fault = fault_of(lambda: fetch.piece(spec, lying))
    assert "not the promised chain link" in str(fault) and fault.corrupt_segment_id
    run_spec, span = span_spec(spec, (7,) * 8 + (1, 2, 3, 4))
    fault = fault_of(lambda: fetch.span(run_spec, span))
    assert "other tokens" in str(fault) and fault.corrupt_segment_id is None


def test_a_segment_of_another_shape_is_refused_before_a_value_is_written() -> None:
    store, spec = stored()
    fetch = SegmentFetch(FakeClients(store), (LAYERS, HEADS + 1, DIM))  # type: ignore[arg-type]
    fault = fault_of(lambda: fetch.piece(spec, spec.pieces[0]))
    assert "expected (3, 3, 4, 8)" in str(fault) and fault.corrupt_segment_id
    run_spec, span = span_spec(spec, (7,) * 8 + TOKENS[4:8])
    assert fault_of(lambda: fetch.span(run_spec, span)).corrupt_segment_id is None
