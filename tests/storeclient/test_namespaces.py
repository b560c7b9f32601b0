"""NamespaceClients: one client per namespace over the first's channel, bounded, closed last."""

from __future__ import annotations

from typing import cast

from kvsplice.storeclient.client import StoreClient
from kvsplice.storeclient.namespaces import NamespaceClients


class FakeClient:
    def __init__(self, namespace: str, closed: list[str]) -> None:
        self.namespace = namespace
        self._closed = closed

    def in_namespace(self, namespace: str) -> FakeClient:
        return FakeClient(namespace, self._closed)

    def close(self) -> None:
        self._closed.append(self.namespace)


def test_a_client_per_namespace_the_least_recently_used_closed_past_the_bound() -> None:
    closed: list[str] = []
    base = FakeClient("base", closed)
    clients = NamespaceClients(cast(StoreClient, base), max_clients=2)
    assert clients.for_namespace("base") is base
    a = clients.for_namespace("a")
    assert clients.for_namespace("a") is a and a.namespace == "a"
    clients.for_namespace("b")
    clients.for_namespace("a")  # "b" is now the least recently used
    clients.for_namespace("c")
    assert closed == ["b"]
    clients.close()
    assert closed == ["b", "a", "c", "base"]  # the channel's owner last
