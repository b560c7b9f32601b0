"""`bench vllm`'s console report: the per-agent TTFT table (medians over repeats, agent 5's
spread and its ratios against recompute, local-apc and LMCache), then the graded answers."""

from __future__ import annotations

from typing import Any

from kvsplice.eval.bench.vllm.graded import print_graded


def print_report(report: dict[str, Any], console: Any) -> None:
    """The per-agent TTFT table (medians over repeats, agent 5's spread) and agent 5's
    ratios against recompute, local-apc and LMCache with prefix caching set alike; then the
    graded answers' table (`--problems`)."""
    from kvsplice.eval.report.tables import figures_table

    rows = report["configs"]
    if report["repeats"]:
        _print_timed(report, console, figures_table)
    if any(row.get("graded") for row in rows):
        print_graded(rows, console)


def _print_timed(report: dict[str, Any], console: Any, figures_table: Any) -> None:
    rows = report["configs"]
    agent5 = {(r["name"], r["prefix_caching"]): r["agent_ttft_s"][-1] for r in rows}
    base = agent5[("recompute", False)]
    apc = agent5.get(("local-apc", True))
    columns = ("config", "a1", "a2", "a3", "a4", "a5", "a5 min-max", "vs rec", "vs apc",
               "vs lmc", "hit tok", "match", "B/tok")  # fmt: skip
    title = (
        f"bench vllm: TTFT per agent (s, median of {report['repeats']}); agent 5 vs "
        "recompute / local-apc / LMCache (same prefix caching)"
    )
    table = figures_table(columns, ("config",), title=title)
    for row in rows:
        ttft, a5 = row["agent_ttft_s"], row["agent_ttft_s"][-1]
        bpt = row["stored_bytes_per_token"]
        lmc = agent5.get(("lmcache", row["prefix_caching"]))
        table.add_row(
            row["label"], *(f"{t:.3f}" for t in ttft),
            f"{row['agent_ttft_min_s'][-1]:.3f}-{row['agent_ttft_max_s'][-1]:.3f}",
            f"{base / a5:.2f}x", "" if apc is None else f"{a5 / apc:.2f}x",
            "" if lmc is None else f"{a5 / lmc:.2f}x", str(row["external_hit_tokens"]),
            f"{row['output_match']:.2f}", "" if bpt is None else f"{bpt:.0f}",
        )  # fmt: skip
    console.print(table)
    prompts = rows[0]["agent_prompt_tokens"]
    console.print(
        f"prompt tokens per agent {prompts}; load average {report['load_avg']}; threads "
        f"pinned to {report['threads_bind']}; dtype {report['dtype']}; chunks of "
        f"{report['chunk_tokens']} tokens; decode-written K/V stored: "
        f"{'yes' if report['decode_kv_stored'] else 'no'} (kvsplice and LMCache alike)"
    )
