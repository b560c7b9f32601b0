"""The worker's local tier: byte bound, chain walk, TTL, and what the sidecar's index overrides."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from helpers.client import make_loaded, store_engine
from helpers.client import store_target as store_target  # fixture
from helpers.kv import random_segment
from helpers.store import make_meta
from helpers.text import FakePrompt, make_prompt

from kvsplice.client.execute.execution import GenerationConfig
from kvsplice.client.model.models import LoadedModel
from kvsplice.client.reuse_engine import CallOutcome, ReuseEngine
from kvsplice.client.tiers.local_tier import LocalTier
from kvsplice.common.segment import SegmentMeta
from kvsplice.server.config import ServerConfig
from kvsplice.server.embedded import EmbeddedStore, loopback_config

GENERATION = GenerationConfig(max_new_tokens=4, stop_token_ids=(127,))


def make_entry(tokens: tuple[int, ...], parent: SegmentMeta | None = None) -> SegmentMeta:
    start = 0 if parent is None else parent.end_position
    parent_key = None if parent is None else parent.context_key
    return make_meta(tokens, b"x", parent_key=parent_key, start_position=start)


def test_bytes_stay_within_the_bound_and_the_oldest_go_first() -> None:
    tier = LocalTier(max_bytes=10 * 256)
    metas = []
    parent = None
    for index in range(4):  # 4 segments of 4 tokens = 4 KiB > 2.5 KiB
        parent = make_entry((index, index, index, index), parent)
        metas.append(parent)
        tier.put(parent, random_segment(2, 4, parent.start_position, head_dim=8))
        assert tier.num_bytes <= tier.max_bytes
    assert tier.get(metas[0].context_key) is None and tier.get(metas[1].context_key) is None
    assert tier.get(metas[3].context_key) is not None
    assert tier.num_evictions == 2
    assert tier.child(metas[0].context_key, [0] * 4 + [1] * 4, 4) is None  # evicted


def test_an_entry_larger_than_the_budget_is_not_kept() -> None:
    tier = LocalTier(max_bytes=100)
    meta = make_entry((1, 2))
    tier.put(meta, random_segment(2, 2, head_dim=8))
    assert len(tier) == 0 and tier.get(meta.context_key) is None


def test_child_finds_the_longest_matching_next_link() -> None:
    tier = LocalTier(max_bytes=1 << 20)
    root = make_entry((5, 6))
    short, long = make_entry((7,), root), make_entry((7, 8), root)
    other = make_entry((9, 9), root)
    for meta in (root, short, long, other):
        tier.put(meta, random_segment(2, meta.num_tokens, meta.start_position, head_dim=8))
    assert tier.child(root.context_key, (5, 6, 7, 8, 1), 2) == long.context_key
    assert tier.child(root.context_key, (5, 6, 7, 1), 2) == short.context_key
    assert tier.child(root.context_key, (5, 6, 1), 2) is None


def test_an_entry_past_its_ttl_is_gone() -> None:
    tier = LocalTier(max_bytes=1 << 20)
    meta = replace(make_entry((1, 2)), ttl_s=0.05, created_at_s=time.time())
    tier.put(meta, random_segment(2, 2, head_dim=8))
    assert tier.get(meta.context_key) is not None
    time.sleep(0.08)
    assert tier.get(meta.context_key) is None
    assert tier.child(meta.parent_key, (1, 2), 0) is None


def test_pending_entries_are_newer_than_any_listing_until_acked() -> None:
    tier = LocalTier(max_bytes=1 << 20)
    meta = make_entry((1, 2))
    tier.put(meta, random_segment(2, 2, head_dim=8), pending=True)
    entry = tier.get(meta.context_key)
    assert entry is not None and not entry.unlisted_is_stale(time.monotonic())
    listed_before_ack = time.monotonic()
    tier.confirm(meta.context_key)
    entry = tier.get(meta.context_key)
    assert entry is not None and not entry.pending
    assert not entry.unlisted_is_stale(listed_before_ack)  # acked after that listing began
    assert entry.unlisted_is_stale(time.monotonic())


# The engine: local hits replace fetches, and the sidecar's index stays the authority.

SYSTEM = "<|im_start|>system\nYou add numbers.<|im_end|>\n<|im_start|>user\n"


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return make_loaded()


def conversation(turns: int) -> FakePrompt:
    parts: list[tuple[str, str, str | tuple[int, ...]]] = [("text", "system", SYSTEM)]
    for turn in range(turns):
        parts.append(("text", f"turn_{turn}", f"say {turn}<|im_end|>\n<|im_start|>assistant\n"))
    return make_prompt(parts)


def run(engine: ReuseEngine, prompt: FakePrompt) -> CallOutcome:
    outcome = engine.run(prompt, GENERATION)
    reference = engine.dense_reference(prompt, GENERATION)
    assert outcome.generated_ids == reference.generated_ids
    assert float((outcome.logits_first - reference.logits_first).abs().max()) <= 1e-4
    return outcome


def test_a_call_extending_the_last_one_fetches_nothing(
    loaded: LoadedModel, store_target: str
) -> None:
    with store_engine(loaded, "exact", store_target, "local-extend") as engine:
        run(engine, conversation(1))
        second = run(engine, conversation(2))  # its puts may still be in flight
        assert second.num_reused_tokens == len(conversation(1).token_ids)
        assert second.timings.fetch_s == 0 and second.timings.decode_s == 0
        engine.flush()
        assert engine.writer is not None and engine.writer.counters.num_failed == 0
        assert engine.writer.counters.num_stored >= 3


def test_a_segment_deleted_in_the_sidecar_is_dropped_locally(
    loaded: LoadedModel, store_target: str
) -> None:
    with store_engine(loaded, "exact", store_target, "local-deleted") as engine:
        client = engine.store
        prompt = conversation(2)
        run(engine, conversation(1))
        engine.flush()
        system_key = client.lookup_prefix(loaded.fingerprint, prompt.token_ids).segments[0]
        assert client.delete(system_key.segment_id)
        assert engine.local is not None and engine.local.get(system_key.context_key) is not None
        after = run(engine, prompt)
        assert after.num_reused_tokens == 0  # the chain starts with the deleted segment
        assert engine.local.num_invalidations >= 1
        recomputed = engine.local.get(system_key.context_key)  # this call puts it again
        assert recomputed is not None


def expiring_config(ttl_s: float) -> ServerConfig:
    config = loopback_config(None)
    return replace(config, service=replace(config.service, default_ttl_s=ttl_s))


def test_a_segment_expired_in_the_sidecar_is_not_reused(loaded: LoadedModel) -> None:
    ttl_s = 4.0  # room for slow calls on a loaded machine before it expires
    with (
        EmbeddedStore(expiring_config(ttl_s)) as store,
        store_engine(loaded, "exact", store.target, "local-expired") as engine,
    ):
        client = engine.store
        first = conversation(1)
        run(engine, first)
        engine.flush()
        assert client.lookup_prefix(loaded.fingerprint, first.token_ids).num_matched_tokens > 0
        assert run(engine, conversation(2)).num_reused_tokens > 0  # held, and still listed
        engine.flush()
        time.sleep(ttl_s + 0.2)
        assert client.lookup_prefix(loaded.fingerprint, first.token_ids).segments == ()
        assert engine.local is not None and len(engine.local) > 0
        again = run(engine, conversation(3))
        assert again.num_reused_tokens == 0
        assert engine.local.num_invalidations >= 1
