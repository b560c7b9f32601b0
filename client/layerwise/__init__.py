"""Layerwise execution over an HF model's own decoder layers (anchor, multicut, blend, halo).

Per token span a plan says which layers reuse provided K/V and which are
computed, from which hidden state; `LayerwiseExecutor.run` executes it.
"""

from kvsplice.client.layerwise.executor import LayerwiseExecutor
from kvsplice.client.layerwise.kv_buffer import KVBuffer
from kvsplice.client.layerwise.plan import (
    KVPair,
    LayerwisePlan,
    LayerwiseSpan,
    SubsetRule,
    TokenSelector,
    segment_span,
)
from kvsplice.client.layerwise.result import CapturedStates, LayerwiseResult

__all__ = [
    "CapturedStates",
    "KVBuffer",
    "KVPair",
    "LayerwiseExecutor",
    "LayerwisePlan",
    "LayerwiseResult",
    "LayerwiseSpan",
    "SubsetRule",
    "TokenSelector",
    "segment_span",
]
