"""What a request's K/V depends on beside its token ids: the root its key chain hangs from.

Two requests with the same token ids share K/V only if the model computes the same
K/V for both. A LoRA adapter and images change it, so they are folded into the
chain's root (`derive_fingerprint`): requests with the same adapter and images share,
others never do. Prompt embeddings replace token ids altogether (vLLM gives them all
id 0), so such requests are refused: nothing looked up, nothing saved. Knows vLLM's
`Request` only through the attributes it reads.
"""

from __future__ import annotations

from typing import Any

from kvsplice.common.keys import derive_fingerprint


def request_root(model_fingerprint: str, request: Any) -> str | None:
    """The fingerprint `request`'s chain is rooted in; None: its K/V is never shared."""
    if getattr(request, "prompt_embeds", None) is not None:
        return None
    extras: dict[str, Any] = {}
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        # NOTE: the name and path identify the adapter's weights; vLLM's lora_int_id is
        # per-engine (two engines may number one adapter differently).
        extras["lora"] = [str(lora.lora_name), str(getattr(lora, "lora_path", "") or "")]
    features = getattr(request, "mm_features", None) or ()
    if features:
        extras["mm"] = [
            [str(f.identifier), int(f.mm_position.offset), int(f.mm_position.length)]
            for f in features
        ]
    return derive_fingerprint(model_fingerprint, extras) if extras else model_fingerprint
