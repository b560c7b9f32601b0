"""The similarity index's parameters (MinHash permutations, LSH threshold, verification limits).

Apart from `similarity_index` so that reading them (the CLI's flags) imports neither numpy
nor datasketch; the index itself lives there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvsplice.common.config_flags import flag

if TYPE_CHECKING:
    from kvsplice.index.signature import Signer


@dataclass(frozen=True)
class SimilarityConfig:
    """MinHash/LSH parameters. `threshold` tunes the LSH bands (datasketch's
    optimizer); `min_jaccard` drops weaker candidates; at most `max_candidates`
    LSH candidates (best estimated Jaccard first) are verified per query."""

    num_perm: int = flag(128, "MinHash permutations.", name="lsh-num-perm", min=16)
    seed: int = 1
    threshold: float = flag(
        0.6, "MinHash LSH Jaccard threshold.", name="lsh-threshold", min=0, max=1
    )
    text_shingle_words: int = 3
    token_shingle_tokens: int = 6
    min_jaccard: float = 0.4
    max_candidates: int = 64

    def __post_init__(self) -> None:
        if not 16 <= self.num_perm <= 1024:
            raise ValueError(f"num_perm {self.num_perm} must be in [16, 1024]")
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"threshold {self.threshold} must be in (0, 1)")
        if not 0.0 <= self.min_jaccard <= 1.0:
            raise ValueError(f"min_jaccard {self.min_jaccard} must be in [0, 1]")
        if self.text_shingle_words < 1:
            raise ValueError(f"text_shingle_words {self.text_shingle_words} must be >= 1")
        if self.token_shingle_tokens < 1:
            raise ValueError(f"token_shingle_tokens {self.token_shingle_tokens} must be >= 1")
        if self.max_candidates < 1:
            raise ValueError(f"max_candidates {self.max_candidates} must be >= 1")

    def build_signer(self) -> Signer:
        # NOTE: imported here so that reading the config (the CLI's flags) loads no numpy.
        from kvsplice.index.signature import Signer

        return Signer(
            num_perm=self.num_perm,
            seed=self.seed,
            text_shingle_words=self.text_shingle_words,
            token_shingle_tokens=self.token_shingle_tokens,
        )
