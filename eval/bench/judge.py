"""`kvsplice bench judge`: judge examples in each mode and measure JCR against dense.

Owns `BenchJudgeResult` and `run_bench_judge` of a `BenchJudgeConfig` (`judge_config`)
(load or take a model, pick the examples, open the store, run, summarize, write
files). The protocol is `judge_runner`'s; figures `jcr`'s; files `judge_report`'s.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvsplice.client.model.models import LoadedModel, load_model
from kvsplice.eval.bench.judge_config import BenchJudgeConfig
from kvsplice.eval.bench.judge_runner import JudgeRun, run_judges
from kvsplice.eval.bench.mode_runner import ProgressFn
from kvsplice.eval.bench.store_session import open_store
from kvsplice.eval.measure.environment import environment_info
from kvsplice.eval.measure.jcr import ModeSummary, summarize
from kvsplice.eval.measure.judge_attention import AttentionProbe, AttentionProfile
from kvsplice.eval.measure.machine_load import warn_if_busy
from kvsplice.eval.workloads.judge_examples import JudgeExample, load_judge_data, task_examples

logger = logging.getLogger(__name__)


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


def pick_examples(config: BenchJudgeConfig) -> list[JudgeExample]:
    """The first `config.examples` examples of the data file or of the task's sample."""
    if config.data_path is None:
        return task_examples(config.task or "gsm8k", config.examples)
    examples = load_judge_data(config.data_path)
    if config.task is not None:
        examples = [e for e in examples if e.task == config.task]
    if not examples:
        raise ValueError(
            f"{config.data_path} has no {config.task or ''} examples".replace("  ", " ")
        )
    return examples[: config.examples]


def run_bench_judge(
    config: BenchJudgeConfig, loaded: LoadedModel | None = None, progress: ProgressFn | None = None
) -> BenchJudgeResult:
    """Run the bench; write results.json, results.md and the plots to `config.out_dir`
    (and the JSON also to `config.json_path` when set)."""
    from kvsplice.eval.report.judge_report import write_judge_files

    loaded = loaded or load_model(config.model)
    warn_if_busy()
    examples = pick_examples(config)
    run_config = config.run_config(time.strftime("%Y%m%dT%H%M%S") + "-" + secrets.token_hex(2))
    probe = AttentionProbe(loaded) if config.diagnostics else None
    start_s = time.perf_counter()
    with open_store(config.store_target, memory_bytes=config.store_memory_mib << 20) as store:
        run = run_judges(loaded, examples, run_config, store.target, progress, probe)
    result = BenchJudgeResult(
        config=config,
        environment=environment_info(loaded),
        run=run,
        summaries=summarize(run.records),
        attention=[] if probe is None else probe.profiles(),
        wall_s=time.perf_counter() - start_s,
        examples=examples,
    )
    result.files = write_judge_files(result)
    return result
