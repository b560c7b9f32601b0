"""The store clients of one connector: one channel to the sidecar, a client per namespace.

A request's `cache_salt` makes its own namespace (`storeclient.namespaces`: every
namespace's client shares the configured namespace's channel), so salts cost no
connections. Shared by the scheduler and worker sides; thread-safe, bounded.
"""

from __future__ import annotations

from kvsplice.integrations.vllm.connector_config import ConnectorConfig
from kvsplice.storeclient.client import StoreClient
from kvsplice.storeclient.config import ClientTls, StoreClientConfig
from kvsplice.storeclient.namespaces import NamespaceClients


class StoreClients(NamespaceClients):
    """The connector's `NamespaceClients`, opened as its config says."""

    def __init__(self, config: ConnectorConfig) -> None:
        self.config = config
        client_config = StoreClientConfig(
            lookup_timeout_s=config.lookup_timeout_ms / 1000,
            same_host_reads=config.same_host_reads,
            staged_puts=config.staged_puts,
        )
        tls = None
        if config.tls_ca is not None or config.tls_cert is not None:
            tls = ClientTls(
                ca_path=config.tls_ca, cert_path=config.tls_cert, key_path=config.tls_key
            )
        base = StoreClient(
            config.target, config.namespace, token=config.resolved_token(),
            config=client_config, tls=tls,
        )  # fmt: skip
        super().__init__(base)
