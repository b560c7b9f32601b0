"""Whether this machine computes a prompt split over two prefills bit for bit as in one.

A prefill computes each token's row with matrix products over every token of its batch;
whether a row's result depends on how many rows share the batch is the kernels' business
(their blocking, the instruction set, the dtype). Where it does not, a prompt prefilled in
two runs — its first part's K/V stored by one run and read by the next — equals one
prefill bit for bit, and so does a staged mode's dense fallback, which resumes from its
passes' exact states (crossfix). Where it does, the two differ by rounding (in bf16 up to
a few hundredths of a logit), and only a prefill of the whole prompt is the dense
computation. `splits_bitwise` asks the machine once per loaded model (the first call
that needs it pays a prefill of `PROBE_TOKENS` tokens and one of `PROBE_SPLIT`), on a
prompt of random tokens; `probe_splits` asks again.
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

import torch

from kvsplice.client.execute.layerwise_executor import LayerwiseExecutor
from kvsplice.client.execute.plan import CallPlan, segment_span

# The probe's prompt: long enough that both runs take the batched kernels a judge's
# prefill takes (not a decode step's), split unevenly so the two runs' batches differ.
PROBE_TOKENS = 320
PROBE_SPLIT = 128


_VERDICTS: WeakKeyDictionary[torch.nn.Module, bool] = WeakKeyDictionary()


def splits_bitwise(executor: LayerwiseExecutor) -> bool:
    """`probe_splits` with the defaults, asked once per model (kept while it is loaded)."""
    model = executor.adapter.model
    verdict = _VERDICTS.get(model)
    if verdict is None:
        verdict = _VERDICTS[model] = probe_splits(executor)
    return verdict


def probe_splits(
    executor: LayerwiseExecutor,
    *,
    num_tokens: int = PROBE_TOKENS,
    split: int = PROBE_SPLIT,
    seed: int = 0,
) -> bool:
    """Whether prefilling `num_tokens` random tokens in one run gives bit for bit the logits of
    prefilling their first `split` tokens, then the rest reading those tokens' K/V."""
    if not 0 < split < num_tokens:
        raise ValueError(f"split {split} must lie inside (0, {num_tokens})")
    vocab = int(executor.adapter.model.config.vocab_size)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (num_tokens,), generator=generator).tolist()
    whole = executor.run(CallPlan.all_compute(ids))
    head = executor.run(CallPlan.all_compute(ids[:split]))
    stored = head.kv.to_segment(0, split)
    span = segment_span(stored, 0, start_layer=executor.num_layers, name="head")
    parts = executor.run(CallPlan.tiled(ids, [span]))
    return torch.equal(whole.logits, parts.logits)
