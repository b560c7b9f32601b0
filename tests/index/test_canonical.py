"""Canonicalization for retrieval: case, whitespace and volatile substrings."""

from __future__ import annotations

import pytest

from kvsplice.index.canonical import canonical_words, canonicalize


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("  Hello\n\tWORLD  ", "hello world"),
        ("retry 3 of 10, took 2.75 s", "retry <num> of <num> , took <num> s"),
        ("at 2024-05-01T12:30:45.123Z done", "at <ts> done"),
        ("at 2024-05-01 12:30:45+02:00 done", "at <ts> done"),
        ("on 2024/05/01 or 01.05.2024", "on <date> or <date>"),
        ("meet at 9:30 pm or 21:30:05", "meet at <time> or <time>"),
        ("req 550E8400-E29B-41D4-A716-446655440000 ok", "req <uuid> ok"),
        ("commit 3f2a9c1b7d and 0xdeadbeef12", "commit <hex> and <hex>"),
        ("word deadbeef stays", "word deadbeef stays"),
        ("see https://example.org/a?b=1 or www.x.io/p", "see <url> or <url>"),
        ("mail ops.team+1@example.co.uk now", "mail <email> now"),
    ],
)
def test_canonicalize_examples(text: str, expected: str) -> None:
    assert canonicalize(text) == expected


def test_volatile_variants_share_one_canonical_form() -> None:
    a = "Order 12345 created 2024-05-01T10:00:00Z by id 9f8e7d6c5b"
    b = "order 98  created 2026-12-31T23:59:59Z by   id 0a1b2c3d4e5f"
    assert canonicalize(a) == canonicalize(b)


def test_canonical_words_split_placeholders_words_and_punctuation() -> None:
    assert canonical_words("Total: 42 items (ok)") == [
        "total",
        ":",
        "<num>",
        "items",
        "(",
        "ok",
        ")",
    ]
    assert canonical_words("   ") == []
