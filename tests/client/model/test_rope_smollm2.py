"""Oracle (d) on SmolLM2: keys of a run at positions + s equal `RopeSpec.shift` of the keys at 0.

Tolerance: HF forms angles p·θ_i in fp32, so a key at position p carries an
angle error up to ~p·θ_i·2^-24 ≤ p·2^-24 (θ_0 = 1). Comparing runs at p and
p + s, every element may differ by max|x|·(p + (p + s))·2^-24 with p < T; deeper
layers inherit the same rounding through the residual stream (values too).
Measured worst layer on SmolLM2: ≤ 0.22 of this bound, so it is asserted as is.
"""

from __future__ import annotations

import pytest
import torch

from kvsplice.client.execute.capture import capture_segments
from kvsplice.client.model.models import LoadedModel

pytestmark = pytest.mark.slow

TEXT = "The quick brown fox jumps over the lazy dog while the agents plan, solve and critique. " * 4
FP32_ANGLE_EPS = 2.0**-24


def angle_rounding_bound(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Per-layer tolerance [L] for x [L, H, T, D] captured at 0 and at `shift`."""
    num_tokens = x.shape[2]
    return x.abs().amax(dim=(1, 2, 3)) * (2 * num_tokens + shift) * FP32_ANGLE_EPS


@pytest.mark.parametrize("shift", [1, 100, 2000])
def test_keys_at_shifted_positions_equal_the_rope_shift(smollm2: LoadedModel, shift: int) -> None:
    ids = smollm2.tokenizer(TEXT)["input_ids"]
    span = [(0, len(ids))]
    base = capture_segments(smollm2.model, ids, span).segments[0]
    moved = capture_segments(smollm2.model, ids, span, position_offset=shift).segments[0]
    shifted = smollm2.rope.shift_layers(base.keys, shift)
    key_error = (shifted - moved.keys).abs().amax(dim=(1, 2, 3))
    value_error = (base.values - moved.values).abs().amax(dim=(1, 2, 3))
    assert bool((key_error <= angle_rounding_bound(base.keys, shift)).all()), key_error
    assert bool((value_error <= angle_rounding_bound(base.values, shift)).all()), value_error
    assert torch.equal(base.values[0], moved.values[0])  # layer-0 values never see positions
