"""The approximate span search against a real embedded sidecar reads no payload: the
candidates' tokens come with FindSimilar; the load then fetches exactly the promised runs.

Stored elsewhere (off any chain of the prompt): run A (exact, computed at 40), run B (not
exact, at 0), and C (layers from 1: skipped). The prompt is A, B, C and one more token.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvsplice.common.keys import off_chain_key, root_key
from kvsplice.common.segment import SegmentMeta, chained_meta
from kvsplice.integrations.vllm.lookups import LookupQuery
from kvsplice.integrations.vllm.segment_fetch import SegmentFetch
from kvsplice.integrations.vllm.sidecar_faults import FaultLog
from kvsplice.integrations.vllm.span_cover import ReusedSpan
from kvsplice.integrations.vllm.store_lookup import StoreLookup
from kvsplice.integrations.vllm.transfer_specs import LoadSpec
from kvsplice.kvmath.payload import encode_payload
from kvsplice.kvmath.segment_kv import SegmentKV
from kvsplice.server.embedded import EmbeddedStore, loopback_config
from kvsplice.storeclient.client import StoreClient

FINGERPRINT = "kvfp1-" + "5e" * 16
NAMESPACE = "ns"
BLOCK, CHUNK, LAYERS, HEADS, DIM = 4, 16, 2, 2, 8
RUN_A, RUN_B, RUN_C = list(range(1000, 1016)), list(range(2000, 2016)), list(range(3000, 3016))
PROMPT = [*RUN_A, *RUN_B, *RUN_C, 5]  # no exact prefix: the runs start at 0


class CountingClient(StoreClient):
    """A real client that lists every segment it fetched (in place or over gRPC)."""

    fetched: list[str]

    def get_segment(self, segment_id_or_context_key, *, model_fingerprint=None):  # type: ignore[no-untyped-def,override]
        self.fetched.append(str(segment_id_or_context_key))
        return super().get_segment(segment_id_or_context_key, model_fingerprint=model_fingerprint)


def stored(tokens: list[int], position: int, layer_start: int, exact: bool) -> tuple:
    num_layers = LAYERS - layer_start
    shape = (num_layers, HEADS, len(tokens), DIM)
    kv = SegmentKV(torch.randn(shape), torch.randn(shape), position, layer_start)
    payload = encode_payload(kv, model_fingerprint=FINGERPRINT, quant="none")
    parent = off_chain_key(root_key(FINGERPRINT))
    meta = chained_meta(NAMESPACE, FINGERPRINT, parent, tokens, position, LAYERS, exact=exact)
    return replace(meta, layer_start=layer_start), payload


@pytest.fixture
def client(tmp_path: Path) -> Iterator[CountingClient]:
    sidecar = EmbeddedStore(loopback_config(str(tmp_path / "db")))
    with sidecar, CountingClient(sidecar.target, NAMESPACE) as store_client:
        store_client.fetched = []
        yield store_client


def put_runs(client: CountingClient) -> dict[str, SegmentMeta]:
    runs = {"A": (RUN_A, 40, 0, True), "B": (RUN_B, 0, 0, False), "C": (RUN_C, 8, 1, True)}
    metas = {}
    for name, (tokens, position, layer_start, exact) in runs.items():
        meta, payload = stored(tokens, position, layer_start, exact)
        assert client.put_segment(meta, payload)
        metas[name] = meta
    return metas


def search(
    client: CountingClient, exact_bases: bool = False, faults: FaultLog | None = None
) -> tuple[ReusedSpan, ...]:
    clients = SimpleNamespace(for_namespace=lambda namespace: client)
    lookup = StoreLookup(clients, block_size=BLOCK, chunk_tokens=CHUNK, timeout_s=20.0,  # type: ignore[arg-type]
                         faults=faults or FaultLog())  # fmt: skip
    query = LookupQuery(NAMESPACE, FINGERPRINT, len(PROMPT), True, exact_bases)
    found = lookup(query, PROMPT)
    assert found.exact.num_matched_tokens == 0
    return found.spans


def test_the_search_fetches_no_segment_and_the_load_fetches_exactly_the_runs(
    client: CountingClient,
) -> None:
    metas = put_runs(client)
    spans = search(client)
    a, b = metas["A"].segment_id, metas["B"].segment_id
    assert [(s.segment_id, s.start, s.end, s.source_position) for s in spans] == [
        (a, 0, 16, 40), (b, 16, 32, 0),
    ]  # fmt: skip  # C (layers from 1) is not a run
    assert client.fetched == []  # no payload read to find them
    assert [s.segment_id for s in search(client, exact_bases=True)] == [a]  # B is not exact
    assert client.fetched == []
    spec = LoadSpec("r", NAMESPACE, FINGERPRINT, 0, 32, tuple(range(8)), tuple(PROMPT[:32]), (),
                    spans=spans)  # fmt: skip
    fetch = SegmentFetch(SimpleNamespace(for_namespace=lambda ns: client), (LAYERS, HEADS, DIM))  # type: ignore[arg-type]
    loaded = [fetch.span(spec, span) for span in spans]
    assert [kv.start_position for kv in loaded] == [40, 0]
    assert client.fetched == [a, b]  # each promised run once, at load


def test_a_sidecar_older_than_the_tokens_finds_no_runs_and_says_so(
    client: CountingClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    put_runs(client)
    asked = StoreClient.find_similar

    def older(self: StoreClient, *args: object, with_token_ids: bool = False, **kwargs: object):  # type: ignore[no-untyped-def]
        return asked(self, *args, **kwargs)  # type: ignore[arg-type]  # the field unread

    monkeypatch.setattr(StoreClient, "find_similar", older)
    faults = FaultLog()
    assert search(client, faults=faults) == ()
    assert faults.counts["approximate candidates came without their tokens"] >= 1
    assert client.fetched == []
