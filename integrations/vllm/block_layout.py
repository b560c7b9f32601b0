"""vLLM's paged KV blocks <-> kvsplice's token-major K/V, one class per layout kind.

A layout moves whole blocks of one layer's cache: `gather` copies blocks out as
`k, v: [H_kv, n_blocks * block_size, D]`, `scatter` writes such tensors into
blocks. kvsplice's payloads stay token-major (`[L, H_kv, T, D]`) whatever the engine.
Which kind an engine uses is `engine_layout.check_supported`'s verdict, not a guess
from the tensor. In vLLM 0.32 every layer's cache is the view
`[num_blocks, H_kv, block_size, 2 * D]`; the kinds differ inside it:

- CPU (`CPU_ATTN`): how K and V sit inside one (block, head) slab depends on the
  kernel's ISA (K is stored transposed on `vec`). Rather than hard-code that,
  `CpuBlockLayout.probe` asks vLLM's own cache-write op where each (token, head,
  dim) lands, once.
- CUDA (`FLASH_ATTN`, `FLASHINFER`, `TRITON_ATTN`, `FLEX_ATTENTION`): K is the first
  D of the last dim, V the last D (`FlashBlockLayout`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch

from kvsplice.integrations.vllm.engine_layout import CPU, FLASH, UnsupportedLayout, check_supported

__all__ = [
    "BlockLayout",
    "CpuBlockLayout",
    "FlashBlockLayout",
    "UnsupportedLayout",
    "check_supported",
    "layout_for",
]

logger = logging.getLogger(__name__)


class BlockLayout(Protocol):
    # read-only: the layouts are frozen dataclasses
    @property
    def block_size(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...

    def gather(
        self, cache: torch.Tensor, block_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def tokens(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def tokens_into(
        self, blocks: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor
    ) -> None: ...

    def scatter(
        self, cache: torch.Tensor, block_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None: ...


@dataclass(frozen=True)
class CpuBlockLayout:
    """Where K and V of each (head, token, dim) sit in one CPU block (flat offsets).

    k_offsets, v_offsets: [H_kv, block_size, D] int64 offsets into a block's
    `H_kv * block_size * 2 * D` elements.
    """

    block_size: int
    num_kv_heads: int
    head_dim: int
    k_offsets: torch.Tensor
    v_offsets: torch.Tensor

    @classmethod
    def probe(cls, cache: torch.Tensor, isa: str) -> CpuBlockLayout:
        """Learn the layout of `cache` ([num_blocks, H_kv, block_size, 2 * D]) from vLLM's
        own `cpu_attn_reshape_and_cache`, writing coordinates into a scratch block."""
        _, heads, block_size, twice_dim = cache.shape
        head_dim = twice_dim // 2
        coords = _coordinates(heads, block_size, head_dim)  # [3, T, H, D]: token, head, dim
        where = [_written(cache.dtype, c, heads, block_size, head_dim, isa) for c in coords]
        return cls._from_probes(where, heads, block_size, head_dim)

    @classmethod
    def _from_probes(
        cls, where: list[tuple[torch.Tensor, torch.Tensor]], heads: int, block_size: int, dim: int
    ) -> CpuBlockLayout:
        offsets = []
        for part in (0, 1):  # 0: K, 1: V
            token, head, d = (where[i][part] for i in range(3))  # each [block elements], -1: unset
            written = (token >= 0).nonzero().squeeze(1)
            table = torch.full((heads, block_size, dim), -1, dtype=torch.int64)
            table[head[written], token[written], d[written]] = written
            if (table < 0).any() or written.numel() != heads * block_size * dim:
                raise UnsupportedLayout("the CPU cache-write op is not a permutation of K/V slots")
            offsets.append(table)
        return cls(block_size, heads, dim, offsets[0], offsets[1])

    def gather(
        self, cache: torch.Tensor, block_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens(cache.index_select(0, block_ids))

    def tokens(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V `[H_kv, n * bs, D]` of blocks copied out of a cache (`[n, H_kv, bs, 2D]`)."""
        strided = self._strided_views(blocks)
        if strided is not None:
            return self._tokens(strided[0]), self._tokens(strided[1])
        flat = blocks.reshape(len(blocks), -1)  # [n, block elems]
        return self._tokens(flat[:, self.k_offsets]), self._tokens(flat[:, self.v_offsets])

    def tokens_into(self, blocks: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        """`tokens` written into k_out, v_out `[H_kv, n * bs, D]` (contiguous): one pass
        where the placement is affine."""
        strided = self._strided_views(blocks)
        if strided is None:
            k, v = self.tokens(blocks)
            k_out.copy_(k)
            v_out.copy_(v)
            return
        n = len(blocks)
        k_out.view(self.num_kv_heads, n, self.block_size, -1).copy_(strided[0].transpose(0, 1))
        v_out.view(self.num_kv_heads, n, self.block_size, -1).copy_(strided[1].transpose(0, 1))

    def scatter(
        self, cache: torch.Tensor, block_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write k, v `[H_kv, n * bs, D]` (any strides) into blocks `block_ids` of `cache`."""
        n = len(block_ids)
        strided = self._strided_views(cache)
        if strided is not None:  # one pass, straight from the source
            strided[0].index_copy_(0, block_ids, self._blocks(k, n))
            strided[1].index_copy_(0, block_ids, self._blocks(v, n))
            return
        flat = torch.empty((n, cache[0].numel()), dtype=cache.dtype)
        flat[:, self.k_offsets] = self._blocks(k, n)
        flat[:, self.v_offsets] = self._blocks(v, n)
        cache.index_copy_(0, block_ids, flat.view(n, *cache.shape[1:]))

    @cached_property
    def _affine_offsets(self) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
        return _affine(self.k_offsets), _affine(self.v_offsets)

    def _strided_views(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K and V of contiguous `blocks` as `[n, H_kv, bs, D]` views, where the kernel's
        placement is affine in (head, token, dim) (every ISA measured so far); else None."""
        k_affine, v_affine = self._affine_offsets
        if k_affine is None or v_affine is None or not blocks.is_contiguous():
            return None
        size = (len(blocks), self.num_kv_heads, self.block_size, self.head_dim)
        block_elems = blocks[0].numel() if len(blocks) else 0
        return tuple(  # type: ignore[return-value]
            blocks.as_strided(size, (block_elems, *strides), blocks.storage_offset() + base)
            for base, *strides in (k_affine, v_affine)
        )

    def _tokens(self, per_block: torch.Tensor) -> torch.Tensor:
        # [n, H, bs, D] -> [H, n * bs, D]
        n = per_block.shape[0]
        return per_block.permute(1, 0, 2, 3).reshape(self.num_kv_heads, n * self.block_size, -1)

    def _blocks(self, tokens: torch.Tensor, n: int) -> torch.Tensor:
        # [H, n * bs, D] -> [n, H, bs, D]
        return tokens.reshape(self.num_kv_heads, n, self.block_size, -1).permute(1, 0, 2, 3)


@dataclass(frozen=True)
class FlashBlockLayout:
    """vLLM 0.32's CUDA layout: a layer's cache is the view `[num_blocks, H_kv, block_size,
    2 * D]`, K in the first D of the last dim and V in the last D.

    NOTE: the view's strides follow the resolved `KVCacheLayout` (LBNHC puts tokens outside
    heads; block-outer layouts put other layers' pages between blocks), so it is often not
    contiguous. Blocks therefore move only through `index_select` / `index_copy_` on the
    view itself, which honour any strides; never through `.view()` or a flat copy.
    """

    block_size: int
    num_kv_heads: int
    head_dim: int

    def gather(
        self, cache: torch.Tensor, block_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens(cache.index_select(0, block_ids.to(cache.device)))

    def tokens(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V `[H_kv, n * bs, D]` of blocks copied out of a cache (`[n, H_kv, bs, 2D]`)."""
        k, v = blocks.split(self.head_dim, dim=-1)  # each [n, H, bs, D]
        return self._tokens(k), self._tokens(v)

    def tokens_into(self, blocks: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        """`tokens` written into k_out, v_out `[H_kv, n * bs, D]` (contiguous), one pass."""
        n = len(blocks)
        k, v = blocks.split(self.head_dim, dim=-1)  # each [n, H, bs, D]
        k_out.view(self.num_kv_heads, n, self.block_size, -1).copy_(k.transpose(0, 1))
        v_out.view(self.num_kv_heads, n, self.block_size, -1).copy_(v.transpose(0, 1))

    def scatter(
        self, cache: torch.Tensor, block_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        both = torch.cat([k, v], dim=-1).to(cache.device, cache.dtype)  # [H, n * bs, 2D]
        blocks = both.view(self.num_kv_heads, len(block_ids), self.block_size, -1)
        cache.index_copy_(0, block_ids.to(cache.device), blocks.transpose(0, 1))

    def _tokens(self, per_block: torch.Tensor) -> torch.Tensor:
        # [n, H, bs, D] -> [H, n * bs, D] (a copy: `per_block` is a strided split)
        return per_block.transpose(0, 1).reshape(self.num_kv_heads, -1, self.head_dim)


def layout_for(
    cache: torch.Tensor, block_size: int, kind: str, cpu_isa: str | None = None
) -> BlockLayout:
    """The layout of one layer's `cache` as vLLM registered it.

    `cache`: [num_blocks, H_kv, N, 2 * D], N the kernel block size (vLLM may split each
    of its `block_size`-token blocks into several kernel blocks); `kind`: what
    `check_supported` returned; `cpu_isa`: the CPU attention kernel's ISA (CPU only).
    The layout's `block_size` is N, and its block ids count kernel blocks.
    """
    if cache.dim() != 4 or cache.shape[-1] % 2 or block_size % cache.shape[2]:
        raise UnsupportedLayout(
            f"KV cache of shape {tuple(cache.shape)} is not [num_blocks, H_kv, N, 2 * D] "
            f"with N dividing the block size {block_size}"
        )
    if kind == CPU:
        if cache.device.type != "cpu" or cpu_isa is None:
            raise UnsupportedLayout(
                f"the CPU layout needs a CPU cache (got {cache.device.type}) and the CPU "
                f"attention kernel's ISA (got {cpu_isa!r})"
            )
        return CpuBlockLayout.probe(cache, cpu_isa)
    if kind == FLASH:
        _, heads, kernel_block_size, twice_dim = cache.shape
        return FlashBlockLayout(int(kernel_block_size), int(heads), int(twice_dim) // 2)
    raise UnsupportedLayout(f"unknown layout kind {kind!r} (expected {CPU!r} or {FLASH!r})")


def _affine(offsets: torch.Tensor) -> tuple[int, ...] | None:
    """(base, head stride, token stride, dim stride) when `offsets[h, t, d]` (`[H, bs, D]`)
    is `base + h * sh + t * st + d * sd` for every slot; None for any other placement."""
    base = int(offsets[0, 0, 0])
    steps = [
        int(offsets[tuple(int(i == axis) for i in range(3))]) - base if offsets.shape[axis] > 1
        else 0
        for axis in range(3)
    ]  # fmt: skip
    grid = torch.meshgrid(*(torch.arange(n) for n in offsets.shape), indexing="ij")
    predicted = torch.full_like(offsets, base)
    for coordinate, step in zip(grid, steps, strict=True):
        predicted += coordinate * step
    return (base, *steps) if torch.equal(predicted, offsets) else None


def _coordinates(heads: int, block_size: int, dim: int) -> list[torch.Tensor]:
    shape = (block_size, heads, dim)
    token = torch.arange(block_size).view(-1, 1, 1).expand(shape)
    head = torch.arange(heads).view(1, -1, 1).expand(shape)
    d = torch.arange(dim).view(1, 1, -1).expand(shape)
    return [token, head, d]


def _written(
    dtype: torch.dtype, coord: torch.Tensor, heads: int, block_size: int, dim: int, isa: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per element of one scratch block: which `coord` value the op wrote there, as K and as V.

    Returns (k_part, v_part), each [block elements] with -1 outside its half (vLLM
    splits each head's slab into a K half and a V half) and where nothing was
    written. Coordinates go in as `c + 1` in base-64 digits (exact in bf16 and fp16).
    """
    from vllm import _custom_ops as ops

    total = torch.zeros(heads * block_size * 2 * dim, dtype=torch.int64)
    for scale in (1, 64, 4096):
        digit = ((coord + 1) // scale) % 64
        cache = torch.zeros((1, heads, block_size, 2 * dim), dtype=dtype)
        k_cache, v_cache = cache.view(1, heads, 2 * block_size, dim).chunk(2, dim=2)
        values = digit.to(dtype).contiguous()
        slots = torch.arange(block_size, dtype=torch.int64)
        ops.cpu_attn_reshape_and_cache(
            values, values, k_cache, v_cache, slots, isa,
            k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto",
        )  # fmt: skip
        total += scale * cache.reshape(-1).to(torch.int64)
    per_head = (total - 1).view(heads, 2, block_size * dim)  # [H, K|V, bs * D]
    unset = torch.full_like(per_head[:, 0], -1)
    k_part = torch.stack([per_head[:, 0], unset], dim=1).reshape(-1)
    v_part = torch.stack([unset, per_head[:, 1]], dim=1).reshape(-1)
    return k_part, v_part
