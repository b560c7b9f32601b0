"""What the sidecar holds for one `LookupQuery`: the exact stored prefix and, asked for, the runs past it.

`StoreLookup` is the `LookupFn` that `Lookups` runs on its threads: one `LookupPrefix`
(a degraded call is a fault, not a miss), then for an approximate query `span_search`
within its share of the lookup deadline. Knows the store client, not requests or vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvsplice.common.errors import StoreUnavailable
from kvsplice.integrations.vllm.lookups import Found, LookupQuery
from kvsplice.integrations.vllm.sessions import log_renewal
from kvsplice.integrations.vllm.sidecar_faults import FaultLog
from kvsplice.integrations.vllm.span_search import SPAN_SEARCH_SHARE, find_spans
from kvsplice.integrations.vllm.store_clients import StoreClients


class StoreLookup:
    def __init__(
        self,
        clients: StoreClients,
        *,
        block_size: int,
        chunk_tokens: int,
        timeout_s: float,
        faults: FaultLog,
    ) -> None:
        self.clients = clients
        self.block_size = block_size
        self.chunk_tokens = chunk_tokens
        self.timeout_s = timeout_s  # the lookup's deadline (`Lookups.timeout_s`)
        self.faults = faults

    def __call__(self, query: LookupQuery, token_ids: Sequence[int]) -> Found:
        """With `query.approximate`, the runs that continue the prefix too (a failing
        search leaves the exact prefix standing)."""
        deadline = time.monotonic() + self.timeout_s * SPAN_SEARCH_SHARE
        store = self.clients.for_namespace(query.namespace)
        degraded = store.counters.num_degraded_calls
        session = query.session
        if session is not None and session.lease_s is not None:  # a retain hint's lease
            log_renewal(session, store.renew_session(session.session_id, session.lease_s))
        session_id = "" if session is None else session.session_id
        lookup = store.lookup_prefix(query.root, token_ids, session_id)
        if store.counters.num_degraded_calls != degraded:
            raise StoreUnavailable("the sidecar did not answer LookupPrefix in time")
        if not query.approximate:
            return Found(lookup)
        try:
            spans = find_spans(
                store, query.root, token_ids, lookup.num_matched_tokens,
                block_size=self.block_size, chunk_tokens=self.chunk_tokens,
                deadline=deadline, faults=self.faults,
            )  # fmt: skip
        except Exception as error:  # the exact prefix stands
            self.faults.record("looking up approximate runs failed", error)
            spans = ()
        return Found(lookup, spans)
