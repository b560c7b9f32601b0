"""The files and tables of a `bench agents` run: results.json, results.md, plots, the CLI's view.

Owns the results.md text (setup, protocol, the TTFT, fidelity and per-sample tables), the
store-capacity warning, `write_bench_files` and `render_bench_agents`. The rows and formats
are `report.results`'; the images `report.plots`'; the JSON layout `result.BenchResult`'s.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import RenderableType
from rich.text import Text

from kvsplice.eval.bench.agents.result import BenchResult
from kvsplice.eval.report.plots import write_plots
from kvsplice.eval.report.results import (
    MODE_HEADERS,
    POSITION_HEADERS,
    decision_lines,
    markdown_table,
    mode_rows,
    position_rows,
    rich_table,
    sample_rows,
    write_json,
)

if TYPE_CHECKING:
    from kvsplice.client.modes.admission import AdmissionPolicy

logger = logging.getLogger(__name__)

RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"
PROTOCOL = (
    "Each mode variant runs against a fresh store namespace (variants never feed each other); "
    "one untimed warm-up sample per variant runs first in a throwaway namespace; variants are "
    "interleaved per sample (dense first) and samples run in sequence, so later samples "
    "may reuse earlier samples' template segments. TTFT covers everything up to the first "
    "token (lookups, fetch, decode, shift, base prefill, splice, prefill, first decode). "
    "Fidelity compares each call with dense prefill of the identical prompt on the same "
    "model, computed outside the call's TTFT; a dense-mode call is its own reference. "
    "Speedups are ratios of median TTFTs against dense in the same run. Token·layer reuse "
    "is the share of prompt tokens × layers whose K/V was reused rather than computed."
)


def results_markdown(result: BenchResult) -> str:
    """results.md: the setup, the per agent × mode TTFT table and the per-mode fidelity table."""
    config, env = result.config, result.environment
    setup = (
        f"{config.num_agents} agents, {config.graph} graph, {config.samples} samples, "
        f"modes {', '.join(config.modes)}, payload quant `{config.quant}`, reference `{config.reference}`."
        f" Variant parameters from {_policy_source(config.policy_path, config.admission)}."
    )
    if config.workload == "synthetic":
        setup += f" Synthetic shape: prefix {config.prefix_len}, input {config.input_len}, response {config.response_len} tokens."
    else:
        setup += f" Each agent generates at most {config.max_new_tokens} tokens."
    machine = (
        f"CPU {env.get('cpu')} ({env.get('num_cpus')} cores, {env.get('torch_num_threads')} torch threads, "
        f"load average {env.get('load_average')} at the end), GPU {env.get('gpu') or 'none'}, torch {env.get('torch')}, "
        f"{env.get('dtype')}, attention {env.get('attn_implementation')}, model `{env.get('model_fingerprint')}`."
    )
    if env.get("busy_machine_warning"):
        machine += f" **Warning: {env['busy_machine_warning']}.**"
    return "\n\n".join([
        f"# kvsplice bench agents: {config.workload}", setup, machine, PROTOCOL,
        "## TTFT per agent and mode",
        markdown_table(POSITION_HEADERS, position_rows(result.aggregates, result.records)),
        "## Fidelity per mode (vs dense prefill of the identical prompt)",
        markdown_table(MODE_HEADERS, mode_rows(result.aggregates)),
        "## Per sample (token reuse · 1st-token agreement; pools and prefixes fill first)",
        markdown_table(*sample_rows(result.records)),
        *decision_lines(result.aggregates),
        *capacity_lines(result),
        f"Wall time {result.wall_s:.0f} s.",
    ]) + "\n"  # fmt: skip


def capacity_warning(result: BenchResult) -> str | None:
    """One sentence naming the modes whose store namespace evicted or refused segments."""
    losses = result.capacity_losses()
    if not losses:
        return None
    modes = ", ".join(f"{m} ({e} evicted, {r} refused)" for m, (e, r) in losses.items())
    return (
        f"The store lost segments during the run: {modes}. Those modes' reuse and speedup are "
        f"understated; rerun with a larger --store-memory-mib (this run: "
        f"{result.config.store_memory_mib})."
    )


def capacity_lines(result: BenchResult) -> list[str]:
    warning = capacity_warning(result)
    return [] if warning is None else ["## Store capacity", f"**{warning}**"]


def _policy_source(path: Path | None, admission: AdmissionPolicy | None) -> str:
    if path is not None:
        return f"admission policy `{path}`"
    return "the built-in defaults" if admission is None else "a given admission policy"


def write_bench_files(result: BenchResult, out_dir: Path) -> dict[str, Path]:
    """results.json, results.md and the PNG plots in `out_dir`; name → path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"json": write_json(out_dir / RESULTS_JSON, result.to_dict())}
    files["markdown"] = out_dir / RESULTS_MD
    files["markdown"].write_text(results_markdown(result), encoding="utf-8")
    files.update(write_plots(result.aggregates, out_dir, title=result.config.workload))
    logger.info("wrote %s", ", ".join(str(p) for p in files.values()))
    return files


def render_bench_agents(result: BenchResult) -> list[RenderableType]:
    """The CLI's view of a run: the two tables, then where the files are."""
    files = "\n".join(f"  {name}: {path}" for name, path in result.files.items())
    return [
        rich_table(f"TTFT per agent: {result.config.workload}", POSITION_HEADERS,
                   position_rows(result.aggregates, result.records)),
        rich_table("Fidelity per mode (vs dense prefill of the same prompt)", MODE_HEADERS,
                   mode_rows(result.aggregates)),
        *([] if (warning := capacity_warning(result)) is None else [Text(warning, style="bold yellow")]),
        Text(f"wall time {result.wall_s:.0f} s; files:\n{files}"),
    ]  # fmt: skip
