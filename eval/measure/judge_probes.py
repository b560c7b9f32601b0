"""Judge probes of `kvsplice calibrate`: a mode is admitted for judges only when its JCR clears a bar.

Owns `JudgeThresholds`, `JudgeProbe` (one judge-mode candidate's figures on the probes),
`margin_error`, `guard` and `probe_judge_modes`. Each candidate (a judge mode's variant
with its margin guard off) judges the probe examples beside the dense judge of the same
prompts (shuffled orders, several seeds). Its decision error on a probe is how far the
label logits' pairwise differences moved from dense (a margin above it cannot flip the
choice); the guard's `min_margin` is `margin_safety` times the `error_quantile` of those
errors, and never below the margin of a probe whose choice did flip. The guard is then
replayed on the same probes (a call is kept when its margin reaches it, else it would be
dense): that gives the JCR and the candidate-block token·layer reuse admission reads.
Why a quantile and not the largest error: the largest errors come with large margins
(a confident call moved a lot and still chose the same); bounding by them sends most
safe calls dense.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvsplice.client.model.models import LoadedModel
from kvsplice.eval.bench.judge_runner import JudgeRunConfig, run_judges
from kvsplice.eval.measure.jcr import JudgeRecord
from kvsplice.eval.workloads.judge_examples import JudgeExample

logger = logging.getLogger(__name__)

DENSE = "dense"


@dataclass(frozen=True)
class JudgeThresholds:
    """Admit for judges when the guarded JCR on the probes is ≥ `min_jcr` and something is
    reused; the guard's margin is `margin_safety` × the `error_quantile` of the decision
    errors seen (at least the margin of any flipped probe)."""

    min_jcr: float = 0.98
    margin_safety: float = 1.25
    error_quantile: float = 0.9

    def __post_init__(self) -> None:
        if not 0 <= self.min_jcr <= 1:
            raise ValueError(f"min_jcr {self.min_jcr} not in [0, 1]")
        if not self.margin_safety >= 1:
            raise ValueError(f"margin_safety {self.margin_safety} must be >= 1")
        if not 0 < self.error_quantile <= 1:
            raise ValueError(f"error_quantile {self.error_quantile} not in (0, 1]")


@dataclass(frozen=True)
class JudgeProbe:
    """One candidate on the probes. `spec`: its variant with the guard off; `min_margin`: the
    guard calibrated for it; `jcr`, `kept`, `reuse`: the guarded replay (kept: share of calls
    that keep the cheap prefill; reuse: candidate-block token·layers not computed)."""

    mode: str
    spec: str
    num_probes: int
    max_error: float
    min_margin: float
    raw_jcr: float
    jcr: float
    kept: float
    reuse: float
    admitted: bool


def margin_error(record: JudgeRecord) -> float:
    """max_j |(c_top − c_j) − (d_top − d_j)|: c the mode's label logits, d the dense judge's,
    top the mode's choice. A margin (c_top − max_j c_j) above it guarantees dense chose top."""
    cheap, dense = record.scores, record.dense_scores
    if len(cheap) != len(dense) or len(cheap) < 2:
        raise ValueError(f"record {record.example_id} lacks label logits to compare")
    top = max(range(len(cheap)), key=lambda j: cheap[j])
    return max(
        abs((cheap[top] - cheap[j]) - (dense[top] - dense[j]))
        for j in range(len(cheap))
        if j != top
    )


def record_reuse(record: JudgeRecord) -> float:
    total = record.num_candidate_tokens * record.num_layers
    return record.num_candidate_token_layers_reused / total if total else 0.0


def guard(records: Sequence[JudgeRecord], min_margin: float) -> tuple[float, float, float]:
    """(JCR, kept share, reuse) of `records` replayed with a margin guard: a call below
    `min_margin` would have been prefilled densely (consistent, nothing reused)."""
    if not records:
        raise ValueError("no records to replay")
    kept = [r for r in records if r.margin >= min_margin]
    consistent = sum(r.consistent for r in kept) + len(records) - len(kept)
    reuse = sum(record_reuse(r) for r in kept)
    n = len(records)
    return consistent / n, len(kept) / n, reuse / n


def calibrated_margin(records: Sequence[JudgeRecord], thresholds: JudgeThresholds) -> float:
    """`margin_safety` × max(the `error_quantile` of the decision errors, the largest margin
    of a flipped probe), rounded up to 0.05 logits."""
    errors = sorted(margin_error(r) for r in records)
    rank = max(0, math.ceil(thresholds.error_quantile * len(errors)) - 1)
    flipped = max((r.margin for r in records if not r.consistent), default=0.0)
    bound = max(errors[rank], flipped) * thresholds.margin_safety
    return math.ceil(bound * 20 - 1e-9) / 20  # fp noise never adds a step


def judge_probe(
    mode: str, spec: str, records: Sequence[JudgeRecord], thresholds: JudgeThresholds
) -> JudgeProbe:
    """The figures of one candidate from its records (its guard off) and the verdict."""
    min_margin = calibrated_margin(records, thresholds)
    jcr, kept, reuse = guard(records, min_margin)
    raw_jcr = sum(r.consistent for r in records) / len(records)
    admitted = jcr >= thresholds.min_jcr and reuse > 0
    largest = max(margin_error(r) for r in records)
    return JudgeProbe(
        mode, spec, len(records), largest, min_margin, raw_jcr, jcr, kept, reuse, admitted
    )


def probe_judge_modes(
    loaded: LoadedModel,
    candidates: Sequence[tuple[str, str]],
    examples: Sequence[JudgeExample],
    seeds: Sequence[int],
    store_target: str,
    thresholds: JudgeThresholds | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[JudgeProbe]:
    """Each (mode, variant spec with its guard off) on `examples` × `seeds` (shuffled orders)."""
    thresholds = thresholds or JudgeThresholds()
    specs = [spec for _, spec in candidates]
    records: dict[str, list[JudgeRecord]] = {}
    for seed in seeds:
        config = JudgeRunConfig(
            modes=(DENSE, *specs), regime="parallel", shuffle=True, seed=seed, warmup=False,
            namespace=f"kvsplice-calibrate-judge-{seed}",
        )  # fmt: skip
        labels = dict(zip(config.modes[1:], specs, strict=True))  # canonical label -> spec
        tick = None if progress is None else (lambda e: progress(f"judge probes · {e.message}"))
        run = run_judges(loaded, examples, config, store_target, tick)
        for record in run.records:
            if record.mode in labels:
                records.setdefault(labels[record.mode], []).append(record)
    return [judge_probe(mode, spec, records[spec], thresholds) for mode, spec in candidates]
