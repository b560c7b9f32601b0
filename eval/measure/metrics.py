"""Per-call records and their aggregates: TTFT, speedup vs dense, reuse rates, fidelity, accuracy.

Owns `CallRecord` (one agent call, tensor-free, JSON-ready), `GroupStats` and
`aggregate`. Pure Python: computing fidelity from logits is `fidelity`'s job.
Speedups are ratios of median TTFTs measured in the same run against dense.
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import cast

from kvsplice.common.reuse_modes import DENSE
from kvsplice.common.reuse_report import token_hit_rate

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CallRecord:
    """One agent call of one sample in one mode, with its fidelity against dense.

    mode: the mode variant's label (`blend:r=0.43`). position: 1-based index of
    the call in the pipeline (agent position). num_layers: the model's layer
    count (0: unknown, as in records written before it was kept).
    Fidelity fields are None where no reference was computed; a dense-mode call
    is its own reference. `correct` is set on the final call when the workload
    can score it. `reference_ttft_s` (the dense reference's time) is never part
    of `ttft_s`.
    """

    workload: str
    mode: str
    sample_index: int
    problem_id: str
    position: int
    agent_id: str
    agent_name: str
    round: int
    num_prompt_tokens: int
    num_reused_tokens: int
    num_output_tokens: int
    ttft_s: float
    num_layers: int = 0
    first_token_agrees: bool | None = None
    kl_dense_reuse: float | None = None
    max_abs_logit_diff: float | None = None
    output_matches: bool | None = None
    correct: bool | None = None
    reference_ttft_s: float | None = None
    timings_s: Mapping[str, float] = field(default_factory=dict)
    reused_spans: tuple[Mapping[str, object], ...] = ()
    output_text: str = ""
    decisions: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.position < 1:
            raise ValueError(f"position {self.position} must be >= 1")
        if not 0 <= self.num_reused_tokens <= self.num_prompt_tokens:
            raise ValueError(
                f"num_reused_tokens {self.num_reused_tokens} outside [0, {self.num_prompt_tokens}]"
            )
        if self.ttft_s < 0:
            raise ValueError(f"ttft_s {self.ttft_s} must be >= 0")
        if self.num_layers < 0:
            raise ValueError(f"num_layers {self.num_layers} must be >= 0")

    @property
    def reuse_rate(self) -> float:
        """Reused tokens / prompt tokens of this call."""
        return self.num_reused_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    @property
    def num_reused_token_layers(self) -> int:
        """Σ tokens × layers whose K/V the reused spans supplied (a span without a count: 0)."""
        return sum(
            cast(int, s["num_tokens"]) * cast(int, s.get("num_layers", 0))
            for s in self.reused_spans
        )

    @property
    def num_prompt_token_layers(self) -> int:
        """The prefill's per-layer work: prompt tokens × layers (0 when `num_layers` is unknown)."""
        return self.num_prompt_tokens * self.num_layers

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["timings_s"] = dict(self.timings_s)
        data["reused_spans"] = [dict(s) for s in self.reused_spans]
        data["decisions"] = dict(self.decisions)
        return data


@dataclass(frozen=True)
class GroupStats:
    """Aggregates of one mode at one agent position (`position` None: all positions).

    speedup: dense's median TTFT / this group's median TTFT at the same position;
    over all positions, Σ_pos median dense / Σ_pos median mode (how much less the
    pipeline waits for first tokens). Rates are fractions in [0, 1].
    token_layer_reuse_rate: Σ reused token·layers / Σ prompt token·layers, the
    share of the prefill's per-layer work not computed (multicut at half depth
    counts half a span); None when no call knows its layer count.
    """

    mode: str
    position: int | None
    num_calls: int
    mean_prompt_tokens: float
    mean_ttft_s: float
    median_ttft_s: float
    speedup: float | None
    token_reuse_rate: float
    call_reuse_rate: float
    token_layer_reuse_rate: float | None
    first_token_agreement: float | None
    mean_kl: float | None
    max_kl: float | None
    output_match: float | None
    accuracy: float | None
    num_scored: int
    mean_timings_s: Mapping[str, float] = field(default_factory=dict)
    decision_counts: Mapping[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["mean_timings_s"] = dict(self.mean_timings_s)
        data["decision_counts"] = dict(self.decision_counts)
        return data


@dataclass(frozen=True)
class Aggregates:
    by_position: tuple[GroupStats, ...]
    by_mode: tuple[GroupStats, ...]

    def to_dict(self) -> dict[str, object]:
        return {
            "by_position": [g.to_dict() for g in self.by_position],
            "by_mode": [g.to_dict() for g in self.by_mode],
        }

    def at(self, mode: str, position: int | None = None) -> GroupStats | None:
        groups = self.by_mode if position is None else self.by_position
        return next((g for g in groups if g.mode == mode and g.position == position), None)


def aggregate(records: Sequence[CallRecord]) -> Aggregates:
    """Group `records` per (mode, position) and per mode; modes keep their first-seen order."""
    modes = list(dict.fromkeys(r.mode for r in records))
    positions = sorted({r.position for r in records})
    dense_medians = _median_ttft_by_position(r for r in records if r.mode == DENSE)
    by_position = []
    for mode in modes:
        for position in positions:
            group = [r for r in records if r.mode == mode and r.position == position]
            if group:
                by_position.append(
                    _stats(mode, position, group, _speedup_at(position, group, dense_medians))
                )
    by_mode = []
    for mode in modes:
        group = [r for r in records if r.mode == mode]
        by_mode.append(_stats(mode, None, group, pipeline_speedup(group, dense_medians)))
    return Aggregates(tuple(by_position), tuple(by_mode))


@dataclass(frozen=True)
class SampleStats:
    """One mode over the calls of one sample (0-based `sample_index`, all agents).

    Shows how reuse grows as a run goes on: exact prefixes and anchor pools fill
    with the first samples, so the later samples are the steady state.
    """

    mode: str
    sample_index: int
    num_calls: int
    token_reuse_rate: float
    first_token_agreement: float | None
    mean_kl: float | None


def by_sample(records: Sequence[CallRecord]) -> tuple[SampleStats, ...]:
    """Per (mode, sample index), modes in first-seen order, samples ascending."""
    groups: dict[tuple[str, int], list[CallRecord]] = {}
    for record in records:
        groups.setdefault((record.mode, record.sample_index), []).append(record)
    modes = list(dict.fromkeys(r.mode for r in records))
    stats = []
    for (mode, index), group in sorted(
        groups.items(), key=lambda i: (modes.index(i[0][0]), i[0][1])
    ):
        kls = _present(group, lambda r: r.kl_dense_reuse)
        stats.append(SampleStats(
            mode, index, len(group),
            _ratio(sum(r.num_reused_tokens for r in group), sum(r.num_prompt_tokens for r in group))
            or 0.0,
            _fraction(_present(group, lambda r: r.first_token_agrees)),
            statistics.fmean(kls) if kls else None,
        ))  # fmt: skip
    return tuple(stats)


def pipeline_speedup(
    group: Sequence[CallRecord], dense_medians: Mapping[int, float]
) -> float | None:
    """Σ_pos median dense TTFT / Σ_pos median TTFT of `group`, over positions both have."""
    medians = _median_ttft_by_position(group)
    shared = [p for p in medians if p in dense_medians]
    if not shared:
        return None
    return _ratio(sum(dense_medians[p] for p in shared), sum(medians[p] for p in shared))


def _speedup_at(
    position: int, group: Sequence[CallRecord], dense_medians: Mapping[int, float]
) -> float | None:
    if position not in dense_medians:
        return None
    return _ratio(dense_medians[position], statistics.median(r.ttft_s for r in group))


def _median_ttft_by_position(records: Iterable[CallRecord]) -> dict[int, float]:
    ttfts: dict[int, list[float]] = {}
    for record in records:
        ttfts.setdefault(record.position, []).append(record.ttft_s)
    return {position: statistics.median(values) for position, values in ttfts.items()}


def _stats(
    mode: str, position: int | None, group: Sequence[CallRecord], speedup: float | None
) -> GroupStats:
    ttfts = [r.ttft_s for r in group]
    kls = _present(group, lambda r: r.kl_dense_reuse)
    scored = _present(group, lambda r: r.correct)
    return GroupStats(
        mode=mode,
        position=position,
        num_calls=len(group),
        mean_prompt_tokens=statistics.fmean(r.num_prompt_tokens for r in group),
        mean_ttft_s=statistics.fmean(ttfts),
        median_ttft_s=statistics.median(ttfts),
        speedup=speedup,
        token_reuse_rate=token_hit_rate(
            sum(r.num_reused_tokens for r in group), sum(r.num_prompt_tokens for r in group)
        )
        or 0.0,
        call_reuse_rate=_fraction([r.num_reused_tokens > 0 for r in group]) or 0.0,
        token_layer_reuse_rate=_ratio(
            sum(r.num_reused_token_layers for r in group if r.num_layers),
            sum(r.num_prompt_token_layers for r in group),
        ),
        first_token_agreement=_fraction(_present(group, lambda r: r.first_token_agrees)),
        mean_kl=statistics.fmean(kls) if kls else None,
        max_kl=max(kls) if kls else None,
        output_match=_fraction(_present(group, lambda r: r.output_matches)),
        accuracy=_fraction(scored),
        num_scored=len(scored),
        mean_timings_s=_mean_timings(group),
        decision_counts=decision_counts(group),
    )


def decision_counts(group: Sequence[CallRecord]) -> dict[str, int]:
    """How often each policy decision was taken: "anchor_gate=ambiguous" → calls, sorted."""
    counts = Counter(f"{k}={v}" for r in group for k, v in r.decisions.items())
    return dict(sorted(counts.items()))


def _present(group: Sequence[CallRecord], value: Callable[[CallRecord], object]) -> list:
    return [v for v in map(value, group) if v is not None]


def _fraction(flags: Sequence[bool]) -> float | None:
    return sum(bool(f) for f in flags) / len(flags) if flags else None


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def _mean_timings(group: Sequence[CallRecord]) -> dict[str, float]:
    stages = dict.fromkeys(stage for r in group for stage in r.timings_s)
    return {stage: statistics.fmean(r.timings_s.get(stage, 0.0) for r in group) for stage in stages}
