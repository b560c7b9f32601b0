"""`kvsplice bench judge`: judge examples in each mode and measure JCR against dense.

Owns `pick_examples` and `run_bench_judge` of a `BenchJudgeConfig` (`config`) (load or take
a model, pick the examples, open the store, run, summarize, write files). The protocol is
`runner`'s; the record `result`'s; figures `jcr`'s; files `report`'s.
"""

from __future__ import annotations

import logging
import secrets
import time

from kvsplice.client.model.models import LoadedModel, load_model
from kvsplice.eval.bench.judge.config import BenchJudgeConfig
from kvsplice.eval.bench.judge.report import write_judge_files
from kvsplice.eval.bench.judge.result import BenchJudgeResult
from kvsplice.eval.bench.judge.runner import run_judges
from kvsplice.eval.bench.mode_runner import ProgressFn
from kvsplice.eval.bench.store_session import open_store
from kvsplice.eval.measure.environment import environment_info
from kvsplice.eval.measure.jcr import summarize
from kvsplice.eval.measure.judge_attention import AttentionProbe
from kvsplice.eval.measure.machine_load import warn_if_busy
from kvsplice.eval.workloads.judge_examples import JudgeExample, load_judge_data, task_examples

logger = logging.getLogger(__name__)


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
