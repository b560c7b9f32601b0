"""Request keys on vLLM's own request objects: built by its `InputProcessor` from a served
model's config (LoRA and prompt embeddings enabled), turned into the scheduler's `Request`
as its engine core does (`Request.from_engine_core_request`). No engine runs."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers.lora_adapters import write_adapter
from vllm.engine.arg_utils import EngineArgs
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.input_processor import InputProcessor
from vllm.v1.request import Request

from kvsplice.integrations.vllm.adapter_digest import AdapterDigests
from kvsplice.integrations.vllm.request_keys import check_request_fields, request_root

FINGERPRINT = "kvfp1-" + "ab" * 16
PROMPT = list(range(100, 140))


@pytest.fixture(scope="module")
def processor(model_dir: str) -> InputProcessor:
    args = EngineArgs(
        model=model_dir, dtype="float32", max_model_len=2048, enable_lora=True, max_loras=2,
        max_lora_rank=8, enable_prompt_embeds=True,
    )  # fmt: skip
    processor = InputProcessor(args.create_engine_config())
    # NOTE: a text model has no encoder cache; the multimodal requests below need a budget
    processor.mm_encoder_cache_size = 4096
    return processor


def vllm_request(
    processor: InputProcessor, prompt: dict[str, Any], lora: LoRARequest | None = None
) -> Request:
    """The scheduler's Request for `prompt` (an engine input), as vLLM's front end and
    engine core build it."""
    core = processor.process_inputs(
        "r", prompt, SamplingParams(max_tokens=1), ("generate",), lora_request=lora
    )
    return Request.from_engine_core_request(core, block_hasher=None)


def tokens(ids: list[int] = PROMPT) -> dict[str, Any]:
    return {"type": "token", "prompt_token_ids": list(ids)}


def root_of(processor: InputProcessor, prompt: dict, lora: LoRARequest | None = None,
            digests: AdapterDigests | None = None) -> str | None:  # fmt: skip
    return request_root(
        FINGERPRINT, vllm_request(processor, prompt, lora), digests or AdapterDigests()
    )


def test_vllm_requests_carry_every_field_the_key_reads() -> None:
    check_request_fields()  # vLLM's own Request

    renamed = SimpleNamespace(prompt_embeds=None, mm_features=[])  # vLLM renamed lora_request
    with pytest.raises(ValueError, match="lora_request"):
        check_request_fields(renamed)
    with pytest.raises(AttributeError):  # read by name: never silently "no adapter"
        request_root(FINGERPRINT, renamed)


def test_an_adapters_requests_share_their_root_never_another_adapters_nor_the_bases(
    processor: InputProcessor, adapters: dict[str, Path]
) -> None:
    digests = AdapterDigests()
    base = root_of(processor, tokens(), None, digests)
    sql = root_of(processor, tokens(), LoRARequest("sql", 1, str(adapters["sql"])), digests)
    math = root_of(processor, tokens(), LoRARequest("math", 2, str(adapters["math"])), digests)
    assert base == FINGERPRINT
    assert len({base, sql, math}) == 3
    # another engine serving the same files under another name and id: the same K/V
    renamed = LoRARequest("sql-v1", 7, str(adapters["sql"]))
    assert root_of(processor, tokens(), renamed, digests) == sql


def test_an_adapter_replaced_in_place_gets_a_new_root_and_is_hashed_once_per_version(
    processor: InputProcessor, adapters: dict[str, Path], model_dir: str, tmp_path: Path
) -> None:
    path = tmp_path / "sql"
    shutil.copytree(adapters["sql"], path)
    lora = LoRARequest("sql", 1, str(path))
    digests = AdapterDigests()
    before = [root_of(processor, tokens(), lora, digests) for _ in range(3)]
    assert len(set(before)) == 1 and digests.num_hashed_files == 2  # stat per request, no reads
    weights = path / "adapter_model.safetensors"
    stat = weights.stat()
    write_adapter(tmp_path / "retrained", model_dir, seed=3)
    os.replace(tmp_path / "retrained" / "adapter_model.safetensors", weights)  # same name, path
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    after = root_of(processor, tokens(), lora, digests)
    assert after not in (None, before[0])
    assert digests.num_hashed_files == 3  # only the replaced file read again
    assert root_of(processor, tokens(), lora, AdapterDigests()) == after  # a restart agrees


def test_an_adapter_that_is_not_a_local_directory_shares_nothing(processor: InputProcessor) -> None:
    lora = LoRARequest("hub", 1, "someone/some-adapter")
    assert root_of(processor, tokens(), lora) is None


def test_a_prompt_embeds_request_is_never_keyed(processor: InputProcessor) -> None:
    embeds = {"type": "embeds", "prompt_embeds": torch.randn(len(PROMPT), 576)}
    request = vllm_request(processor, embeds)
    assert list(request.all_token_ids) == [0] * len(PROMPT)  # vLLM's ids: all 0
    assert request_root(FINGERPRINT, request) is None


def image(ids: list[int], mm_hash: str, offset: int, length: int = 8) -> dict[str, Any]:
    """A multimodal engine input as a multimodal model's processor hands it over."""
    return {
        "type": "multimodal", "prompt_token_ids": list(ids), "mm_kwargs": {"image": [None]},
        "mm_placeholders": {"image": [PlaceholderRange(offset=offset, length=length)]},
        "mm_hashes": {"image": [mm_hash]},
    }  # fmt: skip


def test_the_images_hashes_and_places_reach_the_root(processor: InputProcessor) -> None:
    cat = root_of(processor, image(PROMPT, "cat", 4))
    assert cat not in (None, FINGERPRINT)
    assert root_of(processor, image(PROMPT, "cat", 4)) == cat  # the same image, same place
    assert root_of(processor, image(PROMPT, "dog", 4)) != cat  # another image, same tokens
    assert root_of(processor, image(PROMPT, "cat", 12)) != cat  # the image elsewhere
