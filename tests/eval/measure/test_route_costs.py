"""Timing the judge routes' cost model on a tiny model (an embedded store for the reads)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.evaluation import make_tiny_loaded, use_one_torch_thread

from kvsplice.client.modes.route_cost import JudgeShape, dense_cost
from kvsplice.eval.measure.route_costs import measure_cost_model
from kvsplice.server.embedded import EmbeddedStore, loopback_config


def test_the_measured_model_prices_a_longer_dense_prefill_dearer(tmp_path: Path) -> None:
    use_one_torch_thread()
    loaded = make_tiny_loaded()
    with EmbeddedStore(loopback_config(str(tmp_path / "lmdb"))) as store:
        # NOTE: lengths 32x apart and medians of 3: one timing each of 16 vs 96 tokens could
        # invert on a busy machine (a measured 0 per token under load, 2026-11-27)
        cost = measure_cost_model(loaded, store.target, lengths=(16, 512), repeats=3)
    assert cost.s_per_token_layer > 0
    layers = loaded.layout.num_layers
    short, long = (JudgeShape(n, layers, 0, n, 0) for n in (16, 512))
    assert dense_cost(long, cost) > dense_cost(short, cost)
    with pytest.raises(ValueError, match="increasing"):
        measure_cost_model(loaded, store.target, lengths=(96, 16))
