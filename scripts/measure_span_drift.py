"""How far approximate K/V is from in-context K/V on real spans, per layer: naive and the
yardstick's negative controls.

The span: a persona-first prompt's user turn (the standing instructions and an MMLU
question, as `bench vllm --workload mmlu` lays them out), computed after one agent's
persona (A) and after another's (B), so it sits at other positions after other text.
Against B's in-context K/V (the oracle) it reports, per layer, the relative RMS error of
- naive: A's keys moved by the exact RoPE Δ, A's values (what the connector loads);
- control-unrotated: A's keys left where they were stored, A's values;
- control-noise: naive plus the control's noise (`negative_controls.damage`).
Run (threads, problems and the model are arguments; writes JSON):
    .venv/bin/python scripts/measure_span_drift.py [MODEL [NUM_PROBLEMS [THREADS [OUT]]]]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from kvsplice.client.model.model_config import ModelConfig
from kvsplice.client.model.models import load_model
from kvsplice.client.model.packaged_models import PACKAGED_MODELS
from kvsplice.eval.workloads.graded_pipelines import PIPELINES
from kvsplice.integrations.vllm.negative_controls import NOISE_FRACTION, damage
from kvsplice.kvmath.rope import RopeSpec


def prompt_ids(tokenizer: object, persona: str, user: str) -> list[int]:
    messages = [{"role": "system", "content": persona}, {"role": "user", "content": user}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)  # type: ignore[attr-defined]
    return list(tokenizer.encode(text, add_special_tokens=False))  # type: ignore[attr-defined]


def kv_of(model: torch.nn.Module, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's K (post-RoPE) and V: [L, H_kv, T, D]."""
    with torch.no_grad():
        cache = model(torch.tensor([ids]), use_cache=True).past_key_values
    layers = getattr(cache, "layers", None)
    if layers is not None:
        keys, values = [lay.keys[0] for lay in layers], [lay.values[0] for lay in layers]
    else:
        keys, values = [k[0] for k, _ in cache], [v[0] for _, v in cache]
    return torch.stack(keys).float(), torch.stack(values).float()


def relative(x: torch.Tensor, oracle: torch.Tensor) -> list[float]:
    """Per layer ||x − oracle|| / ||oracle|| (RMS over heads, tokens, dims)."""
    dims = tuple(range(1, x.dim()))
    return ((x - oracle).pow(2).mean(dims).sqrt() / oracle.pow(2).mean(dims).sqrt()).tolist()


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-0.5b"
    num_problems = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
    out = Path(sys.argv[4]) if len(sys.argv) > 4 else None
    loaded = load_model(ModelConfig(source=name, dtype="float32"))
    model, tokenizer = loaded.model, loaded.tokenizer
    rope = RopeSpec.from_hf_config(model.config)
    pipeline = PIPELINES["mmlu"]
    rows = []
    for problem in pipeline.problems(range(num_problems)):
        user = (
            f"{pipeline.context}\n\nThe task:\n{problem.question}\n\n{pipeline.instructions[1][1]}"
        )
        a = prompt_ids(tokenizer, pipeline.personas["planner"], user)
        b = prompt_ids(tokenizer, pipeline.personas["critic"], user)
        shared = next(i for i in range(1, min(len(a), len(b))) if a[-i] != b[-i]) - 1
        k_a, v_a = kv_of(model, a)
        k_b, v_b = kv_of(model, b)
        span_a, span_b = slice(len(a) - shared, len(a)), slice(len(b) - shared, len(b))
        stored_k, oracle_k = k_a[:, :, span_a], k_b[:, :, span_b]
        stored_v, oracle_v = v_a[:, :, span_a], v_b[:, :, span_b]
        delta = span_b.start - span_a.start
        moved = rope.shift_layers(stored_k, delta)
        noisy_k, noisy_v = damage("noise", stored_k, moved, stored_v, problem.problem_id)
        unmoved_k, _ = damage("unrotated", stored_k, moved, stored_v, problem.problem_id)
        rows.append({
            "problem": problem.problem_id, "span_tokens": shared, "delta": delta,
            "naive_k": relative(moved, oracle_k), "naive_v": relative(stored_v, oracle_v),
            "unrotated_k": relative(unmoved_k, oracle_k),
            "noise_k": relative(noisy_k, oracle_k), "noise_v": relative(noisy_v, oracle_v),
        })  # fmt: skip
    summary = {
        key: [sum(r[key][layer] for r in rows) / len(rows) for layer in range(len(rows[0][key]))]
        for key in ("naive_k", "naive_v", "unrotated_k", "noise_k", "noise_v")
    }
    report = {
        "model": name, "dtype": "float32", "weights": PACKAGED_MODELS[name].source
        if hasattr(PACKAGED_MODELS[name], "source") else name, "noise_fraction": NOISE_FRACTION,
        "num_problems": len(rows), "mean_relative_error_by_layer": summary, "problems": rows,
        "load_avg": list(os.getloadavg()), "threads": torch.get_num_threads(),
    }  # fmt: skip
    for key, values in summary.items():
        third = len(values) // 3
        print(f"{key:12s} first third {sum(values[:third]) / third:.3f}  "
              f"last third {sum(values[-third:]) / third:.3f}  max {max(values):.3f}")  # fmt: skip
    if out is not None:
        out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
