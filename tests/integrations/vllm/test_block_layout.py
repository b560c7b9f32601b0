"""Block layouts and `check_supported`, against vLLM 0.32's own code.

CUDA layout: caches come from vLLM's allocator (`allocate_kv_cache`, what its GPU model
runner calls) and are written by its backends' own `do_kv_cache_update`; only the CUDA
kernel that update ends in is replaced by a torch copy of its reference semantics. The
CPU layout is learnt from a write op (simulated here; `engine/` runs vLLM's real one).
Tests that need vLLM skip where it is not installed (.venv); .venv-vllm runs them all.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvsplice.integrations.vllm.block_layout import (
    CpuBlockLayout,
    FlashBlockLayout,
    UnsupportedLayout,
    check_supported,
    layout_for,
)
from kvsplice.integrations.vllm.engine_layout import FLASH
from kvsplice.kvmath.payload import decode_payload, encode_payload
from kvsplice.kvmath.segment_kv import SegmentKV

H, BS, D = 3, 8, 4  # the simulated CPU probe's block
HEADS, DIM, NUM_BLOCKS = 4, 16, 7  # the vLLM-allocated caches
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
FINGERPRINT = "kvfp1-" + "ab" * 16
LAYOUT_NAMES = ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]  # vLLM's KVCacheLayout


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # NOTE: a shared 2-core machine
    yield
    torch.set_num_threads(threads)


# ---- the CUDA layout on caches vLLM builds and writes ------------------------------------


def make_caches(
    layout_name: str, dtype: torch.dtype, block_size: int, kernel_block_size: int | None = None
) -> list[torch.Tensor]:
    """Per-layer views `[B, H, N, 2D]` exactly as vLLM's worker allocates them (on CPU)."""
    pytest.importorskip("vllm")
    from vllm.config import CacheConfig, VllmConfig
    from vllm.v1.attention.backends.utils import record_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm.v1.worker.utils import allocate_kv_cache

    vllm_config = VllmConfig(cache_config=CacheConfig(block_size=block_size))
    record_kv_cache_layout(vllm_config.cache_config, layout_name)
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=HEADS, head_size=DIM, dtype=dtype)
    memory = NUM_BLOCKS * len(LAYERS) * spec.page_size_bytes
    config = get_kv_cache_config_from_groups(vllm_config, [KVCacheGroupSpec(LAYERS, spec)], memory)
    layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
    caches = allocate_kv_cache(
        config, torch.device("cpu"), layout, [kernel_block_size or block_size]
    )
    return [caches[name] for name in LAYERS]


def reference_reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    *scales: Any,
) -> None:
    """vLLM's `reshape_and_cache_flash` (a CUDA kernel) as its own test_cache.py states it:
    token i goes to `cache[slot // N, slot % N]` of the `[B, N, H, D]` views.

    key, value: [T, H, D]; slot_mapping: [T].
    """
    assert kv_cache_dtype == "auto"
    block_size = key_cache.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    key_cache[blocks, offsets] = key
    value_cache[blocks, offsets] = value


def backend_writer(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """`write(cache, key, value, slots)` through backend `name`'s own `do_kv_cache_update`
    (its K/V split of the cache view is vLLM's code; its CUDA kernel is the reference)."""
    from vllm.v1.attention.backend import AttentionType

    impl = SimpleNamespace(
        attn_type=AttentionType.DECODER,
        head_size=DIM,
        kv_cache_dtype="auto",
        _is_per_token_head_quant=False,
    )
    if name == "FLASH_ATTN":
        from vllm.v1.attention.backends import flash_attn as module

        update = module.FlashAttentionImpl.do_kv_cache_update
        monkeypatch.setattr(
            module, "reshape_and_cache_flash", reference_reshape_and_cache_flash, raising=False
        )
    elif name == "TRITON_ATTN":
        from vllm.v1.attention.backends import triton_attn as module

        update = module.TritonAttentionImpl.do_kv_cache_update
        monkeypatch.setattr(
            module, "triton_reshape_and_cache_flash", reference_reshape_and_cache_flash
        )
    else:
        assert name == "FLEX_ATTENTION"
        from vllm.v1.attention.backends import flex_attention as module

        update = module.FlexAttentionImpl.do_kv_cache_update
        monkeypatch.setattr(
            torch.ops._C_cache_ops,
            "reshape_and_cache_flash",
            reference_reshape_and_cache_flash,
            raising=False,
        )
    layer = SimpleNamespace(_k_scale=torch.ones(()), _v_scale=torch.ones(()))
    return lambda cache, key, value, slots: update(impl, layer, key, value, cache, slots)


def slots_of(block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    return (block_ids.view(-1, 1) * block_size + torch.arange(block_size)).reshape(-1)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("layout_name", LAYOUT_NAMES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gather_payload_scatter_round_trips_vllm_written_blocks_bit_exact(
    layout_name: str, block_size: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    caches = make_caches(layout_name, dtype, block_size)
    write = backend_writer("FLASH_ATTN", monkeypatch)
    ids, fresh_ids = torch.tensor([5, 2, 6]), torch.tensor([0, 3, 1])
    num_tokens = len(ids) * block_size
    keys = torch.randn(len(LAYERS), num_tokens, HEADS, DIM).to(dtype)  # [L, T, H, D]
    values = torch.randn(len(LAYERS), num_tokens, HEADS, DIM).to(dtype)
    for layer, cache in enumerate(caches):
        write(cache, keys[layer], values[layer], slots_of(ids, block_size))

    layout = layout_for(caches[0], block_size, FLASH)
    gathered = [layout.gather(cache, ids) for cache in caches]
    seg = SegmentKV(
        torch.stack([k for k, _ in gathered]),
        torch.stack([v for _, v in gathered]),
        start_position=0,
    )
    assert torch.equal(bits(seg.keys), bits(keys.transpose(1, 2)))  # [L, H, T, D], the oracle
    assert torch.equal(bits(seg.values), bits(values.transpose(1, 2)))
    payload = encode_payload(seg, model_fingerprint=FINGERPRINT, quant="none")
    back = decode_payload(payload, expect_fingerprint=FINGERPRINT, dtype=dtype)

    fresh = make_caches(layout_name, dtype, block_size)
    for layer, cache in enumerate(fresh):
        layout.scatter(cache, fresh_ids, back.keys[layer], back.values[layer])
    for cache, written in zip(fresh, caches, strict=True):
        assert torch.equal(bits(cache[fresh_ids]), bits(written[ids]))
        others = torch.ones(NUM_BLOCKS, dtype=torch.bool)
        others[fresh_ids] = False
        assert not bits(cache[others]).any()  # no other block, nor the other layer, touched


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"])
@pytest.mark.parametrize("layout_name", ["LBNHC", "BLHNC"])
def test_each_cuda_backends_write_is_read_back_by_the_flash_layout(
    backend: str, layout_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    caches = make_caches(layout_name, torch.bfloat16, 16)
    write = backend_writer(backend, monkeypatch)
    ids = torch.tensor([4, 1])
    key, value = torch.randn(2, 32, HEADS, DIM).to(torch.bfloat16)  # each [T, H, D]
    write(caches[1], key, value, slots_of(ids, 16))
    k, v = layout_for(caches[1], 16, FLASH).gather(caches[1], ids)
    assert torch.equal(k, key.transpose(0, 1)) and torch.equal(v, value.transpose(0, 1))


def test_kernel_blocks_smaller_than_vllms_blocks_are_addressed_by_kernel_block_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # vLLM splits each 32-token block into two 16-token kernel blocks (rows 2b, 2b + 1)
    caches = make_caches("LBNHC", torch.float16, 32, kernel_block_size=16)
    write = backend_writer("FLASH_ATTN", monkeypatch)
    kernel_ids = torch.tensor([6, 7, 2, 3])  # vLLM blocks 3 and 1
    key, value = torch.randn(2, 64, HEADS, DIM).to(torch.float16)
    write(caches[0], key, value, slots_of(kernel_ids, 16))
    layout = layout_for(caches[0], 32, FLASH)
    assert layout == FlashBlockLayout(block_size=16, num_kv_heads=HEADS, head_dim=DIM)
    k, _ = layout.gather(caches[0], kernel_ids)
    assert torch.equal(k, key.transpose(0, 1))


def test_layout_for_refuses_a_cache_that_is_not_the_4d_view() -> None:
    with pytest.raises(UnsupportedLayout, match="not \\[num_blocks, H_kv, N, 2 \\* D\\]"):
        layout_for(torch.zeros(2, 5, BS, H, D), BS, FLASH)  # the pre-0.32 [2, B, N, H, D]
    with pytest.raises(UnsupportedLayout, match="unknown layout kind"):
        layout_for(torch.zeros(5, H, BS, 2 * D), BS, "paged")
    with pytest.raises(UnsupportedLayout, match="ISA"):
        layout_for(torch.zeros(5, H, BS, 2 * D), BS, "cpu", None)


@pytest.mark.gpu
def test_flash_layout_round_trips_on_cuda() -> None:
    # torch only: an LBNHC view of one layer ([B, N, H, 2D] in memory), written the way
    # vLLM's backends split it (`transpose(1, 2).split(D, -1)`)
    storage = torch.zeros(NUM_BLOCKS, 16, HEADS, 2 * DIM, device="cuda", dtype=torch.bfloat16)
    cache = storage.permute(0, 2, 1, 3)  # [B, H, N, 2D], not contiguous
    ids = torch.tensor([5, 2, 0])
    key, value = torch.randn(2, 48, HEADS, DIM, device="cuda").to(torch.bfloat16)
    key_cache, value_cache = cache.transpose(1, 2).split(DIM, dim=-1)
    reference_reshape_and_cache_flash(
        key, value, key_cache, value_cache, slots_of(ids, 16).cuda(), "auto"
    )
    layout = layout_for(cache, 16, FLASH)
    k, v = layout.gather(cache, ids)
    seg = SegmentKV(k.cpu()[None], v.cpu()[None], start_position=0)
    back = decode_payload(
        encode_payload(seg, model_fingerprint=FINGERPRINT, quant="none"),
        expect_fingerprint=FINGERPRINT,
        dtype=torch.bfloat16,
    )
    fresh = torch.zeros_like(storage).permute(0, 2, 1, 3)
    layout.scatter(fresh, torch.tensor([1, 6, 3]), back.keys[0], back.values[0])
    assert torch.equal(bits(fresh[[1, 6, 3]]), bits(cache[ids]))
    assert torch.equal(k, key.transpose(0, 1))


# ---- the CPU layout, learnt from a (simulated) write op -------------------------------------


def simulated_write(values: torch.Tensor) -> torch.Tensor:
    """A block as the `vec` CPU kernel writes it: per head, K as [D, BS] then V as [BS, D]."""
    block = torch.zeros(H, 2 * BS * D, dtype=torch.int64)
    for h in range(H):
        block[h, : BS * D] = values[:, h, :].transpose(0, 1).reshape(-1)  # K transposed
        block[h, BS * D :] = values[:, h, :].reshape(-1)
    return block.reshape(-1)


def test_the_cpu_layout_learnt_from_a_write_op_inverts_it() -> None:
    shape = (BS, H, D)
    coords = [
        torch.arange(n).view(*(n if i == axis else 1 for i in range(3))).expand(shape)
        for axis, n in enumerate(shape)
    ]
    where = []
    for coord in coords:
        flat = simulated_write(coord).view(H, 2, BS * D)
        unset = torch.full_like(flat[:, 0], -1)
        k_part = torch.stack([flat[:, 0], unset], dim=1).reshape(-1)
        v_part = torch.stack([unset, flat[:, 1]], dim=1).reshape(-1)
        where.append((k_part, v_part))
    layout = CpuBlockLayout._from_probes(where, H, BS, D)
    tokens_k, tokens_v = torch.randn(BS, H, D), torch.randn(BS, H, D)
    block = torch.zeros(H, 2 * BS * D)
    for h in range(H):
        block[h, : BS * D] = tokens_k[:, h].transpose(0, 1).reshape(-1)
        block[h, BS * D :] = tokens_v[:, h].reshape(-1)
    cache = torch.zeros(4, H, BS, 2 * D)
    cache[2] = block.view(H, BS, 2 * D)
    k, v = layout.gather(cache, torch.tensor([2]))
    assert torch.equal(k, tokens_k.transpose(0, 1)) and torch.equal(v, tokens_v.transpose(0, 1))
    again = torch.zeros_like(cache)
    layout.scatter(again, torch.tensor([2]), k, v)
    assert torch.equal(again, cache)


# ---- check_supported on vLLM's resolved configs ------------------------------------------

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
}
DEEPSEEK_V3 = {  # MLA: K/V live in one latent vector per token
    **LLAMA,
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "num_key_value_heads": 2,
    "moe_intermediate_size": 32,
    "kv_lora_rank": 32,
    "q_lora_rank": None,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {}
    for name, config in (("llama", LLAMA), ("deepseek_v3", DEEPSEEK_V3)):
        path = tmp_path_factory.mktemp(name)
        (path / "config.json").write_text(json.dumps(config))
        dirs[name] = path
    return dirs


def make_vllm_config(model_dir: Path, cache_dtype: str = "auto") -> Any:
    pytest.importorskip("vllm")
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    model_config = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16")
    cache_config = CacheConfig(block_size=32, cache_dtype=cache_dtype)  # type: ignore[arg-type]
    return VllmConfig(model_config=model_config, cache_config=cache_config)


@pytest.fixture
def platform_picks(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    """Make vLLM's platform answer its selector with backend `name` (this host is a CPU)."""
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import _cached_get_attn_backend

    def pick(name: str) -> None:
        path = AttentionBackendEnum[name].get_path()
        monkeypatch.setattr(current_platform, "get_attn_backend_cls", lambda *a, **k: path)
        _cached_get_attn_backend.cache_clear()

    yield pick
    _cached_get_attn_backend.cache_clear()


def test_check_supported_accepts_the_cpu_backend(model_dirs: dict[str, Path]) -> None:
    assert check_supported(make_vllm_config(model_dirs["llama"])) == "cpu"


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"])
def test_check_supported_accepts_the_cuda_backends_vllms_selector_picks(
    backend: str, model_dirs: dict[str, Path], platform_picks: Callable[[str], None]
) -> None:
    platform_picks(backend)
    assert check_supported(make_vllm_config(model_dirs["llama"])) == "flash"


def test_check_supported_refuses_a_backend_without_a_layout(
    model_dirs: dict[str, Path], platform_picks: Callable[[str], None]
) -> None:
    platform_picks("FLASH_ATTN_DIFFKV")  # K and V of different widths
    with pytest.raises(UnsupportedLayout, match="FLASH_ATTN_DIFFKV has no kvsplice block layout"):
        check_supported(make_vllm_config(model_dirs["llama"]))


def test_check_supported_refuses_mla(model_dirs: dict[str, Path]) -> None:
    with pytest.raises(UnsupportedLayout, match="uses MLA"):
        check_supported(make_vllm_config(model_dirs["deepseek_v3"]))


def test_check_supported_refuses_a_quantized_kv_cache(model_dirs: dict[str, Path]) -> None:
    with pytest.raises(UnsupportedLayout, match="cache_dtype 'fp8'"):
        check_supported(make_vllm_config(model_dirs["llama"], cache_dtype="fp8"))


@pytest.mark.parametrize(
    ("backends", "verdict"),
    [
        (["FLASHINFER", "FLASHINFER"], "flash"),
        (["FLASH_ATTN", "MAMBA2_ATTN"], "MAMBA2_ATTN has no kvsplice block layout"),
    ],
)
def test_once_the_model_is_loaded_its_layers_backends_decide(
    backends: list[str], verdict: str, model_dirs: dict[str, Path]
) -> None:
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    class Layer(AttentionLayerBase):
        def __init__(self, name: str) -> None:
            self.backend = type(name, (), {"get_name": staticmethod(lambda: name)})

        def get_attn_backend(self) -> Any:
            return self.backend

        def get_kv_cache_spec(self, vllm_config: Any) -> None:
            return None

    vllm_config = make_vllm_config(model_dirs["llama"])
    context = vllm_config.compilation_config.static_forward_context
    context.update({f"model.layers.{i}.attn": Layer(name) for i, name in enumerate(backends)})
    if verdict == "flash":
        assert check_supported(vllm_config) == "flash"
    else:
        with pytest.raises(UnsupportedLayout, match=verdict):
            check_supported(vllm_config)
