"""The split-prefill probe: whether a prompt prefilled in two runs equals one prefill bit for bit."""

from __future__ import annotations

import pytest
import torch
from helpers.approx import make_loaded4

from kvsplice.client.execute import determinism
from kvsplice.client.execute.determinism import probe_splits, splits_bitwise
from kvsplice.client.execute.layerwise_executor import LayerwiseExecutor, LayerwiseResult
from kvsplice.client.execute.plan import CallPlan
from kvsplice.client.model.models import LoadedModel


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return make_loaded4()


class _Rounding(LayerwiseExecutor):
    """An executor whose runs reading provided K/V come out one ulp off (rows that depend on
    their batch), as a machine's kernels may."""

    def run(self, plan: CallPlan) -> LayerwiseResult:
        result = super().run(plan)
        if any(span.kv is not None for span in plan.spans):
            bumped = torch.nextafter(result.logits, torch.full_like(result.logits, torch.inf))
            object.__setattr__(result, "logits", bumped)
        return result


def test_the_probe_sees_a_split_prompt_that_rounds_otherwise(loaded: LoadedModel) -> None:
    assert not probe_splits(_Rounding(loaded.model), num_tokens=40, split=16)


@pytest.mark.parametrize("split", [0, 40, 41])
def test_the_probe_needs_a_split_inside_the_prompt(loaded: LoadedModel, split: int) -> None:
    with pytest.raises(ValueError, match="must lie inside"):
        probe_splits(LayerwiseExecutor(loaded.model), num_tokens=40, split=split)


def test_the_verdict_is_asked_once_per_model(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[int] = []

    def probe(executor: LayerwiseExecutor) -> bool:
        asked.append(1)
        return False

    monkeypatch.setattr(determinism, "probe_splits", probe)
    monkeypatch.setattr(determinism, "_VERDICTS", type(determinism._VERDICTS)())
    executor = LayerwiseExecutor(loaded.model)
    assert splits_bitwise(executor) is False
    assert splits_bitwise(LayerwiseExecutor(loaded.model)) is False
    assert asked == [1]
