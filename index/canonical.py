"""Canonical text for similarity retrieval: lower-case, one space, volatile parts masked.

Used ONLY to build MinHash signatures; nothing spliced is ever derived from it
(reuse is verified on the original token ids). Shingling lives in `signature`.
"""

from __future__ import annotations

import re

CANONICAL_VERSION = 1

# (pattern, placeholder, substrings of which any must occur for a match: a
# cheap `in` test skips most regex scans of ordinary text).
# NOTE: order matters — composite patterns (URL, e-mail, UUID, timestamp, date)
# must be masked before the numbers inside them are masked one by one.
_MASKS: tuple[tuple[re.Pattern[str], str, tuple[str, ...]], ...] = (
    (re.compile(r"\b(?:https?|ftp)://\S+|\bwww\.\S+"), " <url> ", ("://", "www.")),
    (re.compile(r"\b[\w.+-]+@[\w-]+(?:\.[\w-]+)+\b"), " <email> ", ("@",)),
    (
        re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b"),
        " <uuid> ",
        ("-",),
    ),
    (
        re.compile(
            r"\b\d{4}-\d{2}-\d{2}[t ]\d{1,2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:z|[+-]\d{2}:?\d{2})?\b"
        ),
        " <ts> ",
        (":",),
    ),
    (
        re.compile(r"\b\d{4}[-/.]\d{1,2}[-/.]\d{1,2}\b|\b\d{1,2}[-/.]\d{1,2}[-/.]\d{4}\b"),
        " <date> ",
        ("-", "/", "."),
    ),
    (re.compile(r"\b\d{1,2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:\s?[ap]m)?\b"), " <time> ", (":",)),
    # A hex id has >= 8 hex chars with at least one digit and one letter, so
    # plain words ("deadbeef") and plain numbers keep their own treatment.
    (
        re.compile(r"\b(?:0x)?(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{8,}\b"),
        " <hex> ",
        tuple("0123456789"),
    ),
    (re.compile(r"\d+(?:[.,]\d+)*"), " <num> ", tuple("0123456789")),
)
_WHITESPACE = re.compile(r"\s+")
_WORD = re.compile(r"<[a-z]+>|\w+|[^\w\s]")


def canonicalize(text: str) -> str:
    """Lower-cased `text` with volatile substrings replaced by placeholders.

    Placeholders: `<url> <email> <uuid> <ts> <date> <time> <hex> <num>`;
    runs of whitespace become one space; the result is stripped.
    """
    canonical = text.lower()
    for pattern, placeholder, triggers in _MASKS:
        if any(trigger in canonical for trigger in triggers):
            canonical = pattern.sub(placeholder, canonical)
    return _WHITESPACE.sub(" ", canonical).strip()


def canonical_words(text: str) -> list[str]:
    """Words of `canonicalize(text)`: placeholders, `\\w+` runs and single punctuation marks."""
    return _WORD.findall(canonicalize(text))
