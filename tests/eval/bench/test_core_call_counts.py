"""The guard on `bench core`'s call: what one reuse call does, counted (never timed).

A reuse call of a stored 1,024-token context (tiny Llama, SDPA, int8 payload, an embedded
store) must make exactly its round trips to the store, one forward of the last token,
and no torch copy of the reused K/V beyond the splice's one write: a round trip, a
forward or a K/V copy added anywhere fails here, whatever the machine's load.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers.client import make_tiny_llama
from helpers.text import CharTokenizer

from kvsplice.client.execute.execution import GenerationConfig
from kvsplice.client.model.chat_prompt import ChatPrompt, ChatSpan
from kvsplice.client.model.models import LoadedModel, bundle_model
from kvsplice.client.reuse_engine import EngineConfig, ReuseEngine
from kvsplice.client.store.store_client import StoreClient
from kvsplice.client.store.store_config import StoreClientConfig
from kvsplice.eval.measure.call_counts import CallCounts, count_call
from kvsplice.server.embedded import EmbeddedStore, loopback_config

NUM_TOKENS = 1024
FIRST_TOKEN = GenerationConfig(max_new_tokens=1, ignore_stop=True)
# No background reuse report inside a counted call: its RPC would be another thread's.
QUIET_CLIENT = StoreClientConfig(report_interval_s=3600.0)
# The splice writes the reused K/V once (numba, outside torch); a torch copy of them (a
# clone, the cache concatenated with the new token, a cast) writes as much again; the
# forward's own activations (a few tokens through a tiny model) stay under a tenth.
MAX_TORCH_WRITTEN_FRACTION = 0.25


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    model = make_tiny_llama(num_layers=4, attn_implementation="sdpa")
    return bundle_model(model, CharTokenizer())


@pytest.fixture()
def target(tmp_path: object) -> Iterator[str]:
    with EmbeddedStore(loopback_config(f"{tmp_path}/lmdb")) as store:
        yield store.target


def make_prompt(*parts: list[int]) -> ChatPrompt:
    spans, start = [], 0
    for index, part in enumerate(parts):
        spans.append(ChatSpan("text", f"text_{index}", start, start + len(part)))
        start += len(part)
    return ChatPrompt(tuple(t for part in parts for t in part), tuple(spans))


def context_ids(num_tokens: int, seed: int) -> list[int]:
    return [(seed * 31 + 7 * i) % 120 + 1 for i in range(num_tokens)]


def store_call(loaded: LoadedModel, target: str, namespace: str, prompt: ChatPrompt) -> None:
    """A dense call that stores `prompt`'s spans (int8), then closes its client."""
    config = EngineConfig(quant="int8", async_store=False, local_tier_bytes=0)
    with (
        StoreClient(target, namespace, config=QUIET_CLIENT) as client,
        ReuseEngine(loaded, "dense", client, config) as engine,
    ):
        engine.run(prompt, FIRST_TOKEN)


def counted_reuse_call(
    loaded: LoadedModel, target: str, namespace: str, mode: str, prompt: ChatPrompt
) -> CallCounts:
    """One `mode` call of `prompt` after a warm-up call, counted; it must reuse the stored
    `NUM_TOKENS`. The worker keeps no segment of its own (every read goes to the store)."""
    config = EngineConfig(quant="int8", store_segments=False, async_store=False, local_tier_bytes=0)
    with StoreClient(target, namespace, config=QUIET_CLIENT) as client:
        engine = ReuseEngine(loaded, mode, client, config)
        engine.run(prompt, FIRST_TOKEN)  # warm-up: the client asks once where to read
        outcome, counts = count_call(engine, lambda: engine.run(prompt, FIRST_TOKEN))
    assert outcome.num_reused_tokens == NUM_TOKENS
    return counts


def kv_nbytes(loaded: LoadedModel, num_tokens: int) -> int:
    layout = loaded.layout
    return 2 * 4 * layout.num_layers * layout.num_kv_heads * num_tokens * layout.head_dim


def test_the_bench_core_call_makes_three_round_trips_one_forward_and_no_kv_copy(
    loaded: LoadedModel, target: str
) -> None:
    """bench core's call: the context stored after 64 other tokens, reused at slot 0 (naive)."""
    context = context_ids(NUM_TOKENS, seed=1)
    store_call(loaded, target, "core", make_prompt(context_ids(64, seed=2), context, [0]))
    counts = counted_reuse_call(loaded, target, "core", "naive", make_prompt(context, [1]))
    assert counts.rpcs == {"LookupPrefix": 1, "FindSimilar": 1, "GetSegment": 1}
    assert (counts.num_forwards, counts.num_forwarded_tokens) == (1, 1)
    limit = MAX_TORCH_WRITTEN_FRACTION * kv_nbytes(loaded, NUM_TOKENS)
    assert counts.torch_written_nbytes < limit, counts


def test_an_exact_call_makes_one_lookup_one_read_per_segment_and_one_forward(
    loaded: LoadedModel, target: str
) -> None:
    """The exact chain: two stored segments from position 0, then a 3-token tail computed."""
    first, second = context_ids(NUM_TOKENS // 2, seed=3), context_ids(NUM_TOKENS // 2, seed=4)
    store_call(loaded, target, "exact", make_prompt(first, second, [5]))
    prompt = make_prompt(first, second, [6, 7, 8])
    counts = counted_reuse_call(loaded, target, "exact", "exact", prompt)
    assert counts.rpcs == {"LookupPrefix": 1, "GetSegment": 2}
    assert (counts.num_forwards, counts.num_forwarded_tokens) == (1, 3)
    limit = MAX_TORCH_WRITTEN_FRACTION * kv_nbytes(loaded, NUM_TOKENS)
    assert counts.torch_written_nbytes < limit, counts
