"""Time the fused decode's CUDA path (`decode_into`, int8 payload through pinned staging) on a
Qwen2.5-0.5B-shaped segment against a pinned H2D memcpy of the same payload bytes and a
device-to-device copy of the output bytes, and check the decoded K/V against the CPU path.

    python scripts/gpu_check.py --device cuda --json results/gpu_check.json
    python scripts/gpu_check.py --device cpu --tokens 128 --repeats 3   # a smoke run
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable

import torch

from kvsplice.kvmath import cpu_decode
from kvsplice.kvmath.fused_decode import PinnedStaging, decode_into
from kvsplice.kvmath.payload import decode_stored, encode_payload
from kvsplice.kvmath.rope import RopeSpec
from kvsplice.kvmath.segment_kv import SegmentKV

FINGERPRINT = "kvfp1-" + "a" * 32
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--theta", type=float, default=1e6)
    parser.add_argument("--delta", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    shape = (args.layers, args.heads, args.tokens, args.head_dim)
    gen = torch.Generator().manual_seed(0)
    segment = SegmentKV(
        torch.randn(shape, generator=gen) * 3, torch.randn(shape, generator=gen), 0, 0
    )
    payload = encode_payload(segment, model_fingerprint=FINGERPRINT, quant="int8")
    stored = decode_stored(payload)
    rope = RopeSpec.uniform(args.head_dim, args.theta, num_layers=args.layers)
    staging = PinnedStaging()

    def outs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # As the call executor splices: token views of fresh [L, 1, H_kv, T, D] buffers.
        keys = torch.empty((args.layers, 1, *shape[1:]), dtype=dtype, device=device)
        return keys[:, 0], torch.empty_like(keys)[:, 0]

    def time_it(fn: Callable[[], object]) -> dict[str, float]:
        for _ in range(args.warmup):
            fn()
        sync()
        wall, gpu = [], []
        for _ in range(args.repeats):
            sync()
            if cuda:
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
            t0 = time.perf_counter()
            fn()
            if cuda:
                end.record()
            sync()
            wall.append((time.perf_counter() - t0) * 1e3)
            if cuda:
                gpu.append(start.elapsed_time(end))
        row = {"median_ms": statistics.median(wall), "min_ms": min(wall)}
        if cuda:
            row["event_median_ms"] = statistics.median(gpu)
        return row

    payload_bytes = stored.nbytes  # int8 K and V plus their float32 scales: what crosses
    rows: dict[str, dict[str, float]] = {}
    checks: dict[str, dict[str, object]] = {}

    # The CPU path's result (float32; numba kernels where installed) is the reference.
    ref_keys, ref_values = torch.empty(shape), torch.empty(shape)
    decode_into(stored, rope, args.delta, ref_keys, ref_values)
    rows["cpu decode -> fp32 (reference path)"] = time_it(
        lambda: decode_into(stored, rope, args.delta, ref_keys, ref_values)
    )

    for name, dtype in DTYPES.items():
        keys_out, values_out = outs(dtype)
        run = functools.partial(
            decode_into, stored, rope, args.delta, keys_out, values_out, staging
        )
        rows[f"decode int8 -> {name}, delta {args.delta:+d}"] = time_it(run)
        run()
        sync()
        rtol = 2**-10 if dtype == torch.float16 else 2**-7  # ~1 ulp of the out dtype
        check: dict[str, object] = {}
        for label, got, ref in (("keys", keys_out, ref_keys), ("values", values_out, ref_values)):
            diff = (got.float().cpu() - ref).abs()
            check[f"{label}_max_abs_err"] = float(diff.max())
            check[f"{label}_ok"] = bool((diff <= 1e-3 + rtol * ref.abs()).all())
        checks[name] = check

    keys_out, values_out = outs(torch.float16)
    rows["decode int8 -> fp16, delta 0 (dequantize only)"] = time_it(
        lambda: decode_into(stored, rope, 0, keys_out, values_out, staging)
    )
    rows[f"decode int8 -> fp16, delta {args.delta:+d}, staging=None"] = time_it(
        lambda: decode_into(stored, rope, args.delta, keys_out, values_out)
    )

    host = torch.empty(payload_bytes, dtype=torch.uint8, pin_memory=cuda)
    on_device = torch.empty(payload_bytes, dtype=torch.uint8, device=device)
    rows["memcpy H2D pinned, payload bytes"] = time_it(
        lambda: on_device.copy_(host, non_blocking=True)
    )
    output_bytes = 2 * keys_out.numel() * keys_out.element_size()
    src = torch.empty(output_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    rows["copy D2D, fp16 output bytes"] = time_it(lambda: dst.copy_(src))

    h2d = rows["memcpy H2D pinned, payload bytes"]["median_ms"]
    d2d = rows["copy D2D, fp16 output bytes"]["median_ms"]
    for row in rows.values():
        row["x_h2d"] = row["median_ms"] / h2d
        row["x_d2d"] = row["median_ms"] / d2d
        row["payload_GB_s"] = payload_bytes / row["median_ms"] / 1e6

    result = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "numba_cpu_kernels": cpu_decode.available(),
        "shape_LHTD": list(shape),
        "rope_theta": args.theta,
        "delta": args.delta,
        "payload_bytes": payload_bytes,
        "output_bytes_fp16": output_bytes,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "rows": rows,
        "checks": checks,
    }
    print(
        f"{result['device']}  torch {result['torch']}  [L,H,T,D]={list(shape)}  "
        f"payload {payload_bytes / 2**20:.2f} MiB  fp16 out {output_bytes / 2**20:.2f} MiB  "
        f"median of {args.repeats} (wall, synchronized)"
    )
    print(
        f"{'':52} {'median ms':>9} {'min ms':>8} {'event ms':>8} {'x H2D':>7} {'x D2D':>7} {'GB/s':>7}"
    )
    for name, row in rows.items():
        event = f"{row['event_median_ms']:8.3f}" if "event_median_ms" in row else f"{'-':>8}"
        print(
            f"{name:52} {row['median_ms']:9.3f} {row['min_ms']:8.3f} {event} "
            f"{row['x_h2d']:7.2f} {row['x_d2d']:7.2f} {row['payload_GB_s']:7.2f}"
        )
    for name, check in checks.items():
        print(f"check {name} vs CPU path: {check}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    ok = all(check[k] for check in checks.values() for k in check if k.endswith("_ok"))
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
