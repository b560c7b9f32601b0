"""How far the anchor mode's corrected K/V is from in-context K/V on real spans, per layer,
with naive's beside it (issue 50's "must show").

The spans are `measure_span_drift.py`'s: a persona-first prompt's user turn (the standing
instructions and an MMLU question), computed after the planner's persona (the sender: the
stored run) and after the critic's (the context C it lands in: the oracle). As the
connector does, for each problem the pool of C holds anchors of the *other* problems (their
base: the sender's run moved to C's positions; their offset: C's in-context K/V − base),
stored and read back through the connector's payloads (`kvmath.anchor_payload`, the
connector's default scheme), then KVComm's gate (`kvmath.anchor_gate.decide`) and
correction (`kvmath.anchor_correction.correct`) run on the problem's base. Per layer,
the relative RMS error against C's K/V of
- naive: the sender's keys moved by the exact RoPE Δ, its values (what `naive` loads);
- anchor: the correction from the other problems' anchors the length rule leaves (the
  gate's decision is reported beside it: where it refuses, the connector recomputes);
- oracle_anchor: the same with the problem's own anchor in the pool (must be ~0);
- flipped_anchor: the correction with every offset's sign flipped (a negative control:
  must be worse than naive).
Run (under `flock /work/engine.lock`; writes JSON):
    .venv/bin/python scripts/measure_anchor_drift.py [MODEL [NUM_PROBLEMS [THREADS [OUT]]]]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from measure_span_drift import kv_of, prompt_ids, relative

from kvsplice.client.model.model_config import ModelConfig
from kvsplice.client.model.models import load_model
from kvsplice.eval.workloads.graded_pipelines import PIPELINES
from kvsplice.integrations.vllm.connector_config import ConnectorConfig
from kvsplice.kvmath.anchor_correction import AnchorQuery, correct
from kvsplice.kvmath.anchor_gate import decide
from kvsplice.kvmath.anchor_payload import decode_anchor_payloads, encode_base, encode_offsets
from kvsplice.kvmath.anchors import AgentOffsets, Anchor, eligible_anchors, kv_offset
from kvsplice.kvmath.rope import RopeSpec
from kvsplice.kvmath.segment_kv import SegmentKV

CONTEXT = "ctx-critic"  # the pool and the offsets' owner, as `anchor_loads.context_pool_id`
FINGERPRINT = "kvfp1-" + "00" * 16  # the payloads' label only


def span_pair(model: torch.nn.Module, tokenizer: object, rope: RopeSpec, problem: object,
              pipeline: object) -> tuple[SegmentKV, SegmentKV, int]:  # fmt: skip
    """(naive: the sender's run moved to C's positions, C's in-context K/V, its Δ)."""
    user = f"{pipeline.context}\n\nThe task:\n{problem.question}\n\n{pipeline.instructions[1][1]}"  # type: ignore[attr-defined]
    a = prompt_ids(tokenizer, pipeline.personas["planner"], user)  # type: ignore[attr-defined]
    b = prompt_ids(tokenizer, pipeline.personas["critic"], user)  # type: ignore[attr-defined]
    shared = next(i for i in range(1, min(len(a), len(b))) if a[-i] != b[-i]) - 1
    (k_a, v_a), (k_b, v_b) = kv_of(model, a), kv_of(model, b)
    start_a, start_b = len(a) - shared, len(b) - shared
    moved = rope.shift_layers(k_a[:, :, start_a:], start_b - start_a)
    naive = SegmentKV(moved, v_a[:, :, start_a:], start_position=start_b)
    real = SegmentKV(k_b[:, :, start_b:], v_b[:, :, start_b:], start_position=start_b)
    return naive, real, start_b - start_a


def stored_anchor(anchor_id: str, base: SegmentKV, real: SegmentKV, rope: RopeSpec,
                  quant: str, sign: float = 1.0) -> Anchor:  # fmt: skip
    """The anchor as the connector puts it and reads it back (payloads in `quant`)."""
    offset = kv_offset(real, base, rope)
    offset = SegmentKV(sign * offset.keys, sign * offset.values, offset.start_position)
    base_bytes = encode_base(base, fingerprint=FINGERPRINT, quant=quant)
    offsets_bytes = encode_offsets(AgentOffsets(offset), fingerprint=FINGERPRINT, quant=quant)
    anchor = decode_anchor_payloads(anchor_id, base.num_tokens, base_bytes, offsets_bytes,
                                    CONTEXT, fingerprint=FINGERPRINT, dtype=torch.float32)  # fmt: skip
    assert anchor is not None
    return anchor


def corrected(base: SegmentKV, pool: list[Anchor], rope: RopeSpec) -> SegmentKV | None:
    usable = eligible_anchors(pool, base.num_tokens, CONTEXT)
    if not usable:
        return None
    query = AnchorQuery(CONTEXT, base, base.start_position)
    return correct(query, usable, rope).placeholder


def errors(kv: SegmentKV | None, real: SegmentKV) -> dict[str, list[float] | None]:
    if kv is None:
        return {"k": None, "v": None}
    return {"k": relative(kv.keys, real.keys), "v": relative(kv.values, real.values)}


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-0.5b"
    num_problems = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
    out = Path(sys.argv[4]) if len(sys.argv) > 4 else None
    quant = ConnectorConfig("h:1").quant  # the connector's default scheme for payloads
    loaded = load_model(ModelConfig(source=name, dtype="float32"))
    rope = RopeSpec.from_hf_config(loaded.model.config)
    pipeline = PIPELINES["mmlu"]
    problems = list(pipeline.problems(range(num_problems)))
    pairs = [span_pair(loaded.model, loaded.tokenizer, rope, p, pipeline) for p in problems]
    anchors = [stored_anchor(p.problem_id, n, r, rope, quant) for p, (n, r, _) in zip(problems, pairs, strict=True)]  # fmt: skip
    flipped = [stored_anchor(p.problem_id, n, r, rope, quant, -1.0) for p, (n, r, _) in zip(problems, pairs, strict=True)]  # fmt: skip
    rows = []
    for i, (problem, (naive, real, delta)) in enumerate(zip(problems, pairs, strict=True)):
        others = [a for j, a in enumerate(anchors) if j != i]
        decision = decide(naive, others, rope, CONTEXT)
        rows.append({
            "problem": problem.problem_id, "span_tokens": naive.num_tokens, "delta": delta,
            "gate": {"reuse": decision.reuse, "reason": decision.reason,
                     "entropy_bits": decision.entropy_bits,
                     "threshold_bits": decision.threshold_bits,
                     "num_eligible": len(decision.anchor_ids)},
            "naive": errors(naive, real),
            "anchor": errors(corrected(naive, others, rope), real),
            "oracle_anchor": errors(corrected(naive, [anchors[i], *others], rope), real),
            "flipped_anchor": errors(
                corrected(naive, [a for j, a in enumerate(flipped) if j != i], rope), real
            ),
        })  # fmt: skip
    report = {
        "model": name, "dtype": "float32",
        "weights": "Q4_K_M GGUF dequantized to float32 (docs/models.md)",
        "anchor_payload_quant": quant, "span": "persona-first MMLU user turn, planner -> critic",
        "num_problems": len(rows), "mean_relative_error_by_layer": summary(rows),
        "problems": rows, "load_avg": list(os.getloadavg()), "threads": torch.get_num_threads(),
        "command": " ".join(["scripts/measure_anchor_drift.py", *sys.argv[1:]]),
    }  # fmt: skip
    for key, values in report["mean_relative_error_by_layer"].items():  # type: ignore[union-attr]
        if values:
            third = len(values) // 3
            print(f"{key:18s} first third {sum(values[:third]) / third:.3f}  "
                  f"last third {sum(values[-third:]) / third:.3f}  max {max(values):.3f}")  # fmt: skip
    if out is not None:
        out.write_text(json.dumps(report, indent=2))


def summary(rows: list[dict]) -> dict[str, list[float]]:
    """Per measure and K/V kind, the mean over the problems it was measured on, per layer
    (`anchor` only where the length rule left an anchor)."""
    means = {}
    for measure in ("naive", "anchor", "oracle_anchor", "flipped_anchor"):
        for kind in ("k", "v"):
            series = [r[measure][kind] for r in rows if r[measure][kind] is not None]
            if series:
                means[f"{measure}_{kind}"] = [sum(s[i] for s in series) / len(series)
                                              for i in range(len(series[0]))]  # fmt: skip
    for kind in ("k", "v"):
        same = [r["naive"][kind] for r in rows if r["anchor"][kind] is not None]
        if same:  # naive on the problems the anchor was measured on, for a like comparison
            means[f"naive_where_anchor_{kind}"] = [sum(s[i] for s in same) / len(same)
                                                   for i in range(len(same[0]))]  # fmt: skip
    return means


if __name__ == "__main__":
    main()
