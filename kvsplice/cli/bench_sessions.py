"""`kvsplice bench sessions`: agent pipelines as sessions replayed into the real store, session-
aware retention vs today's eviction vs Belady's optimum. Needs no model, torch or engine."""

from __future__ import annotations

import sys
from typing import Any

from kvsplice.cli.common import console, setup_logging
from kvsplice.cli.config_options import with_parameters
from kvsplice.cli.worker import bench_app, bench_config, bench_parameters, write_json
from kvsplice.eval.bench.sessions.config import SessionBenchConfig


@bench_app.command("sessions")
@with_parameters(bench_parameters(SessionBenchConfig, after=("log_level",)))
def bench_sessions(**values: Any) -> None:
    """Hit rate and agent TTFT of >= 32 concurrent 5-agent sessions: sessions vs today vs optimum."""
    config = bench_config(SessionBenchConfig, values)
    from kvsplice.eval.bench.sessions.bench import run_session_bench

    setup_logging(values["log_level"])
    document = {"command": " ".join(["kvsplice", *sys.argv[1:]]), **run_session_bench(config)}
    out = console()
    for name, policy in document["policies"].items():
        ttft = policy["agent_ttft_s"]
        out.print(
            f"{name:>9}: hit rate {policy['hit_rate']:.1%} (agents {policy['agent_hit_rate']:.1%}),"
            f" agent TTFT mean {ttft['mean']:.2f} s p95 {ttft['p95']:.2f} s"
        )
    goal = document["goal"]
    out.print(
        f"  optimum: hit rate {document['optimum']['hit_rate']:.1%}; sessions reach "
        f"{goal['sessions_of_optimum']:.1%} of it and {goal['sessions_over_today']:.2f}x today's"
        f" hits (the optimum: {goal['optimum_over_today']:.2f}x)"
    )
    for row in document["by_budget"]:
        rates, goal = row["hit_rate"], row["goal"]
        out.print(
            f"  LMDB {row['lmdb_mib']:>3} MiB: today {rates['today']:.1%}, sessions"
            f" {rates['sessions']:.1%}, optimum {rates['optimum']:.1%}:"
            f" {goal['sessions_of_optimum']:.1%} of it, {goal['sessions_over_today']:.2f}x today"
        )
    write_json(config.json_path, document)
