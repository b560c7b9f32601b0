"""Loaders of GSM8K/MMLU-format JSONL, HumanEval from its package, the shipped samples."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from helpers.evaluation import CharTokenizer

from kvsplice.eval.workloads.humaneval import load_humaneval
from kvsplice.eval.workloads.math_problems import MATH_SAMPLE, final_answer, load_math
from kvsplice.eval.workloads.multiple_choice import MC_SAMPLE, answer_letter, load_mc
from kvsplice.eval.workloads.sample_data import SOURCE, math_records, mc_records, write_samples
from kvsplice.eval.workloads.synthetic import SyntheticConfig, single_token_words, word_salad


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_math_loader_reads_the_number_after_hashes(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "gsm.jsonl", [
        {"question": "How many?", "answer": "2 + 3 = 5\n#### 5"},
        {"question": "How much?", "answer": "big numbers\n#### 1,250"},
    ])  # fmt: skip
    problems = load_math(path)
    assert [p.reference for p in problems] == ["5", "1250"]
    assert [p.problem_id for p in problems] == ["gsm-0", "gsm-1"]
    assert problems[0].question == "How many?"
    assert len(load_math(path, limit=1)) == 1


def test_math_loader_rejects_answers_without_marker(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answer": "5"}])
    with pytest.raises(ValueError, match="####"):
        load_math(path)
    path.write_text("{not json\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        load_math(path)


def test_mc_loader_accepts_index_and_letter_answers(tmp_path: Path) -> None:
    choices = ["one", "two", "three", "four"]
    path = write_jsonl(tmp_path / "mmlu.jsonl", [
        {"question": "Pick two.", "choices": choices, "answer": 1},
        {"question": "Pick four.", "choices": choices, "answer": "D"},
        {"question": "Pick one.", "choices": choices, "answer": "a"},
    ])  # fmt: skip
    problems = load_mc(path)
    assert [p.reference for p in problems] == ["B", "D", "A"]
    assert problems[0].question == "Pick two.\nA. one\nB. two\nC. three\nD. four"


@pytest.mark.parametrize("bad", [4, -1, "E", "", True])
def test_answer_letter_rejects_out_of_range(bad: object) -> None:
    with pytest.raises(ValueError, match="answer"):
        answer_letter(bad)  # type: ignore[arg-type]


def test_mc_loader_rejects_wrong_number_of_choices(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "three.jsonl", [{"question": "q", "choices": ["a", "b", "c"], "answer": 0}]
    )
    with pytest.raises(ValueError, match="4 choices"):
        load_mc(path)


def test_humaneval_loads_offline_from_the_package() -> None:
    problems = load_humaneval(limit=2)
    assert [p.problem_id for p in problems] == ["HumanEval/0", "HumanEval/1"]
    first = problems[0]
    assert first.extras["entry_point"] == "has_close_elements"
    assert first.question == first.extras["prompt"]
    assert "def check(candidate)" in first.extras["test"]


def test_shipped_samples_are_ours_and_regenerate_byte_for_byte(tmp_path: Path) -> None:
    written = write_samples(tmp_path)
    for path, shipped in zip(written, (MATH_SAMPLE, MC_SAMPLE), strict=True):
        assert path.read_bytes() == shipped.read_bytes()
    records = math_records() + mc_records()
    assert all(r["source"] == SOURCE for r in records)
    assert (len(load_math()), len(load_mc())) == (30, 20)


def test_generated_math_answers_follow_from_their_steps() -> None:
    """The last worked step's result is the final answer, and every step is true arithmetic."""
    for record in math_records():
        steps = record["answer"].split("\n")[:-1]
        for step in steps:
            left, right = step.split(" = ")
            a, op, b = left.split(" ")
            value = {
                "+": int(a) + int(b),
                "-": int(a) - int(b),
                "*": int(a) * int(b),
                "/": int(a) / int(b),
            }[op]
            assert value == int(right), step
        assert final_answer(record["answer"]) == steps[-1].split(" = ")[1]
        assert int(final_answer(record["answer"])) >= 0


class WordTokenizer:
    """Splits on spaces: every " word" is one token (what the vocabulary filter keeps)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [len(word) for word in re.findall(r" ?\S+", text)]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return ""


def test_word_salad_has_the_requested_token_count() -> None:
    words = single_token_words(WordTokenizer())
    text = word_salad(random.Random(3), words, 57)
    assert len(WordTokenizer().encode(text)) == 57
    assert text == word_salad(random.Random(3), words, 57)


def test_vocabulary_filter_refuses_a_tokenizer_that_splits_words() -> None:
    with pytest.raises(ValueError, match="single tokens"):
        single_token_words(CharTokenizer())


def test_synthetic_config_rejects_empty_lengths() -> None:
    with pytest.raises(ValueError, match="input_len"):
        SyntheticConfig(input_len=0)
