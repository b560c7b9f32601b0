"""The connector as a hardened deployment runs it: a sidecar with tenants and mutual TLS, an
engine whose token comes from its environment (never its command line or log).

A request whose `cache_salt` names a namespace the engine's token does not cover is
refused by the sidecar; the request is answered all the same (no external tokens) and
the engine keeps serving salted and plain requests alike.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import AS_VLLM_RUNS, connector_config
from helpers.tls import make_pki
from helpers.waiting import wait_for
from transformers import AutoTokenizer

from kvsplice.eval.bench.vllm.engine import AdminAccess, Engine, EngineSpec, Sidecar, free_port
from kvsplice.eval.workloads.token_transcript import PIPELINE_ROLES, TokenTranscript

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

NAMESPACE = "team-x"
TOKEN_ENV = "KVSPLICE_ENGINE_TOKEN"
TASK = "Write a Python function `is_prime(n)` that says whether an integer is a prime number."


def add_tenant(tenants: Path, name: str, namespace: str, role: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "kvsplice", "tenants", "add", name, "--namespace", namespace,
         "--role", role, "--file", str(tenants)],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return out.strip()  # the token alone on stdout; what to do next goes to stderr


@pytest.fixture(scope="module")
def deployment(
    tmp_path_factory: pytest.TempPathFactory, model_dir: str
) -> Iterator[tuple[Engine, Sidecar, str]]:
    root = tmp_path_factory.mktemp("tenancy")
    pki = make_pki(root)
    tenants = root / "tenants.json"
    engine_token = add_tenant(tenants, "engine", NAMESPACE, "writer")
    admin_token = add_tenant(tenants, "ops", "*", "admin")
    admin = AdminAccess(str(pki.ca), str(pki.client_cert), str(pki.client_key), admin_token)
    tls = ("--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
           "--tls-client-ca", str(pki.ca), "--tenants", str(tenants))  # fmt: skip
    sidecar = Sidecar(root / "lmdb", free_port(), free_port(), root, tls, admin).start()
    extra = {"token_env": TOKEN_ENV, "tls_ca": str(pki.ca), "tls_cert": str(pki.client_cert),
             "tls_key": str(pki.client_key)}  # fmt: skip
    env = {**AS_VLLM_RUNS["env"], TOKEN_ENV: engine_token}  # type: ignore[dict-item]
    spec = EngineSpec(
        "tenant-engine", model_dir, free_port(),
        connector_config(sidecar.target, NAMESPACE, **extra),
        **{**AS_VLLM_RUNS, "env": env},  # type: ignore[arg-type]
    )  # fmt: skip
    engine = Engine(spec, root).start()
    try:
        engine.wait_ready()
        yield engine, sidecar, engine_token
    finally:
        engine.stop()
        sidecar.stop()


def test_a_salt_the_token_does_not_cover_is_answered_and_the_engine_keeps_serving(
    deployment: tuple[Engine, Sidecar, str], model_dir: str
) -> None:
    engine, sidecar, token = deployment
    transcript = TokenTranscript(AutoTokenizer.from_pretrained(model_dir))
    prompt = transcript.first_prompt(TASK, PIPELINE_ROLES[0][1]) * 2
    plain = engine.complete(prompt, max_tokens=12, min_tokens=12)
    salted = [
        engine.complete(prompt, max_tokens=12, min_tokens=12, cache_salt=f"other-team-{i}")
        for i in range(3)
    ]
    assert all(s.token_ids == plain.token_ids for s in salted)  # float32: the same answer
    assert all(s.num_cached_tokens == 0 for s in salted)  # vLLM salts its own cache too
    again = engine.complete([*prompt, 13, 14], max_tokens=12, min_tokens=12)
    assert again.num_cached_tokens > 0  # still serving, its own prefix cache intact
    # the plain request's chunks reached the mTLS sidecar with the token from the environment
    stats = wait_for(
        lambda: sidecar.namespace_stats(NAMESPACE),
        lambda s: s.get("num_segments", 0) > 0,
        timeout_s=60.0,
        interval_s=0.5,
    )
    assert stats["num_segments"] > 0
    log = engine.log_path.read_text()
    assert token not in log  # neither in vLLM's logged config nor anywhere else
    assert log.count("lookup refused (PermissionDenied)") == 1  # said once, not per request
