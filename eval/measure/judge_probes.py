"""Judge probes of `kvsplice calibrate`: a mode is admitted for judges only when its JCR clears a bar.

Owns `JudgeThresholds`, `JudgeProbe` (one judge-mode candidate's figures on the probes),
`margin_error`, `guard`, `calibrated_margin`, `held_out_replay` and `probe_judge_modes`.
Each candidate (a judge mode's variant with its margin guard off) judges the probe
examples beside the dense judge of the same prompts (shuffled orders, several seeds).

The guard: a call is kept when its prefill's label margin reaches `min_margin`, else it
is prefilled densely. `min_margin` is `margin_safety` times the largest margin of a probe
whose choice flipped (0 when none did). Why not a certificate (a margin above the
decision error cannot flip): on Qwen2.5-Coder-0.5B the judge's own label margins are
0.04-0.36 logits while every mode that reuses moves the label logits by 0.1-0.3 at
worst, mostly without flipping anything: a certifying guard sent every call dense (the
2026-11-28 runs, docs/results.md). An empirical guard is only as good as the probes it
saw, so admission reads a **held-out** JCR: the probe examples split in two folds, each
fold replayed under the guard calibrated on the other one (`held_out_replay`); a mode is
admitted when that JCR clears `min_jcr` and something is reused. `jcr`, `kept` and
`reuse` are those held-out figures; the policy's guard is calibrated on every probe.
`margin_error` (how far the label logits' pairwise differences moved from dense) is
reported as each candidate's largest decision error.

Staged candidates (`staged_probes`, for a mode with a deeper pass, crossfix's `deep`):
each pair of a mode's check layers, each pass with the guard calibrated for it alone,
replayed on the same probes: a call is kept by the cheap pass when its margin reaches
that pass's guard, else by the deeper pass, else dense. The deeper pass resumes from the
cheap one's exact states, so its result is the single pass at its check layer (tested),
and the single-pass records replay it exactly.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvsplice.client.model.models import LoadedModel
from kvsplice.client.modes.params import format_value
from kvsplice.client.modes.registry import mode_spec
from kvsplice.eval.bench.judge.runner import JudgeRunConfig, run_judges
from kvsplice.eval.bench.mode_variants import ModeVariant
from kvsplice.eval.measure.jcr import JudgeRecord
from kvsplice.eval.workloads.judge_examples import JudgeExample

logger = logging.getLogger(__name__)

DENSE = "dense"
# The knob of a mode's deeper pass (crossfix's `deep`): such a mode gets staged candidates.
DEEP = "deep_check"
# the knobs a two-pass spec sets itself; a probe's other parameters carry over
STAGE_KNOBS = ("check", "deep", "margin", "deep_margin")


@dataclass(frozen=True)
class JudgeThresholds:
    """Admit for judges when the held-out guarded JCR on the probes is >= `min_jcr` and
    something is reused; the guard's margin is `margin_safety` x the largest margin of a
    flipped probe."""

    min_jcr: float = 0.98
    margin_safety: float = 1.25

    def __post_init__(self) -> None:
        if not 0 <= self.min_jcr <= 1:
            raise ValueError(f"min_jcr {self.min_jcr} not in [0, 1]")
        if not self.margin_safety >= 1:
            raise ValueError(f"margin_safety {self.margin_safety} must be >= 1")


@dataclass(frozen=True)
class JudgeProbe:
    """One candidate on the probes. `spec`: its variant with the guard off; `min_margin`: the
    guard calibrated for it on every probe; `jcr`, `kept`, `reuse`: the held-out guarded
    replay (`held_out_replay`; kept: share of calls that keep the cheap prefill; reuse:
    candidate-block token·layers not computed); `raw_jcr`: unguarded;
    `ceiling`: what a call its cheapest pass keeps reuses (ties in `reuse` go to the higher);
    `pass_kept`: per pass, cheapest first, the share of the calls reaching it that it kept
    (what the gate's cost model weighs each pass's work by)."""

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
    ceiling: float = 0.0
    pass_kept: tuple[float, ...] = ()


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
    """`margin_safety` x the largest margin of a flipped probe, rounded up to 0.05 logits and
    strictly above that margin (a flipped call never keeps its prefill); 0 when none flipped."""
    flipped = max((r.margin for r in records if not r.consistent), default=None)
    if flipped is None:
        return 0.0
    bound = math.ceil(flipped * thresholds.margin_safety * 20 - 1e-9) / 20
    return bound if bound > flipped else bound + 0.05


def folds(records: Sequence[JudgeRecord]) -> tuple[list[int], list[int]]:
    """Indices of `records` in two folds by example (every order of an example in one fold;
    examples sorted by id, alternating)."""
    ids = sorted({r.example_id for r in records})
    first = set(ids[::2])
    a = [i for i, r in enumerate(records) if r.example_id in first]
    return a, [i for i, r in enumerate(records) if r.example_id not in first]


def held_out_replay(
    passes: Sequence[Sequence[JudgeRecord]], thresholds: JudgeThresholds
) -> tuple[float, float, float]:
    """(JCR, kept share, reuse) of one candidate's passes (one, or a cheap and a deeper one
    over the same calls), each fold replayed with the guards calibrated on the other fold."""
    n = len(passes[0])
    if not n or any(len(p) != n for p in passes):
        raise ValueError("the passes need the same, non-empty calls")
    totals = [0.0, 0.0, 0.0]
    for mine, other in itertools.permutations(folds(passes[0]), 2):
        if not mine:
            continue
        margins = tuple(calibrated_margin([p[i] for i in other], thresholds) for p in passes)
        fold = [[p[i] for i in mine] for p in passes]
        if len(fold) == 1:
            figures = guard(fold[0], margins[0])
        else:
            figures = staged_replay(fold[0], fold[1], (margins[0], margins[1]))
        totals = [t + f * len(mine) for t, f in zip(totals, figures, strict=True)]
    jcr, kept, reuse = (t / n for t in totals)
    return jcr, kept, reuse


def judge_probe(
    mode: str, spec: str, records: Sequence[JudgeRecord], thresholds: JudgeThresholds
) -> JudgeProbe:
    """The figures of one candidate from its records (its guard off) and the verdict."""
    min_margin = calibrated_margin(records, thresholds)
    jcr, kept, reuse = held_out_replay((records,), thresholds)
    raw_jcr = sum(r.consistent for r in records) / len(records)
    admitted = jcr >= thresholds.min_jcr and reuse > 0
    largest = max(margin_error(r) for r in records)
    ceiling = max(record_reuse(r) for r in records)
    return JudgeProbe(
        mode, spec, len(records), largest, min_margin, raw_jcr, jcr, kept, reuse, admitted, ceiling,
        (guard(records, min_margin)[1],),
    )  # fmt: skip


def staged_replay(
    cheap: Sequence[JudgeRecord], deep: Sequence[JudgeRecord], margins: tuple[float, float]
) -> tuple[float, float, float]:
    """(JCR, kept share, reuse) of two passes over the same calls: the cheap one kept at
    `margins[0]`, else the deeper one at `margins[1]`, else dense (consistent, no reuse)."""
    if len(cheap) != len(deep) or not cheap:
        raise ValueError("the two passes need the same, non-empty calls")
    consistent = kept = 0
    reuse = 0.0
    for first, second in zip(cheap, deep, strict=True):
        if (first.example_id, first.order) != (second.example_id, second.order):
            raise ValueError(f"records {first.example_id} and {second.example_id} differ")
        chosen = next(
            (r for r, m in ((first, margins[0]), (second, margins[1])) if r.margin >= m), None
        )
        consistent += 1 if chosen is None else int(chosen.consistent)
        kept += chosen is not None
        reuse += 0.0 if chosen is None else record_reuse(chosen)
    n = len(cheap)
    return consistent / n, kept / n, reuse / n


def staged_pass_kept(
    cheap: Sequence[JudgeRecord], deep: Sequence[JudgeRecord], margins: tuple[float, float]
) -> tuple[float, float]:
    """(share of the calls the cheap pass keeps, share of the rest the deeper pass keeps)."""
    first = [a.margin >= margins[0] for a in cheap]
    rest = [b.margin >= margins[1] for a, b in zip(first, deep, strict=True) if not a]
    return sum(first) / len(first), (sum(rest) / len(rest) if rest else 0.0)


def staged_probes(
    probes: Sequence[JudgeProbe],
    records: Mapping[str, Sequence[JudgeRecord]],
    checks: Mapping[str, int],
    thresholds: JudgeThresholds,
) -> list[JudgeProbe]:
    """Two-pass candidates from one mode's single-pass probes (keyed by spec in `records`
    and `checks`: each spec's check layer), every cheaper check before every deeper one;
    the cheap probe's other parameters (e.g. `q=1`) stay in the two-pass spec."""
    staged = []
    for cheap, deep in itertools.permutations(probes, 2):
        if checks[cheap.spec] >= checks[deep.spec]:
            continue
        margins = (cheap.min_margin, deep.min_margin)
        passes = (records[cheap.spec], records[deep.spec])
        jcr, kept, reuse = held_out_replay(passes, thresholds)
        spec = (
            f"{cheap.mode}:check={checks[cheap.spec]}+deep={checks[deep.spec]}"
            f"+deep_margin={deep.min_margin:g}{_other_params(cheap.spec)}+margin=0"
        )
        staged.append(
            JudgeProbe(
                cheap.mode, spec, cheap.num_probes, max(cheap.max_error, deep.max_error),
                cheap.min_margin, cheap.raw_jcr, jcr, kept, reuse,
                jcr >= thresholds.min_jcr and reuse > 0, cheap.ceiling,
                staged_pass_kept(records[cheap.spec], records[deep.spec], margins),
            )
        )  # fmt: skip
    return staged


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
    singles = [judge_probe(mode, spec, records[spec], thresholds) for mode, spec in candidates]
    return singles + _staged(singles, records, thresholds)


def _staged(
    singles: Sequence[JudgeProbe],
    records: Mapping[str, Sequence[JudgeRecord]],
    thresholds: JudgeThresholds,
) -> list[JudgeProbe]:
    """Two-pass candidates of every mode with a deeper pass, from its single-check probes."""
    staged = []
    for mode in dict.fromkeys(p.mode for p in singles):
        defaults = mode_spec(mode).params_type()
        if not hasattr(defaults, DEEP):
            continue
        checks = {}
        for probe in singles:
            if probe.mode == mode:
                params = ModeVariant.parse(probe.spec).apply(defaults)
                if getattr(params, DEEP) == 0 and getattr(params, "ratio", 0) == 0:
                    checks[probe.spec] = params.check_layer
        mine = [p for p in singles if p.spec in checks]
        staged += staged_probes(mine, records, checks, thresholds)
    return staged


def _other_params(spec: str) -> str:
    """`spec`'s parameters a two-pass spec does not set itself, each as "+name=value"."""
    params = ModeVariant.parse(spec).params
    return "".join(f"+{n}={format_value(v)}" for n, v in params if n not in STAGE_KNOBS)
