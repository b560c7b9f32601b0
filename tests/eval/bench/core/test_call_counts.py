"""The guard of `bench core`: what one reuse call does, counted, never timed.

The counts are exact and hold on a loaded machine: a round trip to the sidecar, a model forward
or a payload copy added to the call fails these tests, and so does an allocation the size of
the K/V (a fresh cache buffer per call, a copy of the cache per forward): the bytes torch
allocates are bounded, not the page faults, which glibc's thresholds make erratic. Each
negative control adds one on purpose and shows the count moving (so the guard can fail)."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from transformers.cache_utils import DynamicLayer

from kvsplice.client.model.hf_cache import truncate
from kvsplice.client.model.kv_buffer_pool import KVBufferPool
from kvsplice.client.model.models import LoadedModel, ModelConfig, load_model_cached
from kvsplice.client.model.spare_slots_cache import SpareSlotsLayer
from kvsplice.client.reuse_engine import EngineConfig, ReuseEngine
from kvsplice.eval.bench.core import bench as core
from kvsplice.eval.bench.core.counts import CallCounts
from kvsplice.server.sidecar_process import SidecarProcess
from kvsplice.storeclient.client import StoreClient
from kvsplice.storeclient.config import StoreClientConfig

pytestmark = pytest.mark.slow

NUM_TOKENS = 256  # the K/V (11.8 MB) dwarfs a one-token forward's own allocations (2.3 MB)
NAMESPACE = "core-counts"
EXPECTED = {  # what the calls do as shipped: one lookup per reusable span, reads in place
    "naive": CallCounts({"FindSimilar": 1, "LookupPrefix": 1}, 1, 1, 0),
    # the exact prefix the warm-up read stays in the worker's local tier: no read at all
    "exact": CallCounts({"LookupPrefix": 1}, 1, 0, 0),
}


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model_cached(ModelConfig())


@pytest.fixture(scope="module")
def sidecar(
    smollm2: LoadedModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SidecarProcess]:
    """A sidecar holding the context as `bench core` stores it (once: each test's engine,
    and so its local tier, is its own)."""
    with core._sidecar(str(tmp_path_factory.mktemp("core-counts"))) as running:
        core._store_context(smollm2, StoreClient(running.target, NAMESPACE), NUM_TOKENS)
        yield running


def _counts(
    loaded: LoadedModel,
    sidecar: SidecarProcess,
    mode: str,
    store_config: StoreClientConfig | None = None,
) -> CallCounts:
    """Warm a fresh engine's call once, then count one call."""
    store = StoreClient(sidecar.target, NAMESPACE, config=store_config)
    config = EngineConfig(quant="int8", store_segments=False, async_store=False)
    with ReuseEngine(loaded, mode, store, config) as engine:
        # exact reuses a stored prefix: the context as stored, after the tokens before it
        before = core.make_token_ids(core.CAPTURE_POSITION, core._vocab_size(loaded), seed=1)
        parts = (before,) if mode == "exact" else ()
        prompt = core._prompt(*parts, core._context(loaded, NUM_TOKENS), [1])
        engine.run(prompt, core.FIRST_TOKEN)  # warm-up: the data plane asked, the model warm
        return core.reuse_call_counts(engine, prompt, sidecar)


def _prompt_len(loaded: LoadedModel, mode: str) -> int:
    return NUM_TOKENS + 1 + (core.CAPTURE_POSITION if mode == "exact" else 0)


def _kv_bound(loaded: LoadedModel, mode: str) -> int:
    """Half the bytes of the K/V the call's cache holds: what one call may allocate."""
    layout = loaded.layout
    per_token = 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim
    return per_token * (_prompt_len(loaded, mode) - 1) * loaded.model.dtype.itemsize // 2


@pytest.fixture(scope="module")
def shipped(smollm2: LoadedModel, sidecar: SidecarProcess) -> dict[str, CallCounts]:
    return {mode: _counts(smollm2, sidecar, mode) for mode in EXPECTED}


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_the_reuse_call_does_what_it_did(shipped: dict[str, CallCounts], mode: str) -> None:
    assert shipped[mode] == EXPECTED[mode]


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_the_reuse_call_allocates_no_kv_sized_buffer(
    smollm2: LoadedModel, shipped: dict[str, CallCounts], mode: str
) -> None:
    """The cache comes from the executor's pool and the forward extends it in place."""
    assert 0 < shipped[mode].allocated_bytes < _kv_bound(smollm2, mode)


def test_a_fresh_kv_buffer_per_call_is_counted(
    smollm2: LoadedModel, sidecar: SidecarProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    no_pool = functools.partialmethod(KVBufferPool.__init__, max_buffers=0)
    monkeypatch.setattr(KVBufferPool, "__init__", no_pool)
    counts = _counts(smollm2, sidecar, "naive")
    assert counts == EXPECTED["naive"]  # the same work, only allocated afresh
    assert counts.allocated_bytes > _kv_bound(smollm2, "naive")


def test_a_copy_of_the_cache_per_forward_is_counted(
    smollm2: LoadedModel, sidecar: SidecarProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(SpareSlotsLayer, "update", DynamicLayer.update)  # torch.cat per update
    counts = _counts(smollm2, sidecar, "naive")
    assert counts == EXPECTED["naive"]
    assert counts.allocated_bytes > _kv_bound(smollm2, "naive")


def test_an_added_round_trip_is_counted(
    smollm2: LoadedModel, sidecar: SidecarProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    find_similar = StoreClient.find_similar

    def twice(self: StoreClient, *args: object, **kwargs: object) -> object:
        find_similar(self, *args, **kwargs)  # type: ignore[arg-type]
        return find_similar(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(StoreClient, "find_similar", twice)
    counts = _counts(smollm2, sidecar, "naive")
    assert counts.rpcs == {"FindSimilar": 2, "LookupPrefix": 1}
    assert counts != EXPECTED["naive"]


def test_an_added_forward_is_counted(
    smollm2: LoadedModel, sidecar: SidecarProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvsplice.client.execute.call_executor import CallExecutor

    forward = CallExecutor.forward

    def twice(self: CallExecutor, token_ids, start, cache):  # type: ignore[no-untyped-def]
        forward(self, token_ids, start, cache)
        truncate(cache, start)
        return forward(self, token_ids, start, cache)

    monkeypatch.setattr(CallExecutor, "forward", twice)
    counts = _counts(smollm2, sidecar, "naive")
    assert counts == replace(EXPECTED["naive"], forwards=2)


def test_a_payload_copy_is_counted(smollm2: LoadedModel, sidecar: SidecarProcess) -> None:
    """Reads over gRPC (same-host reads off) assemble the payload: one copy per read."""
    over_grpc = StoreClientConfig(same_host_reads=False)
    counts = _counts(smollm2, sidecar, "naive", store_config=over_grpc)
    assert counts.payload_copies == 1
    assert counts.rpcs == {"FindSimilar": 1, "GetSegment": 1, "LookupPrefix": 1}
    assert counts != EXPECTED["naive"]


def test_counts_reach_the_json(tmp_path: Path) -> None:
    """`bench core --json` carries the counts and the stages beside the times."""
    counts = EXPECTED["naive"]
    row = core.CoreBenchRow(
        1024, 1, 10, 20, 2.0, 0.05, 0.01, 0.02, 0.01, 0.04, {"lookup_s": 0.001}, counts
    )
    written = core.core_bench_to_json([row])["rows"][0]
    assert written["counts"] == counts.to_dict() | {"payload_copies": 0, "page_faults": 0}
    assert written["stages_s"] == {"lookup_s": 0.001}
    assert written["ceiling_speedup_vs_dense"] == pytest.approx(50.0)
