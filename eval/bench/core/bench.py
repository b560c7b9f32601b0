"""`bench core`: `ReuseEngine`'s own reuse call (int8 payload -> shifted HF cache) against
dense prefill and memcpy.

Owns the measurement and its rows; the CLI renders them. Per length and thread count it
times, in one run on one machine: the engine's dense prefill of the prompt; the engine's
call reusing the prompt's context from a sidecar in another process on this host, as a
worker next to its sidecar runs (lookups, the in-place read, checks and checksum, the
splice, the last token's forward: its TTFT), stage by stage (`stages_s`), and within it the
splice stage alone (`splice_s`: fused dequantize + RoPE shift written into the cache's
pooled buffers); the former two-step decode (dequantize, then shift, then copy into the
cache); `numpy.copyto` of the same fp32 K/V bytes; and the floor of a reuse call: the bare
HF forward of one token over HF's own `DynamicCache` of the same length (`forward_floor_s`;
that cache copies itself per forward, the engine's is extended in place, so the call's
forward can sit a little under it), whose ratio to dense prefill bounds the speedup on
this machine. `counts` (`core.counts`) is what
one call did. The context was stored by a call that placed it at `CAPTURE_POSITION`, so the
reuse call (`naive`) shifts every key.
"""

from __future__ import annotations

import logging
import os
import statistics
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from rich.table import Table

from kvsplice.client.execute.capture import capture_segments
from kvsplice.client.execute.execution import GenerationConfig
from kvsplice.client.model.chat_prompt import ChatPrompt, ChatSpan
from kvsplice.client.model.hf_cache import cache_kwarg, full_length_cache, truncate
from kvsplice.client.model.models import LoadedModel, fp32_head
from kvsplice.client.reuse_engine import CallOutcome, EngineConfig, ReuseEngine
from kvsplice.eval.bench.core.counts import CallCounts, count_call
from kvsplice.eval.measure.machine_load import busy_machine_warning, load_average, warn_if_busy
from kvsplice.eval.measure.stopwatch import median_seconds
from kvsplice.kvmath.payload import decode_payload, decode_stored, encode_payload
from kvsplice.server.sidecar_process import SidecarProcess, SidecarSpec
from kvsplice.storage.config import LMDBTierConfig
from kvsplice.storeclient.client import StoreClient

logger = logging.getLogger(__name__)

# The context is stored after this many tokens and reused at slot 0: every key is
# rotated (Δ = −CAPTURE_POSITION), as a position-only reuse of another prompt's text is.
CAPTURE_POSITION = 512
REUSE_MODE = "naive"
DECODE_TARGET_RATIO = 0.5  # the engine's splice vs memcpy of the same fp32 bytes, at 1,024 tokens
REUSE_TARGET_SPEEDUP = 40.0  # the engine's dense prefill over its reuse call, at 1,024 tokens
TARGET_NUM_TOKENS = 1024
FIRST_TOKEN = GenerationConfig(max_new_tokens=1, ignore_stop=True)
LMDB_MAP_BYTES = 1 << 30
# The reuse call's stages (`CallTimings`) before its first token, as `stages_s` reports them.
CALL_STAGES = ("lookup_s", "fetch_s", "decode_s", "shift_s", "splice_s", "prefill_s",
               "first_decode_s")  # fmt: skip


@dataclass(frozen=True)
class CoreBenchRow:
    """Median seconds per stage for one context length and torch thread count."""

    num_tokens: int
    num_threads: int
    payload_nbytes: int
    kv_nbytes: int  # fp32 K and V: what the cache receives and memcpy copies
    dense_prefill_s: float  # the engine's dense TTFT over context + tail
    reuse_s: float  # the engine's TTFT reusing the context (everything up to the first token)
    decode_s: float  # that call's splice stage: fused dequantize + shift, written in the cache
    two_step_decode_s: float  # the former path: dequantize, shift, then copy into the cache
    memcpy_s: float
    forward_floor_s: float  # the bare HF forward of one token over a cache of `num_tokens`
    stages_s: dict[str, float]  # the reuse call's median seconds by stage; "other": the rest
    counts: CallCounts  # what one reuse call did (round trips, forwards, reads)

    @property
    def reuse_speedup_vs_dense(self) -> float:
        return self.dense_prefill_s / self.reuse_s

    @property
    def ceiling_speedup_vs_dense(self) -> float:
        """Dense prefill over the bare one-token forward (HF's cache): a reuse call's bound."""
        return self.dense_prefill_s / self.forward_floor_s

    @property
    def decode_ratio_to_memcpy(self) -> float:
        """The engine's splice bandwidth (fp32 bytes written) as a fraction of memcpy's."""
        return self.memcpy_s / self.decode_s

    @property
    def two_step_ratio_to_memcpy(self) -> float:
        return self.memcpy_s / self.two_step_decode_s

    @property
    def reuse_ratio_to_memcpy(self) -> float:
        return self.memcpy_s / self.reuse_s

    @property
    def targets_met(self) -> bool | None:
        """Both targets at 1,024 tokens; None at other lengths (no target stated)."""
        if self.num_tokens != TARGET_NUM_TOKENS:
            return None
        return (
            self.decode_ratio_to_memcpy >= DECODE_TARGET_RATIO
            and self.reuse_speedup_vs_dense >= REUSE_TARGET_SPEEDUP
        )


def run_core_bench(
    loaded: LoadedModel,
    lengths: Sequence[int] = (256, 1024, 2048),
    repeats: int = 5,
    thread_counts: Sequence[int] = (1, 2),
) -> list[CoreBenchRow]:
    """One row per length and thread count; medians of `repeats` calls after a warm-up each."""
    if not lengths or min(lengths) < 1:
        raise ValueError(f"lengths {tuple(lengths)} must be non-empty and positive")
    if not thread_counts or min(thread_counts) < 1:
        raise ValueError(f"thread_counts {tuple(thread_counts)} must be non-empty and positive")
    warn_if_busy()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, _sidecar(tmp) as sidecar:
        for num_tokens in lengths:
            namespace = f"bench-core-{num_tokens}"
            _store_context(loaded, StoreClient(sidecar.target, namespace), num_tokens)
            with ReuseEngine(
                loaded, REUSE_MODE, StoreClient(sidecar.target, namespace),
                EngineConfig(quant="int8", store_segments=False, async_store=False),
            ) as engine:  # fmt: skip
                payload, kv_nbytes = _captured_payload(loaded, num_tokens)
                for num_threads in thread_counts:
                    with torch_threads(num_threads):
                        rows.append(
                            _bench(engine, sidecar, num_tokens, num_threads, payload,
                                   kv_nbytes, repeats)
                        )  # fmt: skip
    return rows


def _sidecar(tmp: str) -> SidecarProcess:
    """The sidecar as deployed beside a worker: another process on this host, LMDB at its
    shipped durability, reads in place; its admin API answers `/metrics` for the counts."""
    lmdb = LMDBTierConfig(f"{tmp}/lmdb", map_size_bytes=LMDB_MAP_BYTES)
    return SidecarProcess(SidecarSpec(lmdb.path, LMDB_MAP_BYTES, admin=True, lmdb=lmdb))


@contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def make_token_ids(num_tokens: int, vocab_size: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_tokens,), generator=generator).tolist()


def _prompt(*parts: Sequence[int]) -> ChatPrompt:
    """Text spans, one per part, back to back."""
    spans, start = [], 0
    for index, part in enumerate(parts):
        spans.append(ChatSpan("text", f"text_{index}", start, start + len(part)))
        start += len(part)
    return ChatPrompt(tuple(int(t) for part in parts for t in part), tuple(spans))


def _vocab_size(loaded: LoadedModel) -> int:
    return int(loaded.model.config.get_text_config(decoder=True).vocab_size)


def _context(loaded: LoadedModel, num_tokens: int) -> list[int]:
    return make_token_ids(num_tokens, _vocab_size(loaded))


def _store_context(loaded: LoadedModel, store: StoreClient, num_tokens: int) -> None:
    """A dense call that stores the context after `CAPTURE_POSITION` other tokens (int8)."""
    before = make_token_ids(CAPTURE_POSITION, _vocab_size(loaded), seed=1)
    prompt = _prompt(before, _context(loaded, num_tokens), [0])
    config = EngineConfig(quant="int8", async_store=False, local_tier_bytes=0)
    with ReuseEngine(loaded, "dense", store, config) as engine:
        engine.run(prompt, FIRST_TOKEN)


def _captured_payload(loaded: LoadedModel, num_tokens: int) -> tuple[bytes, int]:
    """The context's K/V captured at `CAPTURE_POSITION` as an int8 payload (what the store
    holds), and the bytes of its fp32 K and V."""
    ids = _context(loaded, num_tokens)
    segment = capture_segments(
        loaded.model, ids, [(0, num_tokens)], position_offset=CAPTURE_POSITION
    )
    captured = segment.segments[0]
    payload = encode_payload(captured, model_fingerprint=loaded.fingerprint, quant="int8")
    return payload, 2 * captured.keys.numel() * 4


def _bench(
    engine: ReuseEngine,
    sidecar: SidecarProcess,
    num_tokens: int,
    num_threads: int,
    payload: bytes,
    kv_nbytes: int,
    repeats: int,
) -> CoreBenchRow:
    prompt = _prompt(_context(engine.loaded, num_tokens), [1])
    dense_s = _median(lambda: engine.dense_reference(prompt, FIRST_TOKEN), repeats)
    reuse = _reuse_calls(engine, prompt, repeats)
    two_step_s, _ = median_seconds(_two_step_decode(engine.loaded, payload), repeats)
    memcpy_s, _ = median_seconds(_copyto(kv_nbytes), repeats)
    floor_s, _ = median_seconds(_bare_forward(engine.loaded, num_tokens), repeats)
    row = CoreBenchRow(
        num_tokens, num_threads, len(payload), kv_nbytes, dense_s,
        statistics.median(o.ttft_s for o in reuse),
        statistics.median(o.timings.splice_s for o in reuse), two_step_s, memcpy_s, floor_s,
        call_stages(reuse), reuse_call_counts(engine, prompt, sidecar),
    )  # fmt: skip
    logger.info("bench core: %s", row)
    return row


def _median(call: Callable[[], CallOutcome], repeats: int) -> float:
    call()  # warm-up
    return statistics.median(call().ttft_s for _ in range(repeats))


def _reuse_calls(engine: ReuseEngine, prompt: ChatPrompt, repeats: int) -> list[CallOutcome]:
    """`repeats` reuse calls after a warm-up; each must reuse the whole context."""
    engine.run(prompt, FIRST_TOKEN)
    outcomes = [engine.run(prompt, FIRST_TOKEN) for _ in range(repeats)]
    expected = len(prompt.token_ids) - 1
    if any(o.num_reused_tokens != expected for o in outcomes):
        raise RuntimeError(f"the reuse call did not reuse the stored {expected}-token context")
    return outcomes


def call_stages(outcomes: Sequence[CallOutcome]) -> dict[str, float]:
    """Median seconds of each stage before the first token; "other": the TTFT's remainder."""
    stages = {
        stage: statistics.median(o.timings.to_dict()[stage] for o in outcomes)
        for stage in CALL_STAGES
    }
    return stages | {"other": statistics.median(o.ttft_s for o in outcomes) - sum(stages.values())}


def reuse_call_counts(
    engine: ReuseEngine, prompt: ChatPrompt, sidecar: SidecarProcess
) -> CallCounts:
    """What one more reuse call of `prompt` does (`counts.count_call`)."""
    if engine.store is None or sidecar.admin_url is None:
        raise ValueError("counting needs the engine's store and the sidecar's admin API")
    store = engine.store
    return count_call(
        lambda: engine.run(prompt, FIRST_TOKEN), engine.loaded.model, sidecar.admin_url,
        lambda: store.counters.num_same_host_reads,
    )  # fmt: skip


def _bare_forward(loaded: LoadedModel, num_tokens: int) -> Callable[[], object]:
    """One token's forward over a `num_tokens` cache by HF alone (the decoder, then the fp32
    head; no kvsplice code): the floor under any reuse call's last-token forward."""
    decoder, head = loaded.model.get_decoder(), fp32_head(loaded.model)
    ids = torch.as_tensor([_context(loaded, num_tokens)])
    cache = full_length_cache()
    with torch.inference_mode():
        decoder(input_ids=ids, **cache_kwarg(decoder, cache), use_cache=True)
    token, position = torch.tensor([[1]]), torch.tensor([[num_tokens]])

    def run() -> object:
        with torch.inference_mode():
            out = decoder(
                input_ids=token, position_ids=position, **cache_kwarg(decoder, cache),
                use_cache=True,
            )  # fmt: skip
            logits = head(out.last_hidden_state[0, -1])
        truncate(cache, num_tokens)
        return logits

    return run


def _two_step_decode(loaded: LoadedModel, payload: bytes) -> Callable[[], object]:
    segment = decode_payload(payload, expect_fingerprint=loaded.fingerprint)
    layout = loaded.layout
    shape = (layout.num_layers, 1, layout.num_kv_heads, segment.num_tokens, layout.head_dim)
    keys, values = torch.zeros(shape), torch.zeros(shape)  # touched once: no page faults
    raw = decode_stored(payload)

    def run() -> object:
        decoded = decode_payload(payload)  # checksum again, dequantize
        shifted = loaded.rope.shift_layers(decoded.keys, -raw.start_position)
        keys[:, 0].copy_(shifted)
        values[:, 0].copy_(decoded.values)
        return keys

    return run


def _copyto(nbytes: int) -> Callable[[], None]:
    source = np.ones(nbytes // 4, dtype=np.float32)
    target = np.ones_like(source)
    return lambda: np.copyto(target, source)


def core_bench_to_json(rows: Sequence[CoreBenchRow]) -> dict[str, Any]:
    """`{"rows": [...], ...}`: every field of each row plus its derived ratios."""
    derived = ("reuse_speedup_vs_dense", "ceiling_speedup_vs_dense", "decode_ratio_to_memcpy",
               "two_step_ratio_to_memcpy", "reuse_ratio_to_memcpy", "targets_met")  # fmt: skip
    return {
        "rows": [
            asdict(row)
            | {"counts": row.counts.to_dict()}
            | {name: getattr(row, name) for name in derived}
            for row in rows
        ],
        "targets": {
            "num_tokens": TARGET_NUM_TOKENS,
            "decode_ratio_to_memcpy": DECODE_TARGET_RATIO,
            "reuse_speedup_vs_dense": REUSE_TARGET_SPEEDUP,
        },
        "num_cpus": os.cpu_count() or 0,
        "load_average": load_average(),
        "busy_machine_warning": busy_machine_warning(load_average(), os.cpu_count() or 1),
    }


def render_core_bench(rows: Sequence[CoreBenchRow]) -> Table:
    """A rich table of the bench rows (the CLI prints it)."""
    table = Table(
        title="kvsplice bench core (ReuseEngine, int8 payload, medians)",
        caption=(
            "reuse call = ReuseEngine's TTFT reusing the context (lookups, read, checks, "
            "splice, last token); splice = that call's splice stage (fused dequantize + "
            "shift, written into the cache); two-step = the former decode; memcpy = numpy.copyto "
            "of the same fp32 K/V bytes. Targets at 1,024 "
            f"tokens: splice >= {DECODE_TARGET_RATIO:.0%} of memcpy, reuse call >= "
            f"{REUSE_TARGET_SPEEDUP:.0f}x dense."
        ),
    )
    for column in ("tokens", "threads", "payload", "dense prefill", "reuse call", "speedup",
                   "splice/memcpy", "two-step/memcpy", "memcpy GB/s", "targets"):  # fmt: skip
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            str(row.num_tokens), str(row.num_threads), f"{row.payload_nbytes / 1e6:.2f} MB",
            f"{row.dense_prefill_s * 1e3:.1f} ms", f"{row.reuse_s * 1e3:.2f} ms",
            f"{row.reuse_speedup_vs_dense:.0f}x", f"{row.decode_ratio_to_memcpy:.0%}",
            f"{row.two_step_ratio_to_memcpy:.0%}", f"{row.kv_nbytes / row.memcpy_s / 1e9:.2f}",
            {None: "-", True: "met", False: "missed"}[row.targets_met],
        )  # fmt: skip
    return table
