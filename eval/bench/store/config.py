"""`StoreBenchConfig` and the flags of `kvsplice bench store` beside its fields. Imports neither
numpy nor grpc: the CLI derives `--help` from it; running it is `bench`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsplice.common.config_flags import flag


@dataclass(frozen=True)
class StoreBenchConfig:
    """What to measure. `tmp_dir` holds the LMDB environments (None: the system temp dir).

    `path_sizes_mib`: segment sizes read through each read path (`paths`;
    empty: none); `put_path_sizes_mib`: sizes put staged until committed (`put_path`,
    at the LMDB tier's default durability; empty: none). `lmdb_sync` True is the LMDB tier's durable default (fsync on every commit). Lookup
    stores of more than `max_grpc_populated_segments` are preloaded in-process into LMDB
    and indexed by the server's start-up rebuild instead of put one by one through gRPC.
    `json_path`: where the CLI also writes the result (None: nowhere); paths are `str`, as the
    result's JSON records them.
    """

    sizes_mib: tuple[int, ...] = flag(
        (1, 8, 32), "Comma-separated segment sizes in MiB.", csv=True, min=1
    )
    path_sizes_mib: tuple[int, ...] = flag(
        (8, 32, 128), "Sizes in MiB read same-host and over gRPC ('' : none).", csv=True, min=1
    )
    put_path_sizes_mib: tuple[int, ...] = flag(
        (8, 32), "Sizes in MiB put staged until committed in LMDB ('' : none).", csv=True, min=1
    )
    repeats: int = flag(5, "Timed runs per size.", min=1)
    lookup_counts: tuple[int, ...] = flag(
        (10_000, 100_000), "Comma-separated index sizes.", csv=True, min=1
    )
    include_grpc_lookups: bool = flag(True, "Also time lookups through gRPC.", name="grpc-lookups")
    tmp_dir: str | None = flag(
        None, "Where the benchmark's LMDB lives.",
        path=True, exists=True, file_okay=False, writable=True,
    )  # fmt: skip
    json_path: str | None = flag(None, "Also write the result as JSON.", name="json", path=True)
    num_queries: int = 1000
    max_grpc_populated_segments: int = 10_000
    lmdb_sync: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.sizes_mib or min(self.sizes_mib) < 1:
            raise ValueError(f"sizes_mib {self.sizes_mib} must be non-empty and >= 1")
        for name in ("path_sizes_mib", "put_path_sizes_mib"):
            sizes = getattr(self, name)
            if sizes and min(sizes) < 1:
                raise ValueError(f"{name} {sizes} must all be >= 1")
        if self.repeats < 1:
            raise ValueError(f"repeats {self.repeats} must be >= 1")
        if any(count < 1 for count in self.lookup_counts):
            raise ValueError(f"lookup_counts {self.lookup_counts} must all be >= 1")
        if self.num_queries < 1:
            raise ValueError(f"num_queries {self.num_queries} must be >= 1")
        if self.max_grpc_populated_segments < 0:
            raise ValueError(
                f"max_grpc_populated_segments {self.max_grpc_populated_segments} must be >= 0"
            )
