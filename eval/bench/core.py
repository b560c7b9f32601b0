"""`bench core`: the reuse path (int8 payload -> shifted HF cache) against dense prefill and memcpy.

Owns the measurement and its rows; the CLI renders them. Per length and thread count it
times, in one run on one machine: dense prefill; the whole reuse path (payload checks and
checksum, fused dequantize + RoPE shift written into a freshly allocated cache); the fused
decode alone into preallocated cache buffers; the former two-step decode (dequantize,
then shift, then copy into the cache); and `numpy.copyto` of the same fp32 K/V bytes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from rich.table import Table

from kvsplice.client.execute.call_executor import CallExecutor, build_cache
from kvsplice.client.execute.call_timings import CallTimings
from kvsplice.client.execute.capture import capture_segments
from kvsplice.client.execute.plan import CallPlan
from kvsplice.client.model.hf_cache import install_layers, model_cache
from kvsplice.client.model.models import LoadedModel
from kvsplice.eval.measure.machine_load import busy_machine_warning, load_average, warn_if_busy
from kvsplice.eval.measure.stopwatch import median_seconds
from kvsplice.kvmath.fused_decode import decode_into
from kvsplice.kvmath.payload import decode_payload, decode_stored, encode_payload

logger = logging.getLogger(__name__)

# Segments are captured here and spliced at position 0: every key is rotated (Δ = −CAPTURE_POSITION).
CAPTURE_POSITION = 512
DECODE_TARGET_RATIO = 0.5  # fused decode vs memcpy of the same fp32 bytes, at 1,024 tokens
REUSE_TARGET_SPEEDUP = 40.0  # dense prefill over the whole reuse path, at 1,024 tokens
TARGET_NUM_TOKENS = 1024


@dataclass(frozen=True)
class CoreBenchRow:
    """Median seconds per stage for one segment length and torch thread count."""

    num_tokens: int
    num_threads: int
    payload_nbytes: int
    kv_nbytes: int  # fp32 K and V: what the cache receives and memcpy copies
    dense_prefill_s: float
    reuse_s: float  # decode_stored (checks, checksum) + build_cache (fused, fresh buffers)
    decode_s: float  # fused dequantize + shift + write into preallocated cache buffers
    two_step_decode_s: float  # the former path: dequantize, shift, then copy into the cache
    memcpy_s: float

    @property
    def reuse_speedup_vs_dense(self) -> float:
        return self.dense_prefill_s / self.reuse_s

    @property
    def decode_ratio_to_memcpy(self) -> float:
        """Fused decode bandwidth (fp32 bytes written) as a fraction of memcpy's."""
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
    """One row per length and thread count; medians of `repeats` runs after a warm-up each."""
    if not lengths or min(lengths) < 1:
        raise ValueError(f"lengths {tuple(lengths)} must be non-empty and positive")
    if not thread_counts or min(thread_counts) < 1:
        raise ValueError(f"thread_counts {tuple(thread_counts)} must be non-empty and positive")
    warn_if_busy()
    rows = []
    for num_tokens in lengths:
        payload, kv_nbytes = _captured_payload(loaded, num_tokens)
        for num_threads in thread_counts:
            with torch_threads(num_threads):
                rows.append(_bench(loaded, num_tokens, num_threads, payload, kv_nbytes, repeats))
    return rows


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


def _captured_payload(loaded: LoadedModel, num_tokens: int) -> tuple[bytes, int]:
    ids = _token_ids(loaded, num_tokens)
    segment = capture_segments(
        loaded.model, ids, [(0, num_tokens)], position_offset=CAPTURE_POSITION
    )
    captured = segment.segments[0]
    payload = encode_payload(captured, model_fingerprint=loaded.fingerprint, quant="int8")
    return payload, 2 * captured.keys.numel() * 4  # fp32 K and V


def _token_ids(loaded: LoadedModel, num_tokens: int) -> list[int]:
    return make_token_ids(num_tokens, loaded.model.config.get_text_config(decoder=True).vocab_size)


def _bench(
    loaded: LoadedModel,
    num_tokens: int,
    num_threads: int,
    payload: bytes,
    kv_nbytes: int,
    repeats: int,
) -> CoreBenchRow:
    ids = _token_ids(loaded, num_tokens)
    executor = CallExecutor(loaded.model, loaded.layout, loaded.rope)
    dense = CallPlan.all_compute(ids)
    dense_s, _ = median_seconds(lambda: executor.prefill(dense, CallTimings()), repeats)
    reuse_s, _ = median_seconds(lambda: _reuse_path(loaded, payload), repeats)
    decode_s, _ = median_seconds(_fused_decode(loaded, payload), repeats)
    two_step_s, _ = median_seconds(_two_step_decode(loaded, payload), repeats)
    memcpy_s, _ = median_seconds(_copyto(kv_nbytes), repeats)
    row = CoreBenchRow(
        num_tokens, num_threads, len(payload), kv_nbytes,
        dense_s, reuse_s, decode_s, two_step_s, memcpy_s,
    )  # fmt: skip
    logger.info("bench core: %s", row)
    return row


def _reuse_path(loaded: LoadedModel, payload: bytes) -> object:
    # Everything a reuse does with fetched bytes before the suffix prefill.
    stored = decode_stored(payload, expect_fingerprint=loaded.fingerprint)
    return build_cache(loaded.model, [stored], loaded.layout, loaded.rope)


def _cache_buffers(loaded: LoadedModel, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    layout = loaded.layout
    shape = (layout.num_layers, 1, layout.num_kv_heads, num_tokens, layout.head_dim)
    return torch.zeros(shape), torch.zeros(shape)  # touched once: no page faults when timed


def _fused_decode(loaded: LoadedModel, payload: bytes) -> Callable[[], object]:
    stored = decode_stored(payload, expect_fingerprint=loaded.fingerprint)
    keys, values = _cache_buffers(loaded, stored.num_tokens)

    def run() -> object:
        decode_into(stored, loaded.rope, -stored.start_position, keys[:, 0], values[:, 0])
        cache = model_cache(loaded.model)
        install_layers(cache, keys, values)
        return cache

    return run


def _two_step_decode(loaded: LoadedModel, payload: bytes) -> Callable[[], object]:
    segment = decode_payload(payload, expect_fingerprint=loaded.fingerprint)
    keys, values = _cache_buffers(loaded, segment.num_tokens)
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
    derived = ("reuse_speedup_vs_dense", "decode_ratio_to_memcpy", "two_step_ratio_to_memcpy",
               "reuse_ratio_to_memcpy", "targets_met")  # fmt: skip
    return {
        "rows": [asdict(row) | {name: getattr(row, name) for name in derived} for row in rows],
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
        title="kvsplice bench core (int8 payload, medians)",
        caption=(
            "reuse = checks + checksum + fused decode into a fresh cache; decode = fused "
            "dequantize + shift + write into preallocated cache buffers; two-step = the former "
            "decode; memcpy = numpy.copyto of the same fp32 K/V bytes. Targets at 1,024 "
            f"tokens: decode >= {DECODE_TARGET_RATIO:.0%} of memcpy, reuse >= "
            f"{REUSE_TARGET_SPEEDUP:.0f}x dense."
        ),
    )
    for column in ("tokens", "threads", "payload", "dense prefill", "reuse path", "speedup",
                   "decode/memcpy", "two-step/memcpy", "memcpy GB/s", "targets"):  # fmt: skip
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
