"""What the connector's approximate span search reads from the sidecar, before and after it took
the candidates' tokens from FindSimilar (issue 51).

A sidecar in its own process (LMDB tier alone) holds 16 chunks of 256 tokens, each stored as 4
near-duplicates (3 of them with one token changed) computed elsewhere: 64 candidate segments
of 8 MiB. The prompt is the 16 chunks and one token. `span_search.find_spans` runs over it with
- before: each new candidate fetched with `get_segment` for its tokens (the code up to 0eee221,
  re-created here as `_add_candidates_before`);
- after: the tokens come with `find_similar(with_token_ids=True)`, no fetch;
each through a client on the sidecar's host (reads in place) and one forced over gRPC (what a
worker on another host gets), alternating, `REPEATS` times after one untimed round. Per run:
wall seconds, this process's and the sidecar's CPU seconds, payload bytes fetched, FindSimilar
answer bytes, and the spans found (the same before and after, or the run fails). No deadline:
the connector's (half of its 0.5 s lookup timeout) would cut a slow search short.
Run (writes JSON to OUT if given):
    flock /work/engine.lock .venv/bin/python scripts/measure_span_search.py [REPEATS [OUT]]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from kvsplice.common.keys import off_chain_key, root_key
from kvsplice.common.segment import chained_meta
from kvsplice.eval.bench.store.payloads import MIB, NUM_LAYERS, VOCAB_SIZE, make_payload
from kvsplice.index.bench_lookup import BENCH_FINGERPRINT, BENCH_NAMESPACE
from kvsplice.integrations.vllm import span_search
from kvsplice.integrations.vllm.sidecar_faults import FaultLog
from kvsplice.integrations.vllm.span_cover import StoredTokens
from kvsplice.server.sidecar_process import SidecarProcess, SidecarSpec
from kvsplice.storeclient import wire
from kvsplice.storeclient.client import StoreClient
from kvsplice.storeclient.config import StoreClientConfig
from kvsplice.storeclient.wire import with_payload_digest

CHUNK_TOKENS, NUM_CHUNKS, NUM_VARIANTS, BLOCK = 256, 16, 4, 16
SEGMENT_MIB = 8
PATIENT = StoreClientConfig(lookup_timeout_s=30.0, get_timeout_s=60.0, put_timeout_s=60.0)


def _add_candidates_before(
    store: Any, root: str, window: Sequence[int], candidates: dict[str, StoredTokens],
    exact_only: bool,
) -> None:  # fmt: skip
    """The search's candidate step as it was: a whole segment fetched for its tokens."""
    for candidate in store.find_similar(root, window, limit=span_search.MAX_SPAN_CANDIDATES):
        ref = candidate.segment
        if ref.segment_id in candidates or ref.layer_start != 0:
            continue
        found = store.get_segment(ref.segment_id, model_fingerprint=root)
        if found is not None and (found[0].exact or not exact_only):
            meta = found[0]
            candidates[ref.segment_id] = StoredTokens(
                ref.segment_id, meta.start_position, tuple(meta.token_ids)
            )


class Counted:
    """A client whose payload bytes fetched and FindSimilar answer bytes are summed."""

    def __init__(self, client: StoreClient) -> None:
        self.client = client
        self.payload_bytes = self.answer_bytes = self.num_fetches = 0

    def find_similar(self, *args: Any, **kwargs: Any) -> Any:
        decode = wire.similar_result

        def sized(response: Any) -> Any:
            self.answer_bytes += response.ByteSize()
            return decode(response)

        wire.similar_result = sized  # type: ignore[assignment]
        try:
            return self.client.find_similar(*args, **kwargs)
        finally:
            wire.similar_result = decode  # type: ignore[assignment]

    def get_segment(self, *args: Any, **kwargs: Any) -> Any:
        found = self.client.get_segment(*args, **kwargs)
        self.num_fetches += 1
        self.payload_bytes += 0 if found is None else len(found[1])
        return found


def populate(client: StoreClient, rng: np.random.Generator) -> list[int]:
    """The 64 candidates; returns the prompt."""
    chunks = [rng.integers(0, VOCAB_SIZE, size=CHUNK_TOKENS).tolist() for _ in range(NUM_CHUNKS)]
    parent = off_chain_key(root_key(BENCH_FINGERPRINT))
    for c, chunk in enumerate(chunks):
        for v in range(NUM_VARIANTS):
            tokens = list(chunk)
            if v:
                tokens[CHUNK_TOKENS - 8 * v] = (tokens[CHUNK_TOKENS - 8 * v] + 1) % VOCAB_SIZE
            payload = make_payload(rng, SEGMENT_MIB * MIB)
            position = 4096 + 512 * (c * NUM_VARIANTS + v)
            meta = chained_meta(BENCH_NAMESPACE, BENCH_FINGERPRINT, parent, tokens, position,
                                NUM_LAYERS, exact=True)  # fmt: skip
            if not client.put_segment(with_payload_digest(meta, payload), payload):
                raise RuntimeError("a put degraded; the run is void")
    return [t for chunk in chunks for t in chunk] + [1]


def one_search(client: StoreClient, prompt: list[int], sidecar: SidecarProcess) -> dict:
    counted = Counted(client)
    wall, cpu, sidecar_cpu = time.perf_counter(), time.process_time(), sidecar.cpu_seconds()
    spans = span_search.find_spans(
        counted, BENCH_FINGERPRINT, prompt, 0, block_size=BLOCK, chunk_tokens=CHUNK_TOKENS,
        deadline=time.monotonic() + 600.0, faults=FaultLog(),
    )  # fmt: skip
    return {
        "wall_s": time.perf_counter() - wall,
        "client_cpu_s": time.process_time() - cpu,
        "sidecar_cpu_s": sidecar.cpu_seconds() - sidecar_cpu,
        "num_fetches": counted.num_fetches,
        "payload_bytes": counted.payload_bytes,
        "find_similar_answer_bytes": counted.answer_bytes,
        "spans": [[s.segment_id, s.start, s.num_tokens] for s in spans],
    }


def run(variant: str, search: Callable[[], dict]) -> dict:
    span_search._add_candidates = (  # type: ignore[assignment]
        _add_candidates_before if variant == "before" else ADD_CANDIDATES_AFTER
    )
    try:
        return search()
    finally:
        span_search._add_candidates = ADD_CANDIDATES_AFTER


ADD_CANDIDATES_AFTER = span_search._add_candidates


def summary(runs: list[dict]) -> dict:
    out: dict = {"repeats": len(runs)}
    for key in ("wall_s", "client_cpu_s", "sidecar_cpu_s"):
        values = [r[key] for r in runs]
        out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    for key in ("num_fetches", "payload_bytes", "find_similar_answer_bytes"):
        out[key] = runs[0][key]
    out["num_spans"] = len(runs[0]["spans"])
    return out


def main(repeats: int, out: Path | None) -> dict:
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        spec = SidecarSpec(str(Path(tmp) / "lmdb"), map_size_bytes=1200 * MIB,
                           max_payload_nbytes=SEGMENT_MIB * MIB)  # fmt: skip
        with (
            SidecarProcess(spec) as sidecar,
            StoreClient(sidecar.target, BENCH_NAMESPACE, config=PATIENT) as local,
            StoreClient(
                sidecar.target, BENCH_NAMESPACE, config=replace(PATIENT, same_host_reads=False)
            ) as remote,
        ):
            prompt = populate(local, np.random.default_rng(51))
            results: dict[str, dict[str, list[dict]]] = {}
            for repeat in range(repeats + 1):  # the first round warms up, untimed
                for path, client in (("same-host", local), ("grpc", remote)):
                    for variant in ("before", "after"):
                        row = run(variant, lambda c=client: one_search(c, prompt, sidecar))
                        if repeat:
                            results.setdefault(path, {}).setdefault(variant, []).append(row)
            if local.counters.num_same_host_reads == 0:
                raise RuntimeError("the same-host path was never taken; the run is void")
    spans = {json.dumps(r["spans"]) for p in results.values() for v in p.values() for r in v}
    if len(spans) != 1:
        raise RuntimeError(f"before and after found other spans: {spans}")
    report = {
        "segments": NUM_CHUNKS * NUM_VARIANTS, "segment_mib": SEGMENT_MIB,
        "chunk_tokens": CHUNK_TOKENS, "prompt_tokens": len(prompt),
        "loadavg_start": load_start, "loadavg_end": os.getloadavg(), "cpu_count": os.cpu_count(),
        "rows": {p: {v: summary(runs) for v, runs in by.items()} for p, by in results.items()},
    }  # fmt: skip
    if out is not None:
        out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    args = sys.argv[1:]
    result = main(int(args[0]) if args else 5, Path(args[1]) if len(args) > 1 else None)
    print(json.dumps(result, indent=2))
