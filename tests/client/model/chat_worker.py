"""A worker process for the two-process chat test: one `engine.chat` call, reported as JSON.

Usage: python chat_worker.py TARGET NAMESPACE MESSAGES_JSON
"""

from __future__ import annotations

import json
import sys

from kvsplice.client.execute.execution import GenerationConfig
from kvsplice.client.model.chat_prompt import chat_prompt
from kvsplice.client.model.models import ModelConfig, load_model_cached
from kvsplice.client.reuse_engine import EngineConfig, ReuseEngine
from kvsplice.storeclient.client import StoreClient


def main(target: str, namespace: str, messages: list[dict[str, str]]) -> None:
    loaded = load_model_cached(ModelConfig())
    stop = (loaded.tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    generation = GenerationConfig(max_new_tokens=8, stop_token_ids=stop)
    with (
        StoreClient(target, namespace) as store,
        ReuseEngine(loaded, "exact", store, EngineConfig(quant="none")) as engine,
    ):
        outcome = engine.chat(messages, generation)
        dense = engine.dense_reference(chat_prompt(messages, loaded.tokenizer), generation)
        engine.flush()
        report = {
            "text": outcome.text,
            "num_prompt_tokens": outcome.num_prompt_tokens,
            "num_reused_tokens": outcome.num_reused_tokens,
            "fetch_s": outcome.timings.fetch_s,
            "matches_dense": outcome.output_ids == dense.output_ids,
            "max_abs_logit_diff": float((outcome.logits_first - dense.logits_first).abs().max()),
            "num_failed_puts": engine.writer.counters.num_failed if engine.writer else 0,
        }
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
