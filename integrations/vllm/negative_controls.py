"""Deliberately damaged approximate K/V: the negative controls of the graded yardstick.

A yardstick that admits approximate reuse must be shown able to refuse it. These controls
keep every token id of an approximate run right and change only its K/V, as a faulty mode
would: `unrotated` leaves the keys at the positions they were stored at (the RoPE Δ not
applied); `noise` adds Gaussian noise to the moved keys and the values, its standard
deviation `NOISE_FRACTION` of each layer's own root-mean-square over the run. They exist
for `kvsplice bench vllm --configs control-unrotated,control-noise` and nothing else: an
engine runs one only when its `kv_connector_extra_config` names it (`negative_control`),
and says so at its start. Owns the damage, not when it applies (the worker half's loads:
`applied_delta`, then `damage_in_place` on what was written).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where K/V is damaged: the names are read torch-free
    import torch

UNROTATED = "unrotated"
NOISE = "noise"
NEGATIVE_CONTROLS = (UNROTATED, NOISE)
# NOTE: fixed before any graded run (issue 50). Measured afterwards on real spans (Qwen2.5-
# Coder-0.5B, MMLU persona-first user turns after two personas; scripts/measure_span_drift.py,
# docs/span-drift-qwen-mmlu-2026-12-01.json): naive's own error against in-context K/V is
# K 2% -> 12% with depth, V 6% -> 20% (26% at worst), so this control is damage of naive's
# order (1.3-2.5x by thirds of the layers): a yardstick that cannot refuse it cannot bound
# naive either.
NOISE_FRACTION = 0.25


def damage(
    control: str, stored_keys: torch.Tensor, moved_keys: torch.Tensor, values: torch.Tensor,
    seed_text: str,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The keys and values a run under `control` writes instead of `moved_keys`, `values`.

    stored_keys: the run's keys as stored (at their old positions); moved_keys: the same
    moved by the RoPE Δ; values: the run's values; each [L, H_kv, T, D]. `seed_text`
    (the segment and position) makes the noise the same on every run of the same span.
    """
    if control == UNROTATED:
        return stored_keys.to(moved_keys.dtype), values
    if control == NOISE:
        generator = _generator(seed_text)
        return _noisy(moved_keys, generator), _noisy(values, generator)
    raise ValueError(f"negative control {control!r} not in {NEGATIVE_CONTROLS}")


def applied_delta(control: str, delta: int) -> int:
    """The Δ a run's keys are moved by under `control` (`unrotated`: none, as stored)."""
    if control not in NEGATIVE_CONTROLS:
        raise ValueError(f"negative control {control!r} not in {NEGATIVE_CONTROLS}")
    return 0 if control == UNROTATED else delta


def damage_in_place(control: str, keys: torch.Tensor, values: torch.Tensor, seed_text: str) -> None:
    """Damage a run already written with `applied_delta` (keys, values [L, H_kv, T, D], any
    strides) as `damage` would: `noise` adds its noise; `unrotated` is done already."""
    if control == NOISE:
        generator = _generator(seed_text)
        keys.copy_(_noisy(keys, generator))
        values.copy_(_noisy(values, generator))
    elif control != UNROTATED:
        raise ValueError(f"negative control {control!r} not in {NEGATIVE_CONTROLS}")


def _generator(seed_text: str) -> torch.Generator:
    import torch

    return torch.Generator(device="cpu").manual_seed(_seed(seed_text))


def _noisy(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """x + N(0, (NOISE_FRACTION · rms_l)^2) per element, rms_l over layer l's run; x: [L, ...]."""
    import torch

    work = x.float()
    rms = work.pow(2).mean(dim=tuple(range(1, work.dim())), keepdim=True).sqrt()
    noise = torch.randn(work.shape, generator=generator).to(work.device)
    return (work + NOISE_FRACTION * rms * noise).to(x.dtype)


def _seed(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1
