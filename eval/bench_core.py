"""`bench core`: the reuse path (int8 payload -> shifted HF cache) against dense prefill and memcpy.

Owns the measurement and its rows; the CLI renders them. Per length it times dense
prefill, the whole reuse path (decode_payload with checksum + dequantize, RoPE
shift to another position, DynamicCache build), dequantize + shift alone, and
`numpy.copyto` of the same fp32 K/V bytes, all in one run on one machine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from rich.table import Table

from kvsplice.client.capture import capture_segments
from kvsplice.client.models import LoadedModel
from kvsplice.client.splice import build_cache, dense_prefill
from kvsplice.eval.stopwatch import median_seconds
from kvsplice.kvmath.payload import decode_payload, encode_payload
from kvsplice.kvmath.quant import KEY_GROUP_DIM, VALUE_GROUP_DIM, dequantize, quantize
from kvsplice.kvmath.segment_kv import SegmentKV

logger = logging.getLogger(__name__)

# Segments are captured here and spliced at position 0: every key is rotated (Δ = −CAPTURE_POSITION).
CAPTURE_POSITION = 512


@dataclass(frozen=True)
class CoreBenchRow:
    """Median seconds per stage for one segment length (int8 payload, fp32 model)."""

    num_tokens: int
    payload_nbytes: int
    kv_nbytes: int
    dense_prefill_s: float
    reuse_s: float
    dequant_shift_s: float
    memcpy_s: float

    @property
    def speedup(self) -> float:
        """Dense prefill time over reuse-path time."""
        return self.dense_prefill_s / self.reuse_s

    @property
    def reuse_bytes_per_s(self) -> float:
        """fp32 K/V bytes the reuse path materializes per second."""
        return self.kv_nbytes / self.reuse_s

    @property
    def memcpy_bytes_per_s(self) -> float:
        return self.kv_nbytes / self.memcpy_s

    @property
    def reuse_vs_memcpy(self) -> float:
        """Reuse-path bandwidth as a fraction of memcpy bandwidth."""
        return self.memcpy_s / self.reuse_s

    @property
    def dequant_shift_vs_memcpy(self) -> float:
        return self.memcpy_s / self.dequant_shift_s


def run_core_bench(
    loaded: LoadedModel, lengths: Sequence[int] = (256, 1024, 2048), repeats: int = 5
) -> list[CoreBenchRow]:
    """One row per length; medians of `repeats` runs after one warm-up each."""
    if not lengths or min(lengths) < 1:
        raise ValueError(f"lengths {tuple(lengths)} must be non-empty and positive")
    return [_bench_length(loaded, n, repeats) for n in lengths]


def make_token_ids(num_tokens: int, vocab_size: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_tokens,), generator=generator).tolist()


def _bench_length(loaded: LoadedModel, num_tokens: int, repeats: int) -> CoreBenchRow:
    model = loaded.model
    ids = make_token_ids(num_tokens, model.config.get_text_config(decoder=True).vocab_size)
    segment = capture_segments(model, ids, [(0, num_tokens)], position_offset=CAPTURE_POSITION)
    captured = segment.segments[0]
    payload = encode_payload(captured, model_fingerprint=loaded.fingerprint, quant="int8")
    kv_nbytes = 2 * captured.keys.numel() * 4  # fp32 K and V
    dense_s, _ = median_seconds(lambda: dense_prefill(model, ids), repeats)
    reuse_s, _ = median_seconds(lambda: _reuse_path(loaded, payload), repeats)
    dequant_shift_s, _ = median_seconds(_dequant_shift(loaded, captured), repeats)
    memcpy_s, _ = median_seconds(_copyto(kv_nbytes), repeats)
    row = CoreBenchRow(
        num_tokens, len(payload), kv_nbytes, dense_s, reuse_s, dequant_shift_s, memcpy_s
    )
    logger.info("bench core %d tokens: %s", num_tokens, row)
    return row


def _reuse_path(loaded: LoadedModel, payload: bytes) -> object:
    # Everything a reuse does with fetched bytes before the suffix prefill.
    segment = decode_payload(payload, expect_fingerprint=loaded.fingerprint)
    return build_cache(loaded.model, [segment], loaded.layout, loaded.rope)


def _dequant_shift(
    loaded: LoadedModel, captured: SegmentKV
) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    keys = quantize(captured.keys, "int8", KEY_GROUP_DIM)
    values = quantize(captured.values, "int8", VALUE_GROUP_DIM)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        shifted = loaded.rope.shift_layers(dequantize(keys), -captured.start_position)
        return shifted, dequantize(values)

    return run


def _copyto(nbytes: int) -> Callable[[], None]:
    source = np.ones(nbytes // 4, dtype=np.float32)
    target = np.empty_like(source)
    return lambda: np.copyto(target, source)


def render_core_bench(rows: Sequence[CoreBenchRow]) -> Table:
    """A rich table of the bench rows (the CLI prints it)."""
    table = Table(title="kvsplice bench core (int8 payload, medians)")
    for column in ("tokens", "payload", "dense prefill", "reuse path", "speedup",
                   "reuse GB/s", "memcpy GB/s", "reuse/memcpy", "dequant+shift/memcpy"):  # fmt: skip
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            str(row.num_tokens), f"{row.payload_nbytes / 1e6:.2f} MB",
            f"{row.dense_prefill_s * 1e3:.1f} ms", f"{row.reuse_s * 1e3:.2f} ms",
            f"{row.speedup:.0f}x", f"{row.reuse_bytes_per_s / 1e9:.2f}",
            f"{row.memcpy_bytes_per_s / 1e9:.2f}", f"{row.reuse_vs_memcpy:.0%}",
            f"{row.dequant_shift_vs_memcpy:.0%}",
        )  # fmt: skip
    return table
