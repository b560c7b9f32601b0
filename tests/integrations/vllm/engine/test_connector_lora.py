"""Request keys in real engines: LoRA adapters and prompt embeddings, two engines, one sidecar.

Two adapters of the bundled model (random, fixed weights, written by the test) served by
two engines (`--enable-lora`, `--enable-prompt-embeds`, otherwise as the folder's `a` and
`b`): a prompt's K/V is shared between the engines within one adapter, never across
adapters nor with the base model; an adapter whose files are replaced in place keys anew;
a prompt-embeds request loads nothing and stores nothing. The oracle for shared K/V is the
first engine's own answer (it computed everything). One extra engine pair: the folder's
shared engines keep vLLM's defaults, which LoRA would change.
"""

from __future__ import annotations

import base64
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from conftest import AS_VLLM_RUNS, NAMESPACE, connector_config, started
from helpers.lora_adapters import RANK, write_adapter
from test_connector_engines import OTHER_TASK, TASK, full_blocks, wait_until_stored
from transformers import AutoTokenizer

from kvsplice.eval.bench.vllm.engine import Engine, EngineSpec, Sidecar, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

MAX_TOKENS = 16
LORA_FLAGS = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", str(RANK),
              "--enable-prompt-embeds")  # fmt: skip


@pytest.fixture(scope="module")
def lora_engines(
    model_dir: str, sidecar: Sidecar, log_dir: Path, adapters: dict[str, Path]
) -> Iterator[dict[str, Engine]]:
    modules = ("--lora-modules", *(f"{name}={path}" for name, path in adapters.items()))
    extra = (*AS_VLLM_RUNS["extra_args"], *LORA_FLAGS, *modules)  # type: ignore[misc]
    runs = {**AS_VLLM_RUNS, "extra_args": extra}
    config = connector_config(sidecar.target)
    specs = [EngineSpec(name, model_dir, free_port(), config, **runs) for name in ("l1", "l2")]  # type: ignore[arg-type]
    with started(specs, log_dir) as engines:
        yield engines


def complete(engine: Engine, body: dict[str, Any]) -> tuple[tuple[int, ...], int]:
    """(the greedy token ids, the prompt tokens served from a cache) of one completion."""
    body = {"model": engine.spec.model_dir, "max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS,
            "temperature": 0.0, "return_token_ids": True, **body}  # fmt: skip
    response = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=600.0)
    assert response.status_code == 200, response.text[:500]
    answer = response.json()
    details = answer["usage"].get("prompt_tokens_details") or {}
    return tuple(answer["choices"][0]["token_ids"]), int(details.get("cached_tokens") or 0)


def ask(engine: Engine, prompt: list[int], model: str | None = None) -> tuple[tuple[int, ...], int]:
    return complete(engine, {"prompt": prompt, **({"model": model} if model else {})})


@pytest.fixture(scope="module")
def prompts(model_dir: str) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [f"{TASK}\n\n{OTHER_TASK}\n\n" * 3, f"{OTHER_TASK}\n\n{TASK}\n\n" * 3]
    return [tokenizer.encode(text) for text in texts]


def test_kv_is_shared_within_an_adapter_never_across_adapters_nor_with_the_base(
    lora_engines: dict[str, Engine], sidecar: Sidecar, prompts: list[list[int]]
) -> None:
    l1, l2 = lora_engines["l1"], lora_engines["l2"]
    prompt = prompts[0]
    assert full_blocks(prompt) >= 256
    sql, cached = ask(l1, prompt, "sql")
    assert cached == 0
    wait_until_stored(sidecar, NAMESPACE)
    assert ask(l2, prompt, "sql") == (sql, full_blocks(prompt))  # l1's K/V, as l1 computed it
    math, cached = ask(l2, prompt, "math")  # another adapter: nothing, nor l2's own blocks
    assert cached == 0
    base, cached = ask(l2, prompt)
    assert cached == 0
    assert len({sql, math, base}) == 3  # the adapters change what the model computes
    wait_until_stored(sidecar, NAMESPACE)
    # l2 computed math and the base: l1 loads each under its own key
    assert ask(l1, prompt, "math") == (math, full_blocks(prompt))
    assert ask(l1, prompt) == (base, full_blocks(prompt))


def test_an_adapter_replaced_in_place_shares_nothing_with_its_old_version(
    lora_engines: dict[str, Engine], sidecar: Sidecar, prompts: list[list[int]],
    adapters: dict[str, Path], model_dir: str, tmp_path: Path,
) -> None:  # fmt: skip
    prompt = prompts[1]
    ask(lora_engines["l1"], prompt, "sql")
    wait_until_stored(sidecar, NAMESPACE)
    weights = adapters["sql"] / "adapter_model.safetensors"
    write_adapter(tmp_path / "retrained", model_dir, seed=3)
    os.replace(tmp_path / "retrained" / "adapter_model.safetensors", weights)
    # l2 never computed this prompt: only the sidecar could serve it, under the new key nothing
    assert ask(lora_engines["l2"], prompt, "sql")[1] == 0


def test_a_prompt_embeds_request_loads_nothing_and_stores_nothing(
    lora_engines: dict[str, Engine], sidecar: Sidecar, model_dir: str
) -> None:
    """vLLM gives a prompt-embeds request token ids of 0: a stored prompt of 0s (two blocks)
    must not serve it, and its own third block must not be stored under the 0s' chain."""
    ask(lora_engines["l1"], [0] * 300)
    stored = wait_until_stored(sidecar, NAMESPACE)
    hidden = json.loads((Path(model_dir) / "config.json").read_text())["hidden_size"]
    embeds = torch.randn(420, hidden, generator=torch.Generator().manual_seed(5)) * 0.02
    buffer = io.BytesIO()
    torch.save(embeds, buffer)
    body = {"prompt_embeds": base64.b64encode(buffer.getvalue()).decode()}
    token_ids, cached = complete(lora_engines["l2"], body)
    assert len(token_ids) == MAX_TOKENS and cached == 0
    assert wait_until_stored(sidecar, NAMESPACE) == stored
