"""Faults in kvsplice's own load path, made where they happen in a deployment.

`corrupt`: the sidecar's record under a promised segment's key is replaced by one that
holds another chain link's tokens (internally consistent: only kvsplice's check can tell);
`evicted`: the segment is deleted between the lookup that promised it and the load;
`killed`: the sidecar is stopped mid-load, once the load wrote `index` blocks (before the
load at index 0). Each names the piece of a `LoadSpec` (one block a piece: chunks of one
block). Knows the sidecar's store and kvsplice's load records, not vLLM's tests.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from kvsplice.integrations.vllm.transfer_specs import LoadSpec
from kvsplice.server.embedded import EmbeddedStore

FAULT_KINDS = ("corrupt", "evicted", "killed")


@dataclasses.dataclass(frozen=True)
class Injected:
    kind: str
    request_id: str
    namespace: str
    segment_id: str
    index: int  # of the piece (and block) in the load


class LoadFaults:
    def __init__(self, kind: str, sidecar: EmbeddedStore, *, owns_sidecar: bool) -> None:
        if kind not in FAULT_KINDS:
            raise ValueError(f"fault kind {kind!r} is not one of {FAULT_KINDS}")
        if kind == "killed" and not owns_sidecar:
            raise ValueError("a killed sidecar must be the test's own")
        self.kind = kind
        self.sidecar = sidecar
        self.store = sidecar.server.store
        self.injected: list[Injected] = []
        self._kill_lock = threading.Lock()

    def inject(self, spec: LoadSpec, index: int, worker_side: Any) -> None:
        """Make piece `index` of `spec` fail the way `kind` says, before the load runs."""
        piece = spec.pieces[index]
        assert piece.num_tokens == worker_side.paged.block_size, "one block a piece"
        key = bytes.fromhex(piece.segment_id)
        if self.kind == "corrupt":
            found = self.store.get(spec.namespace, key)
            assert found is not None, f"segment {piece.segment_id} is not stored"
            other_tokens = tuple(token + 1 for token in found.meta.token_ids)
            self.store.put(dataclasses.replace(found.meta, token_ids=other_tokens), found.payload)
        elif self.kind == "evicted":
            assert self.store.delete(spec.namespace, key), f"{piece.segment_id} was not stored"
        elif index == 0:
            self.kill()
        else:
            self._kill_after_blocks(worker_side, index)
        self.injected.append(
            Injected(self.kind, spec.request_id, spec.namespace, piece.segment_id, index)
        )

    def kill(self) -> None:
        with self._kill_lock:
            self.sidecar.stop()

    def is_stored(self, namespace: str, segment_id: str) -> bool:
        if self.kind == "killed":
            return False  # nothing is served any more
        return self.store.get_meta(namespace, bytes.fromhex(segment_id)) is not None

    def _kill_after_blocks(self, worker_side: Any, num_blocks: int) -> None:
        """Stop the sidecar from inside the load, once it wrote `num_blocks` blocks (the
        engine's caches are where a load's progress shows)."""
        paged = worker_side.paged
        scatter = paged.scatter
        written = [0]

        def scatter_then_maybe_kill(block_ids: Any, k: Any, v: Any) -> None:
            scatter(block_ids, k, v)
            written[0] += len(block_ids)
            if written[0] == num_blocks:
                paged.scatter = scatter  # once
                self.kill()

        paged.scatter = scatter_then_maybe_kill
