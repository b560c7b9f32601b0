"""What a request's K/V depends on beside its token ids: the root its key chain hangs from.

Two requests with the same token ids share K/V only if the model computes the same
K/V for both. A LoRA adapter (its weights' digest, `adapter_digest`) and images (vLLM's
mm hashes and placeholder positions) change it, so they are folded into the chain's
root (`derive_fingerprint`): requests with the same adapter and images share, others
never do. Prompt embeddings replace token ids altogether (vLLM gives them all id 0),
so such requests are refused: nothing looked up, nothing saved. Reads vLLM's `Request`
fields by name, never with a default: a field vLLM renamed fails (`check_request_fields`
at start), it is never silently read as absent.
"""

from __future__ import annotations

from typing import Any

from kvsplice.common.keys import derive_fingerprint
from kvsplice.integrations.vllm.adapter_digest import ADAPTER_DIGESTS, AdapterDigests

# vLLM 0.32's `vllm.v1.request.Request` fields the root is computed from
REQUEST_FIELDS = ("prompt_embeds", "lora_request", "mm_features")


def request_root(
    model_fingerprint: str, request: Any, adapters: AdapterDigests = ADAPTER_DIGESTS
) -> str | None:
    """The fingerprint `request`'s chain is rooted in; None: its K/V is never shared."""
    if request.prompt_embeds is not None:
        return None
    extras: dict[str, Any] = {}
    lora = request.lora_request
    if lora is not None:
        # NOTE: the weights' digest, not the name or path (an adapter replaced in place
        # keeps both) nor lora_int_id (per engine: two engines may number one adapter apart)
        digest = adapters.digest(lora.lora_path)
        if digest is None:
            return None
        extras["lora"] = digest
    if request.mm_features:
        extras["mm"] = [
            [str(f.identifier), int(f.mm_position.offset), int(f.mm_position.length)]
            for f in request.mm_features
        ]
    return derive_fingerprint(model_fingerprint, extras) if extras else model_fingerprint


def check_request_fields(probe: object | None = None) -> None:
    """Raise ValueError if vLLM's `Request` (or `probe`) lacks a field `request_root` reads."""
    if probe is None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        probe = Request("kvsplice-probe", [0], SamplingParams(max_tokens=1), None)
    missing = [name for name in REQUEST_FIELDS if not hasattr(probe, name)]
    if missing:
        raise ValueError(
            f"KvspliceConnector: vLLM's Request has no {', '.join(missing)}: the request "
            "keys cannot tell LoRA, multimodal or prompt-embeds requests apart"
        )
