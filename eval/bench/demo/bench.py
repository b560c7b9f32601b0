"""`kvsplice demo`: five agents on a few HumanEval problems in each mode, with a store beside them.

Owns `DemoResult`, `run_agents_demo` and `render_demo` (its `DemoConfig`: `config`). It runs
the same protocol as `bench agents` (see `mode_runner`) with an embedded store
on LMDB under `out_dir` and its admin API, and reduces the records to one row
per agent: dense TTFT, each mode's TTFT, speedup, reuse, agreement, match.
"""

from __future__ import annotations

import logging
import secrets
import shutil
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from kvsplice.client.model.models import LoadedModel, load_model
from kvsplice.client.modes.admission import load_policy
from kvsplice.common.namespace_stats import NamespaceStats
from kvsplice.common.reuse_modes import DENSE, EXACT, GATED, NAIVE
from kvsplice.common.reuse_report import SERVED
from kvsplice.common.units import human_bytes
from kvsplice.eval.bench.demo.config import DemoConfig
from kvsplice.eval.bench.demo.judge import DemoJudge, judge_table, routes_table, run_demo_judge
from kvsplice.eval.bench.mode_runner import ProgressFn, run_modes
from kvsplice.eval.bench.store_session import (
    StoreSession,
    namespace_stats,
    open_store,
    stats_json,
)
from kvsplice.eval.measure.environment import environment_info
from kvsplice.eval.measure.machine_load import warn_if_busy
from kvsplice.eval.measure.metrics import Aggregates, CallRecord, aggregate
from kvsplice.eval.report.plots import TTFT_PNG, plot_ttft
from kvsplice.eval.report.results import (
    MODE_HEADERS,
    agent_labels,
    fmt_ms,
    fmt_pct,
    fmt_x,
    mode_rows,
    rich_table,
    write_json,
)
from kvsplice.eval.workloads.humaneval import HumanEvalWorkload

logger = logging.getLogger(__name__)

DEMO_JSON = "demo.json"
STORE_DIR = "store-lmdb"


@dataclass(frozen=True)
class DemoAgentRow:
    """One agent position; dicts are keyed by mode (dense included, speedup 1.0)."""

    position: int
    label: str
    dense_ttft_s: float
    ttft_s: dict[str, float]
    speedup: dict[str, float | None]
    reuse_rate: dict[str, float]
    first_token_agreement: dict[str, float | None]
    output_match: dict[str, float | None]


@dataclass
class DemoResult:
    config: DemoConfig
    rows: list[DemoAgentRow]
    aggregates: Aggregates
    records: list[CallRecord]
    wall_s: float
    namespaces: dict[str, str]
    store_stats: dict[str, NamespaceStats | None]
    stats_hints: list[str]
    json_path: Path
    chart_path: Path
    environment: dict[str, object] = field(default_factory=dict)
    judge: DemoJudge | None = None
    _store: ExitStack | None = field(default=None, repr=False)

    def close(self) -> None:
        """Stop the embedded store kept serving by `keep_store` (no-op otherwise)."""
        if self._store is not None:
            self._store.close()
            self._store = None


def run_agents_demo(
    config: DemoConfig, progress: ProgressFn | None = None, loaded: LoadedModel | None = None
) -> DemoResult:
    """Run the demo; writes `demo.json` and `ttft_per_agent.png` to `config.out_dir`.

    With `config.keep_store` an embedded store keeps serving (admin API included)
    until `result.close()`; otherwise it is stopped before this returns.
    """
    loaded = loaded or load_model(config.model)
    warn_if_busy()
    workload = HumanEvalWorkload()
    problems = workload.problems(config.num_problems)
    admission = load_policy(config.policy_path, loaded.fingerprint)
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + secrets.token_hex(2)
    run_config = config.mode_run_config(run_id, admission)
    namespaces = {m: run_config.namespace_of(m) for m in run_config.modes if m != DENSE}
    start_s = time.perf_counter()
    with ExitStack() as stack:
        store = stack.enter_context(
            open_store(config.store_target, lmdb_path=_fresh_store_dir(config), admin=True)
        )
        records = run_modes(loaded, workload, problems, run_config, store.target, progress)
        judge = None
        if config.judge:
            judge = run_demo_judge(
                loaded, records, problems, store.target, admission,
                namespace=f"demo-judge-{run_id}", store_token=config.store_token,
                max_new_tokens=config.max_new_tokens,
                # the judge continues the pipeline's conversation where the pipeline has one
                layout="transcript" if config.layout == "transcript" else "persona-first",
            )  # fmt: skip
        stats = namespace_stats(store.target, list(namespaces.values()), config.store_token)
        kept = stack.pop_all() if config.keep_store and store.embedded else None
    aggregates = aggregate(records)
    result = DemoResult(
        config=config, rows=agent_rows(aggregates, records, run_config.modes), aggregates=aggregates,
        records=records, wall_s=time.perf_counter() - start_s, namespaces=namespaces, store_stats=stats,
        stats_hints=stats_hints(store, namespaces, live=kept is not None), json_path=config.out_dir / DEMO_JSON,
        chart_path=config.out_dir / TTFT_PNG, environment=environment_info(loaded), judge=judge,
        _store=kept,
    )  # fmt: skip
    plot_ttft(aggregates, result.chart_path, "(HumanEval demo)")
    write_json(result.json_path, demo_json(result))
    return result


def demo_modes(policy_path: Path | None, loaded: LoadedModel | None) -> tuple[str, ...]:
    """dense, exact, the approximate modes the admission policy at `policy_path` admits
    for `loaded`'s model (none without a policy), then naive (the unsafe baseline) and
    gated (the policy as a worker runs it, the risk gate above it).
    """
    admitted: tuple[str, ...] = ()
    if policy_path is not None:
        if loaded is None:
            raise ValueError("a policy's admitted modes need the model (its fingerprint)")
        admitted = load_policy(policy_path, loaded.fingerprint).admitted_modes
    return tuple(dict.fromkeys((DENSE, EXACT, *admitted, NAIVE, GATED)))


def _fresh_store_dir(config: DemoConfig) -> Path | None:
    """The embedded store's LMDB dir, emptied so a rerun starts cold (None with a given target)."""
    if config.store_target is not None:
        return None
    path = config.out_dir / STORE_DIR
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def agent_rows(
    aggregates: Aggregates, records: list[CallRecord], modes: tuple[str, ...]
) -> list[DemoAgentRow]:
    """One row per agent position from the per-(mode, position) aggregates."""
    labels = agent_labels(records)
    rows = []
    for position in sorted(labels):
        groups = {m: g for m in modes if (g := aggregates.at(m, position)) is not None}
        rows.append(DemoAgentRow(
            position=position, label=labels[position], dense_ttft_s=groups[DENSE].median_ttft_s,
            ttft_s={m: g.median_ttft_s for m, g in groups.items()},
            speedup={m: g.speedup for m, g in groups.items()},
            reuse_rate={m: g.token_reuse_rate for m, g in groups.items()},
            first_token_agreement={m: g.first_token_agreement for m, g in groups.items()},
            output_match={m: g.output_match for m, g in groups.items()},
        ))  # fmt: skip
    return rows


def stats_hints(store: StoreSession, namespaces: dict[str, str], *, live: bool) -> list[str]:
    """Where to look at the store's side of the run."""
    if live or not store.embedded:
        via = f"admin API {store.admin_url}" if store.admin_url else f"store {store.target}"
        return [f"Store stats ({via}):"] + [
            f"  {store.stats_url(ns) or f'kvsplice stats -n {ns}'}" for ns in namespaces.values()
        ]
    return [
        f"The embedded store stopped with the demo (its admin API was {store.admin_url}); its "
        f"LMDB is {store.lmdb_path}. Serve it again with `kvsplice serve --lmdb-path "
        f"{store.lmdb_path} --admin-listen 127.0.0.1:8081`, then:",
        *(f"  http://127.0.0.1:8081/v1/stats?namespace={ns}   (or `kvsplice stats -n {ns}`)" for ns in namespaces.values()),
    ]  # fmt: skip


def demo_json(result: DemoResult) -> dict[str, object]:
    return {
        "config": {
            k: v if isinstance(v, int | float | str | tuple) else str(v)
            for k, v in vars(result.config).items()
        },
        "environment": result.environment,
        "wall_s": result.wall_s,
        "namespaces": result.namespaces,
        "store_stats": stats_json(result.store_stats),
        "agents": [vars(row) for row in result.rows],
        "aggregates": result.aggregates.to_dict(),
        "records": [r.to_dict() for r in result.records],
        "judge": None if result.judge is None else result.judge.to_dict(),
    }


def render_demo(result: DemoResult) -> list[RenderableType]:
    """Per-agent table, per-mode fidelity table, store stats, and where the files are."""
    reuse_modes = [m for m in result.config.mode_run_config("x").modes if m != DENSE]
    return [
        _agent_table(result, reuse_modes),
        *_mode_tables(mode_rows(result.aggregates)),
        *([] if result.judge is None else [judge_table(result.judge), routes_table(result.judge)]),
        _stats_table(result),
        Text("\n".join([
            f"{result.config.num_problems} HumanEval problems x {len(reuse_modes) + 1} modes in {result.wall_s:.0f} s",
            f"results: {result.json_path}", f"chart:   {result.chart_path}", *result.stats_hints,
        ])),
    ]  # fmt: skip


# MODE_HEADERS split where a 100-column terminal fits each half: speed and reuse | fidelity.
MODE_SPLIT = MODE_HEADERS.index("1st-token agree")


def _mode_tables(rows: Sequence[Sequence[str]]) -> list[Table]:
    """The per-mode table as two, each row's mode repeated (11 columns do not fit 100)."""
    return [
        rich_table("Per mode: speed and reuse", MODE_HEADERS[:MODE_SPLIT], [r[:MODE_SPLIT] for r in rows]),
        rich_table("Per mode: fidelity vs dense prefill of the same prompt",
                   (MODE_HEADERS[0], *MODE_HEADERS[MODE_SPLIT:]), [[r[0], *r[MODE_SPLIT:]] for r in rows]),
    ]  # fmt: skip


def _agent_table(result: DemoResult, reuse_modes: list[str]) -> Table:
    """One row per (agent, mode): dense first, then each reuse mode (fits 100 columns)."""
    title = f"Median TTFT per agent (5-agent pipeline on HumanEval, {result.config.layout} layout)"
    table = Table(
        "agent", "mode", "TTFT ms", "speedup", "token reuse", "1st-token agree", "output match",
        title=title,
    )  # fmt: skip
    for row in result.rows:
        table.add_row(row.label, DENSE, fmt_ms(row.dense_ttft_s), "", "", "", "")
        for mode in reuse_modes:
            table.add_row(
                "", mode, fmt_ms(row.ttft_s.get(mode)), fmt_x(row.speedup.get(mode)),
                fmt_pct(row.reuse_rate.get(mode)), fmt_pct(row.first_token_agreement.get(mode)),
                fmt_pct(row.output_match.get(mode)),
            )  # fmt: skip
        table.add_section()
    return table


def _stats_table(result: DemoResult) -> Table:
    """The store's side: what each mode's namespace holds and the reuse its workers reported
    (the token hit rate equals the mode's token reuse above: one definition)."""
    table = Table(
        "mode", "segments", "stored", "token hit rate", "reused / prompt",
        "local / in place / gRPC", "evicted", "refused",
        title="Store, per mode's namespace (names below)",
    )  # fmt: skip
    for mode, namespace in result.namespaces.items():
        stats = result.store_stats.get(namespace)
        if stats is None:
            table.add_row(mode, *("-" * 7))
            continue
        hit, num_hit, num_prompt = stats.hit_tokens, stats.num_hit_tokens, stats.num_prompt_tokens
        table.add_row(
            mode, str(stats.num_segments), human_bytes(stats.num_bytes),
            fmt_pct(stats.hit_rate), f"{num_hit} / {num_prompt}",
            " / ".join(str(hit.get(s, 0)) for s in SERVED),
            str(stats.num_evictions), str(stats.num_refused_puts),
        )  # fmt: skip
    return table
