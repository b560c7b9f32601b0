"""What a gated request is told when it got no approximate token, case by case."""

from __future__ import annotations

from dataclasses import replace

from kvsplice.integrations.vllm.gated_report import GatedOutcome, reason

GOT = GatedOutcome(True, True, 256, 2, 2, 512, False)


def test_a_request_that_got_approximate_tokens_needs_no_reason() -> None:
    assert reason(GOT) is None


def test_each_way_of_getting_nothing_has_its_own_reason() -> None:
    nothing = replace(GOT, num_approximate_tokens=0)
    cases = {
        "admission policy admits no approximate mode": replace(nothing, admitted=False),
        "did not answer the lookup": replace(nothing, looked_up=False),
        "loading failed": replace(nothing, load_failed=True),
        "prompt's start is not stored": replace(
            nothing, num_prefix_tokens=0, num_found_runs=0, num_promised_runs=0
        ),
        "no stored run continues": replace(nothing, num_found_runs=0, num_promised_runs=0),
        "no whole block past": replace(nothing, num_promised_runs=0),
    }
    said = {what: reason(outcome) for what, outcome in cases.items()}
    for what, text in said.items():
        assert text is not None and what in text, (what, text)
    assert len(set(said.values())) == len(cases)
