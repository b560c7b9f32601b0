"""The worker half without vLLM: loads, saves and what it tells the scheduler after a fault.

A synthetic CPU block layout (a fixed permutation of each block's slots) stands in for
the engine's; the engine tests run vLLM's own. The fake sidecar keeps what was put.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch
from helpers.vllm_worker import (
    BLOCK,
    DIM,
    FINGERPRINT,
    HEADS,
    LAYERS,
    NS,
    NUM_BLOCKS,
    TOKENS,
    FakeClients,
    FakeStore,
    load_spec,
    make_worker,
    save_spec,
    store_three_chunks,
    synthetic_layout,
)

from kvsplice.common.keys import chunk_links
from kvsplice.integrations.vllm.block_layout import CpuBlockLayout, UnsupportedLayout
from kvsplice.integrations.vllm.sidecar_faults import FaultLog
from kvsplice.integrations.vllm.transfer_specs import LoadSpec, StoredPiece
from kvsplice.integrations.vllm.worker_side import WorkerSide


def test_an_off_chain_chunk_is_stored_as_not_exact() -> None:
    """Its meta says so: `kvsplice ls` marks it off-chain."""
    store = FakeStore()
    writer = make_worker(store, seed=1)
    writer.save(replace(save_spec("w", 0, (0, 1, 2)), exact=False), 0)
    writer.save(save_spec("w", 1, (0, 1, 2)), 0)
    assert writer.putter.flush()
    assert sorted(meta.exact for meta, _ in store.segments.values()) == [False, True]


def test_a_load_writes_the_stored_blocks_bit_exact() -> None:
    store = FakeStore()
    writer = store_three_chunks(store)
    reader = make_worker(store, seed=None)
    assert reader.load(load_spec((5, 9, 4), 3)) == set()
    for mine, theirs in zip(reader.paged.caches, writer.paged.caches, strict=True):
        assert torch.equal(mine[[5, 9, 4]], theirs[[0, 1, 2]])


def test_a_layout_that_is_not_affine_loads_and_saves_bit_exact_too() -> None:
    # a fixed shuffle of each block's slots: no strided view can express it
    shuffled = torch.randperm(2 * HEADS * BLOCK * DIM, generator=torch.Generator().manual_seed(3))
    k = shuffled[: HEADS * BLOCK * DIM].view(HEADS, BLOCK, DIM)
    v = shuffled[HEADS * BLOCK * DIM :].view(HEADS, BLOCK, DIM)
    layout = CpuBlockLayout(BLOCK, HEADS, DIM, k, v)
    assert layout._affine_offsets == (None, None)
    store = FakeStore()
    writer = make_worker(store, seed=1, layout=layout)
    reader = make_worker(store, seed=None, layout=layout)
    for i in range(3):
        writer.save(save_spec("w", i, (0, 1, 2)), 0)
    assert writer.putter.flush() and len(writer.take_news(0).acked) == 3
    assert reader.load(load_spec((5, 9, 4), 3)) == set()
    for mine, theirs in zip(reader.paged.caches, writer.paged.caches, strict=True):
        assert torch.equal(mine[[5, 9, 4]], theirs[[0, 1, 2]])


def test_async_loads_report_each_request_once_with_the_blocks_they_could_not_write() -> None:
    store = FakeStore()
    store_three_chunks(store)
    reader = make_worker(store, seed=None)
    store.gone.add(chunk_links(FINGERPRINT, TOKENS, BLOCK)[2].key.hex())
    reader.async_loads.submit(replace(load_spec((5, 9, 4), 2), request_id="ok"))
    reader.async_loads.submit(replace(load_spec((6, 8, 10), 3), request_id="short"))
    finished: set[str] = set()
    failed: set[int] = set()
    deadline = time.monotonic() + 10
    while len(finished) < 2 and time.monotonic() < deadline:
        done, bad = reader.async_loads.take_finished()
        finished |= done
        failed |= bad
        time.sleep(0.01)
    assert finished == {"ok", "short"} and failed == {10}
    assert reader.async_loads.take_finished() == (set(), set())  # reported once
    assert [f.request_id for f in reader.take_news(0).faults] == ["short"]


def test_a_load_fault_withholds_every_save_computed_over_it_until_the_scheduler_knows() -> None:
    store = FakeStore()
    store_three_chunks(store)
    reader = make_worker(store, seed=None)
    second = chunk_links(FINGERPRINT, TOKENS, BLOCK)[1].key.hex()
    store.gone.add(second)  # evicted between lookup and load
    blocks = (5, 9, 4, 7, 8)
    assert reader.load(load_spec(blocks, 3)) == {9, 4}
    # the same step computed chunks 3 and 4 over the unloaded blocks: none is stored
    reader.save(save_spec("r", 3, blocks), num_faults_seen=0)
    reader.save(save_spec("r", 4, blocks), num_faults_seen=0)
    reader.save(save_spec("other", 0, (11,)), num_faults_seen=0)  # untouched: stored
    assert reader.putter.flush()
    news = reader.take_news(num_faults_seen=0)
    assert [(f.request_id, f.position, f.corrupt_segment_id) for f in news.faults] == [
        ("r", 4, None)
    ]
    assert len(news.failed) == 2 and len(news.acked) == 1
    assert reader.num_withheld_saves == 2 and store.deleted == []
    assert (reader.num_failed_loads, reader.num_missing_loads, reader.num_corrupt_loads) == (
        1,
        1,
        0,
    )
    # planned after the scheduler absorbed the fault (vLLM recomputed the blocks): stored
    reader.take_news(num_faults_seen=1)
    reader.save(save_spec("r", 3, blocks), num_faults_seen=1)
    assert reader.putter.flush() and len(reader.take_news(1).acked) == 1


def test_a_corrupt_piece_is_reported_as_such_and_deleted() -> None:
    store = FakeStore()
    store_three_chunks(store)
    reader = make_worker(store, seed=None)
    first = chunk_links(FINGERPRINT, TOKENS, BLOCK)[0].key.hex()
    store.corrupt.add(first)
    assert reader.load(load_spec((5, 9, 4), 3)) == {5, 9, 4}
    (fault,) = reader.take_news(0).faults
    assert (fault.position, fault.corrupt_segment_id) == (0, first)
    assert store.deleted == [first]
    assert (reader.num_failed_loads, reader.num_missing_loads, reader.num_corrupt_loads) == (
        1,
        0,
        1,
    )


def test_a_piece_that_is_not_the_promised_link_is_corrupt() -> None:
    store = FakeStore()
    store_three_chunks(store)
    links = chunk_links(FINGERPRINT, TOKENS, BLOCK)
    # the second key now holds the third chunk's segment: a chain link that lies
    store.segments[links[1].key.hex()] = store.segments[links[2].key.hex()]
    reader = make_worker(store, seed=None)
    assert reader.load(load_spec((5, 9, 4), 3)) == {9, 4}
    assert reader.take_news(0).faults[0].corrupt_segment_id == links[1].key.hex()


def test_a_failing_copy_out_is_a_failed_save_never_an_exception() -> None:
    store = FakeStore()
    worker = make_worker(store)
    worker.save(save_spec("r", 0, (NUM_BLOCKS + 5,)), 0)  # a block id past the cache
    news = worker.take_news(0)
    assert len(news.failed) == 1 and worker.faults.counts


def test_layers_of_different_shapes_are_refused_at_start() -> None:
    caches = {
        "model.layers.0.self_attn.attn": torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * DIM),
        "model.layers.1.self_attn.attn": torch.zeros(NUM_BLOCKS, 1, BLOCK, 2 * DIM),
    }
    with pytest.raises(UnsupportedLayout, match="different KV cache shapes"):
        WorkerSide(
            FakeClients(FakeStore()),
            FINGERPRINT,
            BLOCK,
            caches,
            synthetic_layout(),
            "none",
            4,
            FaultLog(),
        )  # type: ignore[arg-type]


def test_a_refused_put_is_said_once_by_kind_and_counted_as_not_stored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from kvsplice.common.errors import PermissionDenied

    store = FakeStore()

    def refuse(meta: object, payload: bytes, session_id: str = "") -> bool:
        raise PermissionDenied("this token's tenant may not do this in the namespace")

    store.put_segment = refuse  # type: ignore[method-assign]
    worker = make_worker(store)
    for i in range(3):
        worker.save(save_spec("r", i, (0, 1, 2)), 0)
    assert worker.putter.flush()
    assert len(worker.take_news(0).failed) == 3
    refusals = [r for r in caplog.records if "put refused (PermissionDenied)" in r.getMessage()]
    assert len(refusals) == 1 and worker.faults.counts["put refused (PermissionDenied)"] == 3


def test_approximate_runs_land_moved_to_their_new_positions() -> None:
    """Chunks 1 and 2 (tokens 4..12, computed at positions 4..12) loaded as positions 8..16
    of another request: values bit-exact, keys the stored ones moved by Δ = +4 (RoPE)."""
    from kvsplice.integrations.vllm.span_cover import ReusedSpan
    from kvsplice.kvmath.rope import RopeSpec

    store = FakeStore()
    writer = store_three_chunks(store)
    rope = RopeSpec.uniform(DIM, 10_000.0, LAYERS)
    reader = make_worker(store, seed=None, rope=rope)
    links = chunk_links(FINGERPRINT, TOKENS, BLOCK)
    tokens = (7,) * 8 + TOKENS[4:12]
    spans = (
        ReusedSpan(links[1].key.hex(), 8, 4, 0, 4),
        ReusedSpan(links[2].key.hex(), 12, 4, 0, 8),
    )
    spec = LoadSpec("r", NS, FINGERPRINT, 8, 16, (5, 6), tokens, (), spans=spans)
    assert reader.load(spec) == set()
    layout = synthetic_layout()
    theirs_k = torch.stack([layout.gather(c, torch.tensor([1, 2]))[0] for c in writer.paged.caches])
    theirs_v = torch.stack([layout.gather(c, torch.tensor([1, 2]))[1] for c in writer.paged.caches])
    mine_k = torch.stack([layout.gather(c, torch.tensor([5, 6]))[0] for c in reader.paged.caches])
    mine_v = torch.stack([layout.gather(c, torch.tensor([5, 6]))[1] for c in reader.paged.caches])
    assert torch.equal(mine_v, theirs_v)
    assert torch.allclose(mine_k, rope.shift_layers(theirs_k, 4), atol=1e-6)
    assert not torch.allclose(mine_k, theirs_k)  # moved, not copied


def test_the_report_names_each_segment_read_and_sets_approximate_tokens_apart() -> None:
    """An exact piece, then another chunk's tokens moved there: both reads of their segments
    (the sidecar's dashboard counts them), the moved run reported approximate."""
    from kvsplice.common.reuse_report import ReusedRun
    from kvsplice.integrations.vllm.span_cover import ReusedSpan
    from kvsplice.integrations.vllm.transfer_specs import RequestStart
    from kvsplice.kvmath.rope import RopeSpec

    store = FakeStore()
    store_three_chunks(store)
    reader = make_worker(store, seed=None, rope=RopeSpec.uniform(DIM, 10_000.0, LAYERS))
    links = chunk_links(FINGERPRINT, TOKENS, BLOCK)
    piece = StoredPiece(links[0].key.hex(), 0, 4, links[0].parent_key)
    span = ReusedSpan(links[2].key.hex(), 4, 4, 0, 8)  # chunk 2 (positions 8..12) at 4..8
    tokens = TOKENS[0:4] + TOKENS[8:12]
    spec = LoadSpec("r", NS, FINGERPRINT, 0, 8, (5, 6), tokens, (piece,), spans=(span,))
    assert reader.load(spec) == set()
    reader.report(RequestStart("r", NS, 10))
    exact, moved = ReusedRun(4, "grpc", links[0].key), ReusedRun(4, "grpc", links[2].key, False)
    assert store.reported == [(10, (exact, moved))]


def test_an_approximate_run_over_other_tokens_is_refused_and_recomputed() -> None:
    from kvsplice.integrations.vllm.span_cover import ReusedSpan

    store = FakeStore()
    store_three_chunks(store)
    reader = make_worker(store, seed=None)
    links = chunk_links(FINGERPRINT, TOKENS, BLOCK)
    tokens = (7,) * 8 + (1, 2, 3, 4)  # not the segment's tokens
    spans = (ReusedSpan(links[1].key.hex(), 8, 4, 0, 4),)
    spec = LoadSpec("r", NS, FINGERPRINT, 8, 12, (5,), tokens, (), spans=spans)
    assert reader.load(spec) == {5}
    assert torch.equal(reader.paged.caches[0][5], torch.zeros_like(reader.paged.caches[0][5]))


@pytest.mark.gpu
def test_approximate_runs_land_moved_in_a_cuda_cache() -> None:
    """The same load into a CUDA cache in vLLM 0.32's flash layout: keys rotated on the GPU
    equal the CPU rotation of the stored keys; values bit-exact."""
    from kvsplice.integrations.vllm.block_layout import FlashBlockLayout
    from kvsplice.integrations.vllm.span_cover import ReusedSpan
    from kvsplice.kvmath.rope import RopeSpec

    store = FakeStore()
    writer = store_three_chunks(store)
    rope = RopeSpec.uniform(DIM, 10_000.0, LAYERS)
    flash = FlashBlockLayout(block_size=BLOCK, num_kv_heads=HEADS, head_dim=DIM)
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.zeros(
            NUM_BLOCKS, HEADS, BLOCK, 2 * DIM, device="cuda"
        )
        for i in range(LAYERS)
    }
    reader = WorkerSide(
        FakeClients(store),
        FINGERPRINT,
        BLOCK,
        caches,
        flash,
        "none",
        64,
        FaultLog(),
        rope=lambda: rope,
    )  # type: ignore[arg-type]
    links = chunk_links(FINGERPRINT, TOKENS, BLOCK)
    spans = (
        ReusedSpan(links[1].key.hex(), 8, 4, 0, 4),
        ReusedSpan(links[2].key.hex(), 12, 4, 0, 8),
    )
    spec = LoadSpec("r", NS, FINGERPRINT, 8, 16, (5, 6), (7,) * 8 + TOKENS[4:12], (), spans=spans)
    assert reader.load(spec) == set()
    cpu = synthetic_layout()
    theirs = [cpu.gather(c, torch.tensor([1, 2])) for c in writer.paged.caches]
    mine = [flash.gather(c, torch.tensor([5, 6])) for c in reader.paged.caches]
    theirs_k = torch.stack([k for k, _ in theirs])
    assert torch.equal(torch.stack([v for _, v in mine]).cpu(), torch.stack([v for _, v in theirs]))
    moved = torch.stack([k for k, _ in mine]).cpu()
    assert torch.allclose(moved, rope.shift_layers(theirs_k, 4), atol=1e-5)


def _load_moved_run(control: str | None) -> tuple[torch.Tensor, torch.Tensor, object, WorkerSide]:
    """Chunk 1 (positions 4..8) loaded as positions 8..12 of another request under `control`:
    the stored keys and values, the rope, and the reader."""
    from kvsplice.integrations.vllm.span_cover import ReusedSpan
    from kvsplice.kvmath.rope import RopeSpec

    store = FakeStore()
    writer = store_three_chunks(store)
    rope = RopeSpec.uniform(DIM, 10_000.0, LAYERS)
    reader = make_worker(store, seed=None, rope=rope, negative_control=control)
    links = chunk_links(FINGERPRINT, TOKENS, BLOCK)
    spans = (ReusedSpan(links[1].key.hex(), 8, 4, 0, 4),)
    spec = LoadSpec("r", NS, FINGERPRINT, 8, 12, (5,), (7,) * 8 + TOKENS[4:8], (), spans=spans)
    assert reader.load(spec) == set()
    layout = synthetic_layout()
    stored = [layout.gather(c, torch.tensor([1])) for c in writer.paged.caches]
    return torch.stack([k for k, _ in stored]), torch.stack([v for _, v in stored]), rope, reader


def _written(reader: WorkerSide) -> tuple[torch.Tensor, torch.Tensor]:
    layout = synthetic_layout()
    got = [layout.gather(c, torch.tensor([5])) for c in reader.paged.caches]
    return torch.stack([k for k, _ in got]), torch.stack([v for _, v in got])


def test_the_unrotated_control_writes_the_stored_keys_where_naive_moves_them() -> None:
    """The negative control keeps every token right and only leaves the keys unmoved."""
    keys, values, rope, reader = _load_moved_run("unrotated")
    mine_k, mine_v = _written(reader)
    assert torch.equal(mine_v, values) and torch.equal(mine_k, keys)
    assert not torch.allclose(mine_k, rope.shift_layers(keys, 4), atol=1e-3)  # type: ignore[attr-defined]


def test_the_noise_control_adds_a_fixed_fraction_of_each_layers_norm_the_same_each_time() -> None:
    from kvsplice.integrations.vllm.negative_controls import NOISE_FRACTION

    keys, values, rope, reader = _load_moved_run("noise")
    mine_k, mine_v = _written(reader)
    moved = rope.shift_layers(keys, 4)  # type: ignore[attr-defined]
    for layer in range(LAYERS):
        for theirs, mine in ((moved[layer], mine_k[layer]), (values[layer], mine_v[layer])):
            relative = (mine - theirs).pow(2).mean().sqrt() / theirs.pow(2).mean().sqrt()
            assert 0.5 * NOISE_FRACTION < float(relative) < 1.6 * NOISE_FRACTION
    again_k, again_v = _written(_load_moved_run("noise")[3])
    assert torch.equal(again_k, mine_k) and torch.equal(again_v, mine_v)  # seeded by the span
    naive_k, naive_v = _written(_load_moved_run(None)[3])
    assert torch.equal(naive_v, values) and torch.allclose(naive_k, moved, atol=1e-6)


@pytest.mark.parametrize("checked_whole", [True, False], ids=["as-promised", "cut-at-the-end"])
def test_a_promise_ending_inside_a_piece_loads_it_and_deletes_nothing(
    checked_whole: bool,
) -> None:
    """The piece [0, 8) promised to token 4 loads its first block; the load cut at the
    promise's end (the negative control: the bug) blames a good segment and deletes it."""
    store = FakeStore()
    writer = make_worker(store, seed=1)
    link = chunk_links(FINGERPRINT, TOKENS, 2 * BLOCK)[0]
    saved = replace(save_spec("w", 0, (0, 1)), token_ids=TOKENS[:8], key=link.key)
    writer.save(saved, 0)
    assert writer.putter.flush()
    reader = make_worker(store, seed=None)
    piece = StoredPiece(link.key.hex(), 0, 8, link.parent_key)
    tokens = TOKENS[:8] if checked_whole else TOKENS[:4]
    failed = reader.load(LoadSpec("r", NS, FINGERPRINT, 0, 4, (5,), tokens, (piece,)))
    if checked_whole:
        assert failed == set() and store.deleted == []
        for mine, theirs in zip(reader.paged.caches, writer.paged.caches, strict=True):
            assert torch.equal(mine[5], theirs[0])
    else:
        assert failed == {5} and store.deleted == [link.key.hex()]
