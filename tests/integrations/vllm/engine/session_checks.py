"""Sessions on the shared engines (issue 52): a chat request's `session_id` reaches the sidecar.

Collected by test_connector_engines.py, whose module starts the engines once."""

from __future__ import annotations

import httpx
from conftest import NAMESPACE

from kvsplice.eval.bench.vllm.engine import Engine, Sidecar
from kvsplice.storeclient.client import StoreClient


def test_a_chat_request_s_session_id_reaches_the_sidecar(
    engines: dict[str, Engine], sidecar: Sidecar
) -> None:
    """vLLM carries a chat body's `session_id` to the connector (`Request.session_id`), whose
    lookup makes the session live at the sidecar: ending it there finds it (one never sent is
    not found)."""
    engine = engines["a"]
    words = " ".join(f"step-{i}" for i in range(80))  # several blocks: the request is looked up
    body = {
        "model": engine.spec.model_dir, "max_tokens": 1, "temperature": 0.0,
        "session_id": "chat-session-4711",
        "messages": [{"role": "user", "content": f"Plan task 4711 in order: {words}"}],
    }  # fmt: skip
    response = httpx.post(f"{engine.url}/v1/chat/completions", json=body, timeout=120.0)
    assert response.status_code == 200, response.text[:300]
    with StoreClient(sidecar.target, NAMESPACE) as client:
        assert not client.end_session("never-sent")
        assert client.end_session("chat-session-4711")
