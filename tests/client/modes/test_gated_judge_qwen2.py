"""The risk gate on Qwen2.5-Coder-0.5B (bf16, its shipped policy) over a transcript judge.

The agents speak in display order and the judge takes the last turn, so every candidate
is in the judge prompt's exact chain: the priced gate must send the judge to `exact`
(cheapest, zero drift). A call whose margin clears bf16's noise floor is kept: it read
every candidate token·layer from the store and gives the dense judge's label logits to
bf16 rounding; a closer call is prefilled again densely and is the dense judge's own
computation. Reduced: the shipped sample's two HumanEval-format sets.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvsplice.client.model.models import LoadedModel
from kvsplice.client.modes.gated import GUARD, NOISE_FLOOR
from kvsplice.eval.bench.judge.bench import run_bench_judge
from kvsplice.eval.bench.judge.config import BenchJudgeConfig
from kvsplice.eval.workloads.judge_examples import JUDGE_SAMPLE

pytestmark = pytest.mark.slow

# One bf16 ulp of a logit near 16..32 is 0.125 (see test_exact_oracle_qwen2).
MAX_LABEL_LOGIT_DELTA_BF16 = 0.25


def test_the_priced_gate_reads_a_transcript_judge_from_the_chain(
    qwen2_bf16: LoadedModel, tmp_path: Path
) -> None:
    config = BenchJudgeConfig(
        data_path=JUDGE_SAMPLE, task="humaneval", examples=2, modes=("dense", "gated"),
        warmup=False, out_dir=tmp_path, judge_max_new_tokens=2, diagnostics=False,
        layout="transcript",
    )  # fmt: skip
    result = run_bench_judge(config, qwen2_bf16)
    gated = [r for r in result.run.records if r.mode == "gated"]
    assert len(gated) == 2
    for record in gated:
        assert " -> exact: cheapest (predicted ms: " in record.decisions["gated"]
        guard = record.decisions[GUARD]
        deltas = [abs(a - b) for a, b in zip(record.scores, record.dense_scores, strict=True)]
        if guard.startswith("kept: margin "):
            assert record.num_candidate_token_layers_reused == (
                record.num_candidate_tokens * record.num_layers
            )
            assert record.margin >= NOISE_FLOOR[torch.bfloat16]
            assert max(deltas) <= MAX_LABEL_LOGIT_DELTA_BF16
        else:
            assert guard.startswith("dense: margin ")
            assert record.num_candidate_token_layers_reused == 0
            assert max(deltas) == 0.0 and record.slot == record.dense_slot
