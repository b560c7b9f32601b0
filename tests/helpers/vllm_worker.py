"""Fakes for the vLLM worker half's tests: a sidecar that keeps what was put, a synthetic
CPU block layout (a fixed permutation of each block's slots) and small specs over it."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvsplice.common.keys import chunk_links
from kvsplice.integrations.vllm.anchor_loads import AnchorGate
from kvsplice.integrations.vllm.block_layout import BlockLayout, CpuBlockLayout
from kvsplice.integrations.vllm.sidecar_faults import FaultLog
from kvsplice.integrations.vllm.transfer_specs import LoadSpec, SaveSpec, StoredPiece
from kvsplice.integrations.vllm.worker_side import WorkerSide

FINGERPRINT = "kvfp1-" + "ab" * 16
BLOCK, HEADS, DIM, LAYERS, NUM_BLOCKS = 4, 2, 8, 3, 16
NS = "ns"


class FakeStore:
    def __init__(self) -> None:
        self.segments: dict[str, tuple[object, bytes]] = {}
        self.gone: set[str] = set()
        self.corrupt: set[str] = set()
        self.deleted: list[str] = []
        self.reported: list[tuple[int, tuple]] = []
        self.counters = SimpleNamespace(num_corrupt_payloads=0, num_degraded_calls=0)

    def put_segment(self, meta: object, payload: bytes, session_id: str = "") -> bool:
        self.segments.setdefault(meta.segment_id, (meta, payload))  # type: ignore[attr-defined]
        return True

    def get_segment(self, segment_id: str, *, model_fingerprint: str) -> tuple | None:
        if segment_id in self.corrupt:
            self.counters.num_corrupt_payloads += 1
            return None
        if segment_id in self.gone:
            return None
        return self.segments.get(segment_id)

    def delete(self, segment_id: str) -> bool:
        self.deleted.append(segment_id)
        return self.segments.pop(segment_id, None) is not None

    def report_reuse(self, num_prompt_tokens: int, runs: object = ()) -> None:
        self.reported.append((num_prompt_tokens, tuple(runs)))  # type: ignore[call-overload]

    def served_from(self, key: bytes) -> str:
        return "grpc"


class FakeClients:
    def __init__(self, store: FakeStore) -> None:
        self.store = store

    def for_namespace(self, namespace: str) -> FakeStore:
        return self.store


def synthetic_layout() -> CpuBlockLayout:
    # one (block) slab: per head, K's [bs, D] then V's [bs, D]
    head, token, dim = torch.meshgrid(
        torch.arange(HEADS), torch.arange(BLOCK), torch.arange(DIM), indexing="ij"
    )
    k = head * 2 * BLOCK * DIM + token * DIM + dim
    return CpuBlockLayout(BLOCK, HEADS, DIM, k, k + BLOCK * DIM)


def make_worker(
    store: FakeStore, seed: int | None = 0, rope: object = None, *,
    layout: BlockLayout | None = None, negative_control: str | None = None,
    anchor_gate: AnchorGate | None = None,
) -> WorkerSide:  # fmt: skip
    shape = (NUM_BLOCKS, HEADS, BLOCK, 2 * DIM)
    gen = torch.Generator().manual_seed(seed or 0)
    caches = {
        f"model.layers.{i}.self_attn.attn": (
            torch.randn(shape, generator=gen) if seed is not None else torch.zeros(shape)
        )
        for i in range(LAYERS)
    }
    return WorkerSide(
        FakeClients(store),  # type: ignore[arg-type]
        FINGERPRINT,
        BLOCK,
        caches,
        layout or synthetic_layout(),
        "none",
        64,
        FaultLog(),
        rope=None if rope is None else (lambda: rope),  # type: ignore[arg-type,return-value]
        negative_control=negative_control,
        anchor_gate=anchor_gate,
    )


TOKENS = tuple(range(100, 120))  # 20 tokens: 5 chunks of one block


def save_spec(request_id: str, index: int, context: tuple[int, ...]) -> SaveSpec:
    link = chunk_links(FINGERPRINT, TOKENS, BLOCK)[index]
    return SaveSpec(
        request_id=request_id, namespace=NS, root=FINGERPRINT, start=link.start,
        token_ids=TOKENS[link.start : link.end], parent_key=link.parent_key, key=link.key,
        block_table=context, block_size=BLOCK, exact=True,
    )  # fmt: skip


def load_spec(block_ids: tuple[int, ...], num_chunks: int) -> LoadSpec:
    links = chunk_links(FINGERPRINT, TOKENS, BLOCK)[:num_chunks]
    pieces = tuple(
        StoredPiece(ln.key.hex(), ln.start, ln.num_tokens, ln.parent_key) for ln in links
    )
    end = num_chunks * BLOCK
    return LoadSpec("r", NS, FINGERPRINT, 0, end, block_ids[:num_chunks], TOKENS[:end], pieces)


def store_three_chunks(store: FakeStore) -> WorkerSide:
    writer = make_worker(store, seed=1)
    for i in range(3):
        writer.save(save_spec("w", i, (0, 1, 2)), 0)
    assert writer.putter.flush()
    assert len(writer.take_news(0).acked) == 3
    return writer
