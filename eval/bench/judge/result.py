"""What a `bench judge` run measured (`BenchJudgeResult`), and its `--json` document.

Both the run (`bench`) and its files (`report`) import it; it knows nothing of either.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvsplice.eval.bench.judge.config import BenchJudgeConfig
from kvsplice.eval.bench.judge.runner import JudgeRun
from kvsplice.eval.measure.jcr import ModeSummary
from kvsplice.eval.measure.judge_attention import AttentionProfile
from kvsplice.eval.workloads.judge_examples import JudgeExample


@dataclass
class BenchJudgeResult:
    """What a run measured: per-mode summaries, the records, attention profiles, files;
    `examples`: what was judged, in order."""

    config: BenchJudgeConfig
    environment: dict[str, object]
    run: JudgeRun
    summaries: list[ModeSummary]
    attention: list[AttentionProfile]
    wall_s: float
    examples: list[JudgeExample] = field(default_factory=list)
    files: dict[str, Path] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        """The `--json` document: {"modes": [{"mode", "jcr", "coverage",
        "candidate_token_layer_reuse", "speedup", "examples", ...}], ...}."""
        config = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self.config).items()}
        config["model"] = {k: str(v) for k, v in asdict(self.config.model).items()}
        admission = self.config.admission
        config["admission"] = None if admission is None else json.loads(admission.to_json())
        return {
            "modes": [s.to_dict() for s in self.summaries],
            "order": "shuffled" if self.config.shuffle else "fixed",
            "config": config,
            "environment": self.environment,
            "wall_s": self.wall_s,
            "examples": [
                {"id": i, "order": list(self.run.orders[i].agent_ids),
                 "candidates": dict(c.texts), "correct": dict(c.correct)}
                for i, c in self.run.candidates.items()
            ],
            "records": [r.to_dict() for r in self.run.records],
            "attention": [p.to_dict() for p in self.attention],
        }  # fmt: skip
