"""Factories for agents tests: a character tokenizer with ChatML markers as single ids."""

from __future__ import annotations

from helpers import text
from helpers.client import make_tiny_llama
from helpers.text import MARKERS
from kvsplice.client.model.models import LoadedModel, bundle_model

MARKER_BASE = 1000


class CharTokenizer(text.CharTokenizer):
    """One id per character (its code point, unclamped); the ChatML markers are 1000 and 1001."""

    def __init__(self) -> None:
        super().__init__(MARKER_BASE, clamp=False)


def make_tiny_loaded(seed: int = 0) -> LoadedModel:
    """A 2-layer random Llama (GQA) over the character vocabulary, with that tokenizer."""
    vocab_size = MARKER_BASE + len(MARKERS)
    model = make_tiny_llama(seed=seed, vocab_size=vocab_size, max_positions=8192)
    return bundle_model(model, CharTokenizer())
