"""Measuring the judge routes' cost model (`client.modes.route_cost.CostModel`) on one model.

Owns `measure_cost_model`: dense prefill timed at two lengths gives the seconds per
token·layer and dense's fixed cost; the layerwise loop at the same lengths, its fixed
cost per pass; an exact call that reads a stored prefix through a fresh worker (nothing
held locally), the index lookup and the seconds per token·layer read (fetch, decode,
splice). Every figure is a median of `repeats` runs. What the constants are used for is
the gate's business.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from kvsplice.agents.render import RenderedPrompt, Span
from kvsplice.client.execute.execution import GenerationConfig
from kvsplice.client.execute.plan import CallPlan
from kvsplice.client.model.models import LoadedModel
from kvsplice.client.modes.route_cost import CostModel
from kvsplice.client.reuse_engine import EngineConfig, ReuseEngine
from kvsplice.storeclient.client import StoreClient

logger = logging.getLogger(__name__)

ONE_TOKEN = GenerationConfig(max_new_tokens=1, ignore_stop=True)
READ_STAGES = ("fetch_s", "decode_s", "shift_s", "splice_s")


def measure_cost_model(
    loaded: LoadedModel,
    store_target: str,
    *,
    lengths: tuple[int, int] = (64, 320),
    repeats: int = 3,
    namespace: str = "kvsplice-route-costs",
    quant: str = "none",
) -> CostModel:
    """The cost model of `loaded` on this machine (its thread count as set by the caller)."""
    short, long = lengths
    if not 0 < short < long:
        raise ValueError(f"lengths {lengths} must be increasing and positive")
    layers = loaded.layout.num_layers
    dense = ReuseEngine(loaded, "dense", None, EngineConfig(store_segments=False))
    t_short, t_long = (_median(repeats, partial(_dense_s, dense, n)) for n in lengths)
    per_token_layer = max(t_long - t_short, 0.0) / ((long - short) * layers)
    dense_fixed = max(t_short - per_token_layer * short * layers, 0.0)
    passes = [
        _median(repeats, partial(_layerwise_s, dense, n)) - per_token_layer * n * layers
        for n in lengths
    ]
    lookup_s, read_s = _read_costs(loaded, store_target, long, repeats, namespace, quant)
    model = CostModel(
        s_per_token_layer=per_token_layer,
        s_per_read_token_layer=read_s / (long * layers),
        s_per_pass=max(statistics.fmean(passes), 0.0),
        s_dense_fixed=dense_fixed,
        s_lookup=lookup_s,
    )
    logger.info("route cost model: %s", model)
    return model


def _prompt(num_tokens: int, vocab_size: int, salt: int = 0) -> RenderedPrompt:
    # ordinary token ids (past the first tenth of the vocabulary, where special and byte
    # tokens sit); a salt makes prompts unlike each other
    low = vocab_size // 10
    ids = tuple(low + (7 * i + 13 * salt) % (vocab_size - low) for i in range(num_tokens))
    return RenderedPrompt(ids, (Span("text", "text_0", 0, num_tokens),))


def _vocab_size(loaded: LoadedModel) -> int:
    embeddings = loaded.model.get_input_embeddings()
    if not isinstance(embeddings, torch.nn.Embedding):  # HF's embeddings are (or subclass) it
        raise TypeError(f"input embeddings {type(embeddings).__name__} are no nn.Embedding")
    return embeddings.num_embeddings


def _dense_s(engine: ReuseEngine, num_tokens: int) -> float:
    prompt = _prompt(num_tokens, _vocab_size(engine.loaded))
    return engine.dense_reference(prompt, ONE_TOKEN).ttft_s


def _layerwise_s(engine: ReuseEngine, num_tokens: int) -> float:
    plan = CallPlan.all_compute(_prompt(num_tokens, _vocab_size(engine.loaded)).token_ids)
    start = time.perf_counter()
    with torch.inference_mode():
        engine.executor.layerwise.run(plan)
    return time.perf_counter() - start


def _read_costs(
    loaded: LoadedModel, target: str, num_tokens: int, repeats: int, namespace: str, quant: str
) -> tuple[float, float]:
    """(lookup seconds, seconds to read `num_tokens` tokens' K/V): medians over fresh workers."""
    lookups, reads = [], []
    for repeat in range(repeats):
        prompt = _prompt(num_tokens, _vocab_size(loaded), salt=repeat + 1)
        config = EngineConfig(quant=quant)
        with ReuseEngine(loaded, "exact", StoreClient(target, namespace), config) as writer:
            writer.run(prompt, ONE_TOKEN)
            writer.flush()
        longer = RenderedPrompt(
            (*prompt.token_ids, prompt.token_ids[0]), (Span("text", "text_0", 0, num_tokens + 1),)
        )
        with ReuseEngine(loaded, "exact", StoreClient(target, namespace), config) as reader:
            outcome = reader.run(longer, ONE_TOKEN)
        timings = outcome.timings
        lookups.append(timings.lookup_s)
        reads.append(sum(getattr(timings, stage) for stage in READ_STAGES))
    return statistics.median(lookups), statistics.median(reads)


def _median(repeats: int, measure: Callable[[], float]) -> float:
    measure()  # warm-up, not counted
    return statistics.median(measure() for _ in range(repeats))
