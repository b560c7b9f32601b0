"""Factories for client tests: a tiny random Llama over `helpers.text`'s character vocabulary."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from helpers.text import CharTokenizer
from kvsplice.client.model.models import LoadedModel, bundle_model
from kvsplice.client.modes.base import ReusePolicy
from kvsplice.client.reuse_engine import EngineConfig, ReuseEngine
from kvsplice.client.tiers.segment_io import SegmentWriter
from kvsplice.server.embedded import EmbeddedStore, loopback_config
from kvsplice.storeclient.client import StoreClient

VOCAB = 128  # characters < 126 and the two ChatML markers (`CharTokenizer()`)


def make_tiny_llama(
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    *,
    vocab_size: int = VOCAB,
    hidden_size: int = 64,
    num_layers: int = 2,
    max_positions: int = 4096,
) -> LlamaForCausalLM:
    """A random Llama (4 query / 2 KV heads: GQA, eager attention, eval) seeded by `seed`."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_positions, rope_theta=10000.0, attn_implementation="eager",
    )  # fmt: skip
    return LlamaForCausalLM(config).to(dtype).eval()


def make_loaded(seed: int = 0) -> LoadedModel:
    return bundle_model(make_tiny_llama(seed=seed), CharTokenizer())


@pytest.fixture(scope="module")
def store_target() -> Iterator[str]:
    """A module's embedded store (memory tier only), by its gRPC target."""
    with EmbeddedStore(loopback_config(None)) as store:
        yield store.target


def make_store_engine(
    loaded: LoadedModel, policy: ReusePolicy | str, target: str, namespace: str
) -> ReuseEngine:
    """An engine running `policy` against a new client of `namespace` at `target`
    (`engine.store`), storing unquantized K/V: exact reuse then matches dense to fp32.
    Its writer and client close once the test drops the engine."""
    client = StoreClient(target, namespace)
    engine = ReuseEngine(loaded, policy, client, EngineConfig(quant="none"))
    # NOTE: an engine dropped unclosed kept its client's reuse-report thread retrying the
    # module's store after it stopped, for the rest of the session (a flake's origin).
    weakref.finalize(engine, _close_engine_parts, engine.writer, client).atexit = False
    return engine


def _close_engine_parts(writer: SegmentWriter | None, client: StoreClient) -> None:
    if writer is not None:
        writer.close()
    client.close()


@contextmanager
def store_engine(
    loaded: LoadedModel, policy: ReusePolicy | str, target: str, namespace: str
) -> Iterator[ReuseEngine]:
    """`make_store_engine`'s engine; on exit the engine stores what it queued, then its
    client closes."""
    engine = make_store_engine(loaded, policy, target, namespace)
    assert engine.store is not None
    with engine.store, engine:
        yield engine
