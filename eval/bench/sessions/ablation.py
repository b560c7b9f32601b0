"""The retention rules measured one at a time: the trace replayed with sessions and every rule,
with none, with each alone and with all but each, beside today's eviction and Belady's optimum
at the same budgets. `python -m kvsplice.eval.bench.sessions.ablation LMDB_MIB... [--seed N]
--json PATH`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from kvsplice.common.config_flags import MIB
from kvsplice.eval.bench.sessions.belady import belady
from kvsplice.eval.bench.sessions.config import SessionBenchConfig
from kvsplice.eval.bench.sessions.replay import replay, temporary_dir
from kvsplice.eval.bench.sessions.trace import build_trace
from kvsplice.storage.config import RetentionRules

SWITCHES = ("tails_first", "leaves_first", "reused_last", "max_remembered", "forecast")
NEEDS_REUSED = ("max_remembered", "forecast")  # they refine `reused_last`: alone, with it


def variants() -> dict[str, RetentionRules]:
    every = RetentionRules()
    off = {"tails_first": False, "leaves_first": False, "reused_last": False, "forecast": False}
    none = replace(every, **off, max_remembered=0)
    found = {"all rules": every, "no rule": none}
    for switch in SWITCHES:
        default = getattr(every, switch)
        unset = 0 if switch == "max_remembered" else False
        alone: dict[str, Any] = {switch: default}
        if switch in NEEDS_REUSED:
            alone["reused_last"] = True
        found[f"only {switch}"] = replace(none, **alone)
        unset_one: dict[str, Any] = {switch: unset}
        found[f"all but {switch}"] = replace(every, **unset_one)
    return found


def ablation(config: SessionBenchConfig) -> dict[str, Any]:
    trace = build_trace(config)
    with temporary_dir(config) as lmdb_dir:
        today = replay(config, trace, False, lmdb_dir)
    today_hits = sum(s.num_hit_tokens for s in today.served)
    runs: dict[str, Any] = {}
    capacity = today.max_num_segments
    for name, rules in variants().items():
        with temporary_dir(config) as lmdb_dir:
            run = replay(config, trace, True, lmdb_dir, rules)
        capacity = max(capacity, run.max_num_segments)
        hits = sum(s.num_hit_tokens for s in run.served)
        runs[name] = {
            "rules": {f.name: getattr(rules, f.name) for f in fields(rules)},
            "num_hit_tokens": hits,
        }
    optimum = belady(today.chunk_keys, capacity).num_hits * config.chunk_tokens
    for run in runs.values():
        run["of_optimum"] = run["num_hit_tokens"] / optimum
        run["over_today"] = run["num_hit_tokens"] / max(today_hits, 1)
    return {
        "lmdb_mib": config.lmdb_bytes // MIB,
        "memory_mib": config.memory_bytes // MIB,
        "today_hit_tokens": today_hits,
        "optimum_hit_tokens": optimum,
        "capacity_chunks": capacity,
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("lmdb_mib", type=int, nargs="+")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the trace.")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    base = SessionBenchConfig(seed=args.seed)
    budgets: list[dict[str, Any]] = []
    document = {
        "command": "python -m kvsplice.eval.bench.sessions.ablation "
        + " ".join(map(str, args.lmdb_mib))
        + (f" --seed {args.seed}" if args.seed else "")
        + (f" --json {args.json_path}" if args.json_path else ""),
        "seed": args.seed,
        "budgets": budgets,
    }
    for lmdb_mib in args.lmdb_mib:
        result = ablation(replace(base, lmdb_bytes=lmdb_mib * MIB, sweep_lmdb_mib=()))
        budgets.append(result)
        for name, run in result["runs"].items():
            print(
                f"LMDB {lmdb_mib:3d} MiB  {name:26s} of optimum {run['of_optimum']:.3f}  "
                f"vs today {run['over_today']:.3f}",
                flush=True,
            )
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
