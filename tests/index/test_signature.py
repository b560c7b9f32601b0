"""MinHash signatures: kinds, estimates, and persisted bytes."""

from __future__ import annotations

from helpers.index import make_meta

from kvsplice.index.signature import SignatureKind
from kvsplice.index.similarity_config import SimilarityConfig


def make_signer(**overrides):
    return SimilarityConfig(**overrides).build_signer()


def test_text_signature_when_text_has_words_else_tokens() -> None:
    signer = make_signer()
    assert (
        signer.sign_meta(make_meta([1, 2, 3], index_text="Some words here")).kind
        == SignatureKind.TEXT
    )
    assert signer.sign_meta(make_meta([1, 2, 3], index_text=" \n ")).kind == SignatureKind.TOKENS
    assert signer.sign_meta(make_meta([1, 2, 3])).kind == SignatureKind.TOKENS
    assert signer.sign_text("") is None


def test_identical_inputs_estimate_one_and_disjoint_inputs_near_zero() -> None:
    signer = make_signer()
    a = signer.sign_tokens(range(100))
    assert a.minhash.jaccard(signer.sign_tokens(range(100)).minhash) == 1.0
    assert a.minhash.jaccard(signer.sign_tokens(range(1000, 1100)).minhash) < 0.1


def test_short_inputs_are_one_shingle() -> None:
    signer = make_signer(token_shingle_tokens=6)
    assert signer.sign_tokens([1, 2]).minhash.jaccard(signer.sign_tokens([1, 2]).minhash) == 1.0
    assert signer.sign_tokens([1, 2]).minhash.jaccard(signer.sign_tokens([2, 1]).minhash) < 0.1


def test_signature_bytes_round_trip_under_the_same_parameters_only() -> None:
    signer = make_signer()
    signature = signer.sign_text("a persisted signature of some text")
    assert signature is not None
    data = signer.to_bytes(signature)
    restored = signer.from_bytes(data)
    assert restored is not None
    assert restored.kind == signature.kind
    assert restored.minhash.jaccard(signature.minhash) == 1.0
    assert make_signer(text_shingle_words=4).from_bytes(data) is None
    assert make_signer(seed=2).from_bytes(data) is None
    assert signer.from_bytes(data[:-1]) is None
    assert signer.from_bytes(b"") is None
