"""A streaming HTTP router in front of `bench serve`'s two OpenAI servers.

Owns the routing rule and the proxy: a chat request goes where its conversation's turn
number sends it, any other request round robin; responses (SSE included) pass through
chunk by chunk, so a client's TTFT is the engine's. Knows nothing of engines or
workloads. Run as `python -m kvsplice.eval.bench.serve.router --port P --backend URL...`.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import logging
from typing import Any

logger = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
STATS_PATH = "/router/stats"  # answered by the router itself: what each backend was sent
BACKEND_HEADER = "X-Kvsplice-Backend"
# Hop-by-hop or recomputed by the proxy's own HTTP layer.
DROPPED_HEADERS = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}
)


def conversation_backend(messages: list[dict[str, Any]], num_backends: int) -> int | None:
    """The backend of a conversation's next turn: (h + number of user messages) % backends,
    h a stable hash of its first user message. So turn n+1 runs where turn n did not (two
    backends), and the same conversation always maps alike. None when no user message."""
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        return None
    first = users[0].get("content")
    text = first if isinstance(first, str) else json.dumps(first, sort_keys=True)
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") + len(users)) % num_backends


class Router:
    """Picks a backend index per request; counts the generation requests (POSTs to a
    `*completions` path) each backend was sent and answered with an HTTP error."""

    def __init__(self, num_backends: int) -> None:
        if num_backends < 1:
            raise ValueError(f"num_backends {num_backends} must be >= 1")
        self.num_backends = num_backends
        self.num_requests = [0] * num_backends
        self.num_failed = [0] * num_backends
        self._turns = itertools.count()

    def pick(self, path: str, body: bytes) -> int:
        index = self._conversation(body) if path == CHAT_PATH else None
        if index is None:
            index = next(self._turns) % self.num_backends
        if path.endswith("completions"):
            self.num_requests[index] += 1
        return index

    def answered(self, path: str, index: int, status: int) -> None:
        if path.endswith("completions") and status >= 400:
            self.num_failed[index] += 1

    def _conversation(self, body: bytes) -> int | None:
        try:
            messages = json.loads(body).get("messages")
        except (ValueError, AttributeError):
            return None
        return conversation_backend(messages, self.num_backends) if messages else None


def build_app(backend_urls: list[str]) -> Any:
    """The aiohttp application: every path proxied, `STATS_PATH` answered here."""
    from aiohttp import ClientSession, ClientTimeout, web

    router = Router(len(backend_urls))
    app = web.Application(client_max_size=64 << 20)

    async def open_session(app: web.Application) -> None:
        # No total timeout: a request at concurrency 16 on 2 cores may take minutes.
        app["session"] = ClientSession(timeout=ClientTimeout(total=None), auto_decompress=False)

    async def close_session(app: web.Application) -> None:
        await app["session"].close()

    async def stats(_: web.Request) -> web.Response:
        return web.json_response(
            {"requests": router.num_requests, "failed": router.num_failed, "backends": backend_urls}
        )

    async def proxy(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        index = router.pick(request.path, body)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in DROPPED_HEADERS}
        url = backend_urls[index] + request.path_qs
        async with app["session"].request(
            request.method, url, data=body, headers=headers
        ) as upstream:
            router.answered(request.path, index, upstream.status)
            response = web.StreamResponse(status=upstream.status)
            for key, value in upstream.headers.items():
                if key.lower() not in DROPPED_HEADERS:
                    response.headers[key] = value
            response.headers[BACKEND_HEADER] = str(index)
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():  # as it arrives: SSE unbuffered
                await response.write(chunk)
            await response.write_eof()
            return response

    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    app.router.add_get(STATS_PATH, stats)
    app.router.add_route("*", "/{tail:.*}", proxy)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", action="append", required=True, help="a server's base URL")
    args = parser.parse_args(argv)
    from aiohttp import web

    logging.basicConfig(level=logging.INFO)
    backends = [url.rstrip("/") for url in args.backend]
    web.run_app(build_app(backends), host="127.0.0.1", port=args.port, access_log=None)


if __name__ == "__main__":
    main()
