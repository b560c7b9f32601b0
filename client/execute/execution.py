"""A call's execution: how it generates, where its time goes, what its prefill reused, its state.

Owns `GenerationConfig` and `TokenPicker` (when decoding stops; how a token is picked:
an argmax on the logits as they are, or a draw on the CPU from a generator seeded once
per call), `CallTimings` and `timed` (the reuse path's stages, in seconds; what counts as
TTFT is the engine's), `ReuseMap` (the ranges tiling the prompt, each computed or reusing
some layers of a stored segment, read off a `CallPlan` and the slots its subset rules
kept; it holds no K/V), `ExecutionState` and `content_tokens`. Running anything is the
executor's.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace

import torch
from transformers import DynamicCache

from kvsplice.client.execute.layerwise_executor import LayerwiseResult
from kvsplice.client.execute.plan import CallPlan, PlanSpan, Source

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationConfig:
    """How far decoding goes and how its tokens are picked.

    Stops after `max_new_tokens`, at a token of `stop_token_ids`, or, with
    `stop_at_eos` (the default), at the model's `eos_token_id` (the engine adds it:
    `with_eos`). `ignore_stop` generates exactly `max_new_tokens` (fixed-shape
    benchmarks). `forced_ids` (teacher forcing): the answer is these tokens, as if
    generated; nothing is decoded, and storing reads their K/V as it would a generated
    answer's. Greedy by default (`temperature` 0: the oracle tests' path); `temperature`
    > 0 samples from softmax(logits / temperature) cut to the nucleus of mass `top_p`,
    with a generator seeded by `seed` for each call (None: unseeded, not reproducible).
    """

    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    ignore_stop: bool = False
    forced_ids: tuple[int, ...] = ()
    stop_at_eos: bool = True
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens {self.max_new_tokens} must be >= 1")
        object.__setattr__(self, "stop_token_ids", token_ids("stop_token_ids", self.stop_token_ids))
        object.__setattr__(self, "forced_ids", token_ids("forced_ids", self.forced_ids))
        if self.forced_ids and len(self.forced_ids) > self.max_new_tokens:
            raise ValueError(
                f"{len(self.forced_ids)} forced tokens exceed max_new_tokens {self.max_new_tokens}"
            )
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature {self.temperature!r} must be finite and >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p {self.top_p!r} must be in (0, 1]")
        if self.seed is not None and not (_is_id(self.seed) and self.seed < 1 << 63):
            raise ValueError(f"seed {self.seed!r} must be None or an int in [0, 2**63)")

    def with_eos(self, eos_token_ids: Sequence[int]) -> GenerationConfig:
        """This config with the model's `eos_token_ids` among its stop ids (`stop_at_eos`)."""
        if not self.stop_at_eos or self.ignore_stop:
            return self
        new = tuple(
            t for t in token_ids("eos_token_ids", eos_token_ids) if t not in self.stop_token_ids
        )
        return replace(self, stop_token_ids=self.stop_token_ids + new) if new else self


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def token_ids(name: str, ids: Sequence[int]) -> tuple[int, ...]:
    """`ids` as a tuple of token ids (ints >= 0); a ValueError names the first that is not."""
    if isinstance(ids, str | bytes):
        raise ValueError(f"{name} must be token ids, not the string {ids!r}")
    values = tuple(ids)
    bad = next((t for t in values if not _is_id(t)), None)
    if bad is not None:
        raise ValueError(f"{name}: {bad!r} is not a token id (an int >= 0)")
    return values


@dataclass
class ExecutionState:
    """The cache after a plan's prefill and what generation has added since.

    `reuse`: what the prefill reused per prompt range. `cache` holds K/V for
    positions [0, num_cached); `generated` are the greedy tokens so far (the
    newest one is not in the cache until it is fed). `layerwise`: the
    decoder-layer run that built the cache, with its captured states (None: the
    splice path).
    """

    reuse: ReuseMap
    cache: DynamicCache
    logits_first: torch.Tensor  # [V] float32, the last prompt token's logits
    generated: list[int] = field(default_factory=list)
    num_cached: int = 0
    layerwise: LayerwiseResult | None = None

    @property
    def prompt_len(self) -> int:
        return self.reuse.num_tokens


def content_tokens(generated: Sequence[int], config: GenerationConfig) -> tuple[int, ...]:
    """The generated tokens without a trailing stop token (what downstream agents see)."""
    if generated and not config.ignore_stop and generated[-1] in config.stop_token_ids:
        return tuple(generated[:-1])
    return tuple(generated)


class TokenPicker:
    """Picks the tokens of one call under `config` (a sampling picker holds its generator)."""

    def __init__(self, config: GenerationConfig) -> None:
        self.samples = config.temperature > 0
        self._temperature = config.temperature
        self._top_p = config.top_p
        self._generator = torch.Generator(device="cpu")
        if config.seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(config.seed)

    def pick(self, logits: torch.Tensor) -> int:
        """A token id from `logits` [V]: the argmax, or a draw from the tempered nucleus."""
        if not self.samples:
            return int(torch.argmax(logits))
        probs = nucleus(
            torch.softmax(logits.float().cpu() / self._temperature, dim=-1), self._top_p
        )
        return int(torch.multinomial(probs, 1, generator=self._generator))


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs` [V] restricted to the most likely tokens whose mass first reaches `top_p`
    (always at least the most likely one), unnormalized (multinomial normalizes)."""
    if top_p >= 1.0:
        return probs
    ordered, order = torch.sort(probs, descending=True)
    mass_before = torch.cumsum(ordered, dim=0) - ordered
    kept = torch.zeros_like(probs)
    keep = mass_before < top_p
    kept[order[keep]] = ordered[keep]
    return kept


@dataclass
class CallTimings:
    """Seconds per stage; stages before the first token sum to (about) the TTFT.

    lookup_s: store index calls (LookupPrefix, FindSimilar).  fetch_s: GetSegment.
    decode_s: payload decode/dequantize.  shift_s: RoPE Δ-rotation of reused keys.
    base_prefill_s: standalone prefills of placeholder base caches (KVComm left these out).
    splice_s: appending reused K/V to the model cache.  prefill_s: model forwards over
    computed spans.  first_decode_s: picking the first token from the prefill logits.
    After the first token (not in TTFT): decode_tokens_s (the rest of generation),
    store_s (capturing this call's segments and putting them, or queueing them for the
    engine's writer thread).
    """

    lookup_s: float = 0.0
    fetch_s: float = 0.0
    decode_s: float = 0.0
    shift_s: float = 0.0
    base_prefill_s: float = 0.0
    splice_s: float = 0.0
    prefill_s: float = 0.0
    first_decode_s: float = 0.0
    decode_tokens_s: float = 0.0
    store_s: float = 0.0

    def add(self, stage: str, seconds: float) -> None:
        if not hasattr(self, stage):
            raise ValueError(f"unknown timing stage {stage!r}")
        setattr(self, stage, getattr(self, stage) + seconds)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


@contextmanager
def timed(timings: CallTimings, stage: str) -> Iterator[None]:
    """Add the wall time of the `with` body to `timings.<stage>` (also when it raises)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timings.add(stage, time.perf_counter() - start)


LayerRange = tuple[int, int]


@dataclass(frozen=True)
class ReusedRange:
    """Prompt slots [start, end): computed through every layer (`source` None), or reusing
    layers `layers` = [first, last) of the stored K/V `source` describes.

    `source.chain_key` is kept only when the range is its whole stored span at every layer.
    """

    start: int
    end: int
    name: str = ""
    source: Source | None = None
    layers: LayerRange = (0, 0)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]


@dataclass(frozen=True)
class ReuseMap:
    """Ranges tiling `token_ids` in order."""

    token_ids: tuple[int, ...]
    ranges: tuple[ReusedRange, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def reused(self) -> tuple[ReusedRange, ...]:
        return tuple(r for r in self.ranges if r.source is not None)

    @property
    def num_reused_tokens(self) -> int:
        return sum(r.num_tokens for r in self.reused)


def reuse_map(
    plan: CallPlan, num_layers: int, kept_slots: Mapping[int, tuple[int, ...]] | None = None
) -> ReuseMap:
    """The run of `plan` as prompt ranges; `kept_slots`: check layer -> slots its rule kept."""
    dropped = _dropped_at(plan, kept_slots or {})
    ranges: list[ReusedRange] = []
    for span in plan.spans:
        for start, end, layers in _runs(span, dropped, num_layers):
            if span.source is None or layers is None:
                ranges.append(ReusedRange(start, end, span.name))
                continue
            whole = start == span.source.origin and layers == (0, num_layers)
            source = (
                span.source if whole else replace(span.source, chain_key=None, chain_num_tokens=0)
            )
            ranges.append(ReusedRange(start, end, span.name, source, layers))
    return ReuseMap(plan.token_ids, tuple(ranges))


def _dropped_at(plan: CallPlan, kept_slots: Mapping[int, tuple[int, ...]]) -> dict[int, int]:
    """slot -> the check layer whose subset rule stopped computing it (kept its old K/V)."""
    dropped: dict[int, int] = {}
    for rule in sorted(plan.subsets, key=lambda r: r.check_layer):
        kept = kept_slots.get(rule.check_layer)
        if kept is None:
            continue  # nothing was active there
        active = {
            slot
            for span in plan.spans
            if span.start_layer <= rule.check_layer
            for slot in range(span.start, span.end)
        }
        for slot in active - set(kept) - set(dropped):
            dropped[slot] = rule.check_layer
    return dropped


def _reused_layers(
    span: PlanSpan, slot: int, dropped: Mapping[int, int], num_layers: int
) -> LayerRange | None:
    """Layers whose K/V of `slot` were provided, not computed (None: computed everywhere)."""
    if span.kv is None:
        return None
    resumed = span.source is not None and span.source.resumed
    if slot in dropped and (span.start_layer == 0 or resumed):
        return dropped[slot], num_layers
    if resumed:
        return None  # its lower layers were computed by the call's earlier pass
    # A span starting above 0 and also dropped by a rule is not planned by any
    # mode but a resumed one; it would count only its lower layers here.
    return (0, span.start_layer) if span.start_layer > 0 else None


def _runs(
    span: PlanSpan, dropped: Mapping[int, int], num_layers: int
) -> Iterator[tuple[int, int, LayerRange | None]]:
    """Maximal runs [start, end) of `span`'s slots that reused the same layers."""
    layers = [_reused_layers(span, s, dropped, num_layers) for s in range(span.start, span.end)]
    cursor = span.start
    for value, group in itertools.groupby(layers):
        count = len(list(group))
        yield cursor, cursor + count, value
        cursor += count
