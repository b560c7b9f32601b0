"""vLLM OpenAI servers and a kvsplice sidecar as child processes, for tests and `bench vllm`.

Owns starting, readiness, stopping and one streamed completion (TTFT, output ids,
cached prompt tokens). Knows nothing of workloads; never imports vLLM (the server
runs in its own process and virtualenv, this module only speaks HTTP to it).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 900.0  # a 2-core host under load took 6 minutes once
REQUEST_TIMEOUT_S = 600.0
# Pinned alike for every engine we compare: with vLLM's "auto", a configured
# connector makes it reserve a core, and the baseline would run on another count.
DEFAULT_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "LMCACHE_TRACK_USAGE": "false",
}


def free_port() -> int:
    """A loopback TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_counters(text: str, split_by: str | None = None) -> dict[str, float]:
    """The `vllm:*_total` samples of a Prometheus text page, summed as `Engine.counters` says."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:") or "_total" not in line.split(" ")[0]:
            continue
        name = line.split("{")[0].split(" ")[0]
        if split_by is not None and f'{split_by}="' in line:
            name += "[" + line.split(f'{split_by}="', 1)[1].split('"', 1)[0] + "]"
        totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def wait_all_ready(engines: list[Engine], timeout_s: float = START_TIMEOUT_S) -> None:
    """Wait for engines started together (they load at the same time)."""
    if engines:
        with ThreadPoolExecutor(len(engines)) as pool:
            list(pool.map(lambda engine: engine.wait_ready(timeout_s), engines))


class EngineError(RuntimeError):
    """An engine or sidecar process failed to start or answer."""


@dataclass(frozen=True)
class EngineSpec:
    """One `vllm.entrypoints.openai.api_server` process."""

    name: str
    model_dir: str
    port: int
    kv_transfer_config: dict[str, Any] | None = None
    enable_prefix_caching: bool = False
    dtype: str = "bfloat16"
    max_model_len: int = 4096
    env: dict[str, str] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    python: str = sys.executable
    log_stats: bool = False  # vLLM's stats and its Prometheus counters (/metrics)

    def command(self) -> list[str]:
        cmd = [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model_dir, "--port", str(self.port), "--host", "127.0.0.1",
            "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
            "--enforce-eager", "--enable-prompt-tokens-details",
            "--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching",
        ]  # fmt: skip
        if not self.log_stats:
            cmd.append("--disable-log-stats")
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return [*cmd, *self.extra_args]


@dataclass(frozen=True)
class Completion:
    token_ids: tuple[int, ...]
    ttft_s: float
    total_s: float
    num_prompt_tokens: int
    num_cached_tokens: int
    kv_transfer_params: dict[str, Any] | None = None  # the response's (non-streamed calls)


class Child:
    """A child process whose output goes to a log file; stopped with SIGTERM, then SIGKILL."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.command = command
        self.env = env
        self.log_path = log_dir / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def spawn(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            self.command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
            start_new_session=True,
        )  # fmt: skip
        log.close()

    def check_alive(self) -> None:
        if self.process is None or self.process.poll() is not None:
            tail = (
                self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""
            )
            raise EngineError(f"{self.name} exited; the end of {self.log_path}:\n{tail}")

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout_s)


class Engine(Child):
    """A vLLM OpenAI server; `complete` streams one completion of a token-id prompt."""

    def __init__(self, spec: EngineSpec, log_dir: Path) -> None:
        super().__init__(spec.name, spec.command(), {**DEFAULT_ENV, **spec.env}, log_dir)
        self.spec = spec
        self.url = f"http://127.0.0.1:{spec.port}"
        self._http = httpx.Client(timeout=REQUEST_TIMEOUT_S)

    def start(self) -> Engine:
        self.spawn()
        return self

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> Engine:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                if self._http.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise EngineError(f"{self.name} not ready after {timeout_s:.0f} s (log {self.log_path})")

    def complete(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        min_tokens: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> Completion:
        """Greedy completion, streamed: TTFT is the time to the first generated token.
        `kv_transfer_params`: the request field a connector reads (its answer comes back
        only unstreamed: `complete_with_params`)."""
        body: dict[str, Any] = {
            "model": self.spec.model_dir, "prompt": prompt_ids, "max_tokens": max_tokens,
            "min_tokens": min_tokens, "temperature": 0.0, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        token_ids: list[int] = []
        usage: dict[str, Any] = {}
        ttft_s = None
        start = time.perf_counter()
        with self._http.stream("POST", f"{self.url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise EngineError(
                    f"{self.name}: HTTP {response.status_code}: {response.read()[:500]!r}"
                )
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                for choice in chunk.get("choices", []):
                    new = choice.get("token_ids") or []
                    if new and ttft_s is None:
                        ttft_s = time.perf_counter() - start
                    token_ids.extend(new)
                usage = chunk.get("usage") or usage
        total_s = time.perf_counter() - start
        details = usage.get("prompt_tokens_details") or {}
        return Completion(
            tuple(token_ids), ttft_s if ttft_s is not None else total_s, total_s,
            int(usage.get("prompt_tokens", len(prompt_ids))), int(details.get("cached_tokens") or 0),
        )  # fmt: skip

    def complete_with_params(
        self, prompt_ids: list[int], *, max_tokens: int, kv_transfer_params: dict[str, Any]
    ) -> Completion:
        """Greedy completion with the request field `kv_transfer_params` (a connector's per-
        request settings), not streamed: vLLM returns the connector's answer in the final
        response only. `ttft_s` is then the whole call's time."""
        body: dict[str, Any] = {
            "model": self.spec.model_dir, "prompt": prompt_ids, "max_tokens": max_tokens,
            "min_tokens": max_tokens, "temperature": 0.0, "return_token_ids": True,
            "kv_transfer_params": kv_transfer_params,
        }  # fmt: skip
        start = time.perf_counter()
        response = self._http.post(f"{self.url}/v1/completions", json=body)
        total_s = time.perf_counter() - start
        if response.status_code != 200:
            raise EngineError(f"{self.name}: HTTP {response.status_code}: {response.text[:500]!r}")
        answer = response.json()
        usage = answer.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return Completion(
            tuple(answer["choices"][0].get("token_ids") or ()), total_s, total_s,
            int(usage.get("prompt_tokens", len(prompt_ids))), int(details.get("cached_tokens") or 0),
            answer.get("kv_transfer_params"),
        )  # fmt: skip

    def reset_prefix_cache(self) -> None:
        """Empty the engine's own prefix cache (needs VLLM_SERVER_DEV_MODE=1), retried while
        requests still hold blocks."""
        for _ in range(50):
            response = self._http.post(f"{self.url}/reset_prefix_cache", timeout=30.0)
            response.raise_for_status()
            if response.json().get("success"):
                return
            time.sleep(0.2)
        raise EngineError(f"{self.name}: its prefix cache could not be reset")

    def counters(self, split_by: str | None = None) -> dict[str, float]:
        """vLLM's Prometheus counters (`log_stats`), summed over labels: name -> value; with
        `split_by`, a counter carrying that label is kept per value: `name[value]` -> value."""
        return parse_counters(self._http.get(f"{self.url}/metrics", timeout=30.0).text, split_by)

    def stop(self, timeout_s: float = 60.0) -> None:
        self._http.close()
        super().stop(timeout_s)

    def __enter__(self) -> Engine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


@dataclass(frozen=True)
class AdminAccess:
    """How to reach a sidecar's admin API: TLS files (its CA, a client certificate under
    mTLS) and an admin tenant's token; all None for a plain local sidecar."""

    ca_path: str | None = None
    cert_path: str | None = None
    key_path: str | None = None
    token: str | None = None

    def httpx_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"timeout": 10.0}
        if self.ca_path:
            context = ssl.create_default_context(cafile=self.ca_path)
            if self.cert_path:
                context.load_cert_chain(self.cert_path, self.key_path)
            kwargs["verify"] = context
        if self.token:
            kwargs["headers"] = {"Authorization": f"Bearer {self.token}"}
        return kwargs


class Sidecar(Child):
    """`kvsplice serve` with an LMDB tier: restartable, its data surviving a restart."""

    def __init__(self, data_dir: Path, port: int, admin_port: int, log_dir: Path,
                 extra_args: tuple[str, ...] = (), admin: AdminAccess | None = None) -> None:  # fmt: skip
        command = [
            sys.executable, "-m", "kvsplice", "serve", "--listen", f"127.0.0.1:{port}",
            "--admin-listen", f"127.0.0.1:{admin_port}", "--lmdb-path", str(data_dir),
            "--no-lmdb-sync", *extra_args,
        ]  # fmt: skip
        super().__init__(f"sidecar-{port}", command, {}, log_dir)
        self.data_dir = data_dir
        self.target = f"127.0.0.1:{port}"
        self.admin = admin or AdminAccess()
        scheme = "https" if self.admin.ca_path else "http"
        self.admin_url = f"{scheme}://127.0.0.1:{admin_port}"

    def _get(self, path: str, **params: Any) -> httpx.Response:
        return httpx.get(f"{self.admin_url}{path}", params=params, **self.admin.httpx_kwargs())

    def start(self, timeout_s: float = 120.0) -> Sidecar:
        self.spawn()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                if self._get("/readyz").status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise EngineError(f"{self.name} not ready after {timeout_s:.0f} s (log {self.log_path})")

    def restart(self) -> Sidecar:
        self.stop()
        return self.start()

    def namespace_stats(self, namespace: str) -> dict[str, Any]:
        response = self._get("/v1/stats", namespace=namespace)
        response.raise_for_status()
        rows = response.json()["namespaces"]
        return rows[0] if rows else {}

    def segments(self, namespace: str) -> list[dict[str, Any]]:
        """Every stored segment's summary in `namespace` (the admin API's pages)."""
        found: list[dict[str, Any]] = []
        offset: int | None = 0
        while offset is not None:
            response = self._get("/v1/segments", namespace=namespace, offset=offset, limit=1000)
            response.raise_for_status()
            page = response.json()
            found += page["segments"]
            offset = page["next_offset"]
        return found


class LmcacheServer(Child):
    """LMCache's multi-process cache server (0.5.6), the peer `bench vllm` measures.

    `--supported-transfer-mode auto`: CPU engines use its engine-driven transfer (the
    default lmcache-driven one needs CUDA IPC), through a shared-memory pool
    (`--shm-name`: its fastest CPU mode; without it engines pickle every chunk);
    `--disable-metrics`: its Prometheus exporter is an optional dependency. It keeps
    everything in memory.
    """

    def __init__(
        self, port: int, http_port: int, log_dir: Path, env: dict[str, str], chunk_size: int = 256
    ) -> None:
        lmcache = str(Path(sys.executable).parent / "lmcache")
        command = [
            lmcache, "server", "--host", "127.0.0.1", "--port", str(port), "--l1-size-gb", "1",
            "--eviction-policy", "LRU", "--chunk-size", str(chunk_size),
            "--supported-transfer-mode", "auto", "--http-port", str(http_port),
            "--disable-metrics", "--shm-name", f"kvsplice-{port}",
        ]  # fmt: skip
        super().__init__(f"lmcache-{port}", command, {**DEFAULT_ENV, **env}, log_dir)
        self.port = port
        self.chunk_size = chunk_size
        self.status_url = f"http://127.0.0.1:{http_port}/status"

    def start(self, timeout_s: float = 300.0) -> LmcacheServer:
        if not Path(self.command[0]).exists():
            raise EngineError("lmcache is not installed in this virtualenv (make vllm installs it)")
        self.spawn()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                if httpx.get(self.status_url, timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise EngineError(f"{self.name} not ready after {timeout_s:.0f} s (log {self.log_path})")

    def bytes_per_token(self, chunk_tokens: int | None = None) -> float | None:
        """Bytes its memory tier holds per stored token (its objects are `chunk_size`-token
        chunks unless `chunk_tokens` says otherwise)."""
        status = httpx.get(self.status_url, timeout=10.0).json()
        l1 = status["storage_manager"]["l1_managers"]["_default"]
        count = int(l1["total_object_count"])
        tokens = count * (chunk_tokens or self.chunk_size)
        return l1["memory_used_bytes"] / tokens if count else None

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)  # its clean shutdown
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout_s)
