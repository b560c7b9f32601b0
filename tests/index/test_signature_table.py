"""SignatureTable: vectorized Jaccard equals MinHash.jaccard; rows survive growth and reuse."""

from __future__ import annotations

from kvsplice.index.signature_table import SignatureTable
from kvsplice.index.similarity_config import SimilarityConfig


def make_signatures(count: int):
    signer = SimilarityConfig(num_perm=32).build_signer()
    return [signer.sign_tokens([i % 7, i % 5, i % 3, i]) for i in range(count)]


def test_jaccard_equals_minhash_jaccard_across_growth_and_row_reuse() -> None:
    signatures = make_signatures(150)  # more than the initial 64 rows
    table = SignatureTable(num_perm=32)
    for i, signature in enumerate(signatures):
        table.put(bytes([i]), signature.minhash.hashvalues)
    for i in range(0, 150, 3):
        assert table.remove(bytes([i]))
    assert not table.remove(bytes([0]))
    for i in range(0, 150, 6):  # re-added into freed rows
        table.put(bytes([i]), signatures[i].minhash.hashvalues)
    assert len(table) == 150 - 50 + 25
    keys = [bytes([i]) for i in range(150) if i % 3 or i % 6 == 0]
    probe = signatures[10].minhash
    expected = [probe.jaccard(signatures[k[0]].minhash) for k in keys]
    assert table.jaccard(keys, probe.hashvalues).tolist() == expected


def test_put_overwrites_an_existing_key() -> None:
    a, b = make_signatures(2)
    table = SignatureTable(num_perm=32)
    table.put(b"k", a.minhash.hashvalues)
    table.put(b"k", b.minhash.hashvalues)
    assert len(table) == 1
    assert table.jaccard([b"k"], b.minhash.hashvalues).tolist() == [1.0]
