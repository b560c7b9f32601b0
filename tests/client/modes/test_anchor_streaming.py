"""Anchors of any size: an 8B-class model's anchor (> 4 MiB, the old one-message cap)
goes through PutAnchor/GetAnchors in chunks and decodes to what was encoded."""

from __future__ import annotations

import torch
from helpers.kv import random_segment
from helpers.store import FINGERPRINT, NAMESPACE

from kvsplice.client.modes.anchor.pools import decode_anchor
from kvsplice.kvmath.anchor_payload import encode_base, encode_offsets
from kvsplice.kvmath.anchors import AgentOffsets
from kvsplice.kvmath.segment_kv import SegmentKV
from kvsplice.server.embedded import EmbeddedStore, loopback_config
from kvsplice.storeclient.client import StoreClient
from kvsplice.storeclient.config import StoreClientConfig

# Llama-3-8B's K/V geometry: 32 layers, 8 KV heads, head_dim 128 (~128 KiB/token in fp16).
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
NUM_TOKENS = 96


def kv(seed: int, start: int) -> SegmentKV:
    return random_segment(
        NUM_LAYERS, NUM_TOKENS, start, num_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, seed=seed
    )


PATIENT = StoreClientConfig(lookup_timeout_s=10.0, get_timeout_s=60.0, put_timeout_s=60.0)


def test_an_anchor_over_4_mib_round_trips_through_the_store() -> None:
    base = kv(0, start=0)
    offsets = AgentOffsets(placeholder=kv(1, start=40))
    base_payload = encode_base(base, fingerprint=FINGERPRINT, quant="int8")
    agent_payload = encode_offsets(offsets, fingerprint=FINGERPRINT, quant="int8")
    assert len(base_payload) > 4 << 20 and len(agent_payload) > 4 << 20
    config = loopback_config(None, memory_bytes=128 << 20)  # 4 MiB chunks
    with (
        EmbeddedStore(config) as store,
        StoreClient(store.target, NAMESPACE, config=PATIENT) as client,
    ):
        evicted = client.put_anchor(
            FINGERPRINT, "p", "a1", base_payload, {"solver": agent_payload}, NUM_TOKENS
        )
        assert evicted == []
        (entry,) = client.get_anchors(FINGERPRINT, "p", anchor_ids=["a1"])
        listed = client.get_anchors(FINGERPRINT, "p", include_payloads=False)
    assert entry.base_payload == base_payload
    assert dict(entry.agent_payloads) == {"solver": agent_payload}
    assert [e.anchor_id for e in listed] == ["a1"] and listed[0].base_payload == b""
    anchor = decode_anchor(entry, "solver", fingerprint=FINGERPRINT, dtype=torch.float32)
    assert anchor is not None
    decoded = anchor.offsets_by_agent["solver"].placeholder
    # int8 round trip: within the quantization step of each channel/token.
    assert torch.allclose(anchor.base.keys, base.keys, atol=0.05)
    assert torch.allclose(decoded.values, offsets.placeholder.values, atol=0.05)
