"""`bench serve` without engines: the router's rule, the grid plan, ShareGPT records, the
clients' results read into metrics, and the JSON rows (contract keys, repeats folded).

The end-to-end run is tests/integrations/vllm/engine/test_bench_serve.py (.venv-vllm).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsplice.eval.bench.serve.bench import plan_runs
from kvsplice.eval.bench.serve.config import ServeBenchConfig
from kvsplice.eval.bench.serve.report import (
    HIT_COUNTERS,
    ROW_KEYS,
    fold_repeats,
    hit_token_deltas,
    run_row,
)
from kvsplice.eval.bench.serve.router import CHAT_PATH, Router, conversation_backend
from kvsplice.eval.bench.serve.sharegpt import (
    complete_records,
    disjoint_sets,
    sample_conversations,
)
from kvsplice.eval.bench.serve.workloads import (
    ClientMetrics,
    ClientRun,
    WorkloadShape,
    client_command,
    multi_turn_metrics,
    num_conversations,
    serve_metrics,
)
from kvsplice.eval.bench.vllm.engine import parse_counters

texts = st.text(min_size=1, max_size=40)


def make_conversation(first: str, num_user_turns: int) -> list[dict[str, str]]:
    messages = []
    for turn in range(num_user_turns):
        messages.append({"role": "user", "content": first if turn == 0 else f"q{turn}"})
        if turn < num_user_turns - 1:
            messages.append({"role": "assistant", "content": f"a{turn}"})
    return messages


def make_config(tmp_path: Path, **overrides: Any) -> ServeBenchConfig:
    return ServeBenchConfig(
        model_dir="model", out_json=tmp_path / "out.json", work_dir=tmp_path,
        benchmarks_dir=tmp_path / "benchmarks", **overrides,
    )  # fmt: skip


def make_metrics(**overrides: Any) -> ClientMetrics:
    values = dict(num_requests=16, num_failed=0, duration_s=8.0, requests_per_s=2.0,
                  tokens_per_s=64.0, ttft_p50_s=0.2, ttft_p99_s=0.9, tpot_p99_s=0.05)  # fmt: skip
    return ClientMetrics(**{**values, **overrides})  # type: ignore[arg-type]


# -- the router's rule ----------------------------------------------------------------


@given(texts, st.integers(1, 12))
def test_a_conversations_next_turn_runs_on_the_other_backend(first: str, turns: int) -> None:
    now = conversation_backend(make_conversation(first, turns), 2)
    after = conversation_backend(make_conversation(first, turns + 1), 2)
    assert {now, after} == {0, 1}


@given(texts, st.integers(1, 12))
def test_the_rule_reads_only_the_first_user_message_and_the_turn_count(
    first: str, turns: int
) -> None:
    messages = make_conversation(first, turns)
    other_answers = [
        {**m, "content": m["content"] + "!"} if m["role"] == "assistant" else m for m in messages
    ]
    system = [{"role": "system", "content": "be brief"}, *messages]
    picks = {conversation_backend(m, 2) for m in (messages, other_answers, system)}
    assert len(picks) == 1


def test_other_requests_go_round_robin_and_generation_requests_are_counted() -> None:
    router = Router(2)
    body = json.dumps({"prompt": "hello", "max_tokens": 4}).encode()
    assert [router.pick("/v1/completions", body) for _ in range(5)] == [0, 1, 0, 1, 0]
    assert router.pick("/v1/models", b"") == 1  # rotates, but is no generation request
    assert router.num_requests == [3, 2]
    router.answered("/v1/completions", 1, 400)
    router.answered("/v1/completions", 0, 200)
    router.answered("/tokenize", 0, 500)
    assert router.num_failed == [0, 1]


def test_a_chat_request_follows_its_conversation_and_leaves_the_rotation_alone() -> None:
    router = Router(2)
    chat = json.dumps({"messages": make_conversation("plan a trip", 2)}).encode()
    expected = conversation_backend(make_conversation("plan a trip", 2), 2)
    assert [router.pick(CHAT_PATH, chat) for _ in range(3)] == [expected] * 3
    assert router.pick("/v1/completions", b"{}") == 0
    assert router.pick(CHAT_PATH, b"not json") == 1  # unreadable: round robin


# -- the plan ---------------------------------------------------------------------------


def test_every_run_has_its_own_seed_and_the_requests_scale_above_concurrency_4(
    tmp_path: Path,
) -> None:
    config = make_config(tmp_path, repeats=2)
    runs = plan_runs(config)
    assert len(runs) == 2 * 3 * 3
    assert len({r.seed for r in runs}) == len(runs)
    assert {(r.concurrency, r.num_requests) for r in runs} == {(1, 16), (4, 16), (16, 64)}
    assert len({r.name for r in runs}) == len(runs)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"configs": ("recompute", "vllm-kv")}, "configs"),
        ({"workloads": ()}, "workloads"),
        ({"workloads": ("random", "random")}, "workloads"),
        ({"concurrencies": (0,)}, "concurrencies"),
        ({"num_prompts": 10}, "num_prompts 10"),
        ({"dtype": "int8"}, "dtype"),
        ({"repeats": 0}, "repeats"),
        ({"chunk_tokens": 100}, "chunk_tokens 100"),
    ],
)
def test_a_bad_config_names_its_value(
    tmp_path: Path, overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        make_config(tmp_path, **overrides)


def test_each_client_process_gets_a_conversation() -> None:
    shape = WorkloadShape()
    assert num_conversations(16, 4, shape) == 6  # 18 turns of 3
    assert num_conversations(16, 16, shape) == 16


# -- ShareGPT ---------------------------------------------------------------------------


def test_a_file_cut_inside_a_record_keeps_the_records_before_it() -> None:
    records = [{"id": f"c{i}_0", "conversations": [{"from": "human", "value": "x, ]"}]}
               for i in range(3)]  # fmt: skip
    text = json.dumps(records, indent=2)
    assert complete_records(text) == records
    for cut in (text.index('"c2_0"'), len(text) - 3):
        assert complete_records(text[:cut]) == records[:2]


def test_only_whole_conversations_are_sampled_in_the_converters_order(tmp_path: Path) -> None:
    """One ending on a user turn (a leading answer dropped) would kill a client process."""
    sizes = [6, 5, 6, 6]
    converted = [{"id": f"c{i}", "messages": make_conversation(f"q{i}", 4)[:n]}
                 for i, n in enumerate(sizes)]  # fmt: skip
    (tmp_path / "sharegpt-6m-2000c-seed3.json").write_text(json.dumps(converted))
    kwargs = {"num_messages": 6, "max_content_chars": 2000, "seed": 3}
    sample = sample_conversations(tmp_path, tmp_path, num_conversations=2, **kwargs)
    assert [c["id"] for c in sample] == ["c0", "c2"]
    with pytest.raises(ValueError, match="only 3 ShareGPT conversations"):
        sample_conversations(tmp_path, tmp_path, num_conversations=4, **kwargs)


def test_runs_get_disjoint_conversations_in_order() -> None:
    assert disjoint_sets(list(range(7)), [2, 0, 3]) == [[0, 1], [], [2, 3, 4]]
    with pytest.raises(ValueError, match="8 items"):
        disjoint_sets(list(range(7)), [4, 4])


# -- the clients ------------------------------------------------------------------------


def test_the_serve_client_runs_vllms_own_flags(tmp_path: Path) -> None:
    run = ClientRun("prefix_repetition", 4, 16, 7, "http://127.0.0.1:9", "m", tmp_path)
    command = client_command(run, WorkloadShape(), tmp_path)
    assert command[1:3] == ["-m", "kvsplice.eval.bench.serve.client"]
    flags = dict(itertools.pairwise(command))
    assert flags["--prefix-repetition-prefix-len"] == "512"
    assert flags["--max-concurrency"] == "4" and flags["--seed"] == "7"
    assert flags["--result-filename"] == run.result_path.name


def test_the_multi_turn_client_needs_the_unpacked_sdist(tmp_path: Path) -> None:
    run = ClientRun("multi_turn", 2, 6, 0, "http://x", "m", tmp_path, tmp_path / "c.json")
    with pytest.raises(ValueError, match=r"fetch_vllm_tests\.py benchmarks"):
        client_command(run, WorkloadShape(), tmp_path)
    script = tmp_path / "multi_turn" / "benchmark_serving_multi_turn.py"
    script.parent.mkdir()
    script.write_text("")
    command = client_command(run, WorkloadShape(), tmp_path)
    assert command[1] == str(script) and "--no-early-stop" in command


def test_serve_results_are_read_in_seconds() -> None:
    result = {"completed": 15, "failed": 1, "duration": 7.5, "request_throughput": 2.0,
              "output_throughput": 64.0, "p50_ttft_ms": 120.0, "p99_ttft_ms": 900.0,
              "p99_tpot_ms": 50.0}  # fmt: skip
    assert serve_metrics(result) == make_metrics(
        num_requests=15, num_failed=1, duration_s=7.5, ttft_p50_s=0.12
    )


def test_multi_turn_stats_give_throughput_over_first_start_to_last_end() -> None:
    stats = [
        {"start_time_ms": 1000.0, "latency_ms": 1000.0, "ttft_ms": 100.0, "tpot_ms": 10.0,
         "output_num_tokens": 30},
        {"start_time_ms": 1500.0, "latency_ms": 1500.0, "ttft_ms": 300.0, "tpot_ms": 30.0,
         "output_num_tokens": 10},
    ]  # fmt: skip
    metrics = multi_turn_metrics(stats)
    assert metrics.duration_s == pytest.approx(2.0)
    assert metrics.requests_per_s == pytest.approx(1.0)
    assert metrics.tokens_per_s == pytest.approx(20.0)
    assert metrics.ttft_p50_s == pytest.approx(0.2)
    assert metrics.tpot_p99_s == pytest.approx(0.0298)


# -- counters and rows ------------------------------------------------------------------

METRICS_PAGE = """\
# HELP vllm:prompt_tokens_cached_total Number of cached prompt tokens (local + external).
vllm:prompt_tokens_cached_total{engine="0",model_name="m"} 640.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 100.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 384.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 256.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 740.0
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def test_counters_split_by_source_and_deltas_summed_over_engines() -> None:
    after = parse_counters(METRICS_PAGE, split_by="source")
    assert after["vllm:prompt_tokens_by_source_total[external_kv_transfer]"] == 256.0
    assert parse_counters(METRICS_PAGE)["vllm:prompt_tokens_by_source_total"] == 740.0
    before = {name: 0.0 for name in HIT_COUNTERS.values()}
    deltas = hit_token_deltas([before, before], [after, after])
    assert deltas == {"hit_tokens": 1280, "local_hit_tokens": 768,
                      "external_hit_tokens": 512, "prompt_tokens": 1480}  # fmt: skip


def make_row(config: str, repeat: int, **metrics: Any) -> dict[str, Any]:
    identity = {"workload": "random", "concurrency": 4, "config": config, "repeat": repeat}
    hits = {"hit_tokens": 10 * repeat, "local_hit_tokens": 0, "external_hit_tokens": 10 * repeat,
            "prompt_tokens": 100}  # fmt: skip
    extra = {"load_avg_1m_before": 1.0 + repeat, "load_avg_1m_after": 2.0}
    return run_row(identity, make_metrics(**metrics), hits, extra)


def test_a_row_carries_the_contract_keys() -> None:
    row = make_row("kvsplice", 0)
    assert set(ROW_KEYS) <= set(row)
    assert json.loads(json.dumps(row)) == row
    with pytest.raises(ValueError, match="workload"):
        run_row({"concurrency": 1, "config": "kvsplice"}, make_metrics(), {"hit_tokens": 0}, {})


def test_repeats_fold_into_a_median_with_its_spread() -> None:
    rows = [make_row("kvsplice", r, requests_per_s=float(r + 1)) for r in range(3)]
    rows.append(make_row("recompute", 0))
    folded = fold_repeats(rows)
    assert [r["config"] for r in folded] == ["kvsplice", "recompute"]
    kvsplice, recompute = folded
    assert kvsplice["requests_per_s"] == 2.0 and kvsplice["repeats"] == 3
    assert kvsplice["spread"]["requests_per_s"] == [1.0, 3.0]
    assert kvsplice["hit_tokens"] == 10 and kvsplice["num_requests"] == 48
    assert kvsplice["load_avg_1m_before"] == 3.0 and "repeat" not in kvsplice
    assert recompute["repeats"] == 1 and "spread" not in recompute
