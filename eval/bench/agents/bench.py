"""`kvsplice bench agents`: a workload through the agent pipeline in each mode variant, measured.

Owns `make_workload`, `run_bench_agents` and `run_bench_layouts` (load or take a model,
open the store, run the modes, aggregate, write files) of a `BenchAgentsConfig` (`config`).
The protocol is `mode_runner`'s; the record is `result`'s; the files are `report`'s.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from kvsplice.agents.render import Tokenizer
from kvsplice.client.model.models import LoadedModel, load_model
from kvsplice.common.reuse_modes import DENSE
from kvsplice.eval.bench.agents.config import BenchAgentsConfig
from kvsplice.eval.bench.agents.report import capacity_warning, write_bench_files
from kvsplice.eval.bench.agents.result import BenchResult
from kvsplice.eval.bench.mode_runner import ProgressFn, run_modes
from kvsplice.eval.bench.store_session import namespace_stats, open_store
from kvsplice.eval.measure.environment import environment_info
from kvsplice.eval.measure.machine_load import warn_if_busy
from kvsplice.eval.measure.metrics import aggregate
from kvsplice.eval.report.layout_compare import compare_layouts, write_layout_files
from kvsplice.eval.workloads.humaneval import HumanEvalWorkload
from kvsplice.eval.workloads.math_problems import MATH_SAMPLE, Gsm8kWorkload, MathWorkload
from kvsplice.eval.workloads.multiple_choice import (
    MC_SAMPLE,
    MmluWorkload,
    MultipleChoiceWorkload,
)
from kvsplice.eval.workloads.synthetic import SyntheticConfig, SyntheticWorkload
from kvsplice.eval.workloads.workload import Workload

logger = logging.getLogger(__name__)


def make_workload(config: BenchAgentsConfig, tokenizer: Tokenizer) -> Workload:
    """The workload `config.workload` names, with its data file or synthetic shape."""
    if config.workload == "synthetic":
        shape = SyntheticConfig(
            config.prefix_len, config.input_len, config.response_len, config.seed
        )
        return SyntheticWorkload(tokenizer, shape)
    if config.workload == "humaneval":
        return HumanEvalWorkload()
    if config.workload == "math":
        return MathWorkload(config.data_path or MATH_SAMPLE)
    if config.workload == "gsm8k":
        return Gsm8kWorkload(seed=config.seed)
    if config.workload == "mmlu":
        return MmluWorkload(seed=config.seed)
    return MultipleChoiceWorkload(config.data_path or MC_SAMPLE)


def run_bench_agents(
    config: BenchAgentsConfig,
    loaded: LoadedModel | None = None,
    progress: ProgressFn | None = None,
) -> BenchResult:
    """Run the benchmark and write results.json, results.md and the plots to `config.out_dir`.

    `loaded` None loads `config.model`. Raises `ValueError` when the workload
    has fewer problems than `config.samples`.
    """
    loaded = loaded or load_model(config.model)
    warn_if_busy()
    workload = make_workload(config, loaded.tokenizer)
    problems = workload.problems(config.samples)
    if len(problems) < config.samples:
        raise ValueError(
            f"{workload.name} has {len(problems)} problems, {config.samples} requested"
        )
    run_config = config.mode_run_config(time.strftime("%Y%m%dT%H%M%S") + "-" + secrets.token_hex(2))
    start_s = time.perf_counter()
    with open_store(config.store_target, memory_bytes=config.store_memory_mib << 20) as store:
        records = run_modes(loaded, workload, problems, run_config, store.target, progress)
        namespaces = {m: run_config.namespace_of(m) for m in run_config.modes if m != DENSE}
        by_namespace = namespace_stats(store.target, list(namespaces.values()), config.store_token)
    result = BenchResult(
        config=config,
        environment=environment_info(loaded),
        records=records,
        aggregates=aggregate(records),
        wall_s=time.perf_counter() - start_s,
        namespaces=namespaces,
        store_stats={mode: by_namespace[ns] for mode, ns in namespaces.items()},
    )
    if (warning := capacity_warning(result)) is not None:
        logger.warning("%s", warning)
    result.files = write_bench_files(result, config.out_dir)
    return result


def run_bench_layouts(
    config: BenchAgentsConfig,
    layouts: Sequence[str],
    loaded: LoadedModel | None = None,
    progress: ProgressFn | None = None,
) -> tuple[list[BenchResult], dict[str, Path]]:
    """`config` once per layout (same problems, results in `out_dir/<layout>/`), then the
    side-by-side comparison in `out_dir` (layouts.md, layouts.json); returns both.
    """
    loaded = loaded or load_model(config.model)
    results = []
    for layout in layouts:
        layout_config = replace(config, layout=layout, out_dir=config.out_dir / layout)
        results.append(run_bench_agents(layout_config, loaded, progress))
    rows = compare_layouts([(r.config.layout, r.aggregates, r.records) for r in results])
    return results, write_layout_files(rows, config.out_dir)
