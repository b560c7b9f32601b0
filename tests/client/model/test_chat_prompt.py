"""Chat messages in: one span per message part, prefix-stable, exact reuse across processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers.text import CharTokenizer

from kvsplice.client.model.chat_prompt import chat_prompt
from kvsplice.server.embedded import EmbeddedStore, loopback_config


class ChatMLTokenizer(CharTokenizer):
    """The char tokenizer with a ChatML template that adds a default system turn."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> str:
        text = ""
        if conversation and conversation[0]["role"] != "system":
            text = "<|im_start|>system\nbe nice<|im_end|>\n"
        for message in conversation:
            text += f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n"
        return text + ("<|im_start|>assistant\n" if kwargs.get("add_generation_prompt") else "")


MESSAGES = [
    {"role": "system", "content": "You plan."},
    {"role": "user", "content": "Sort a list."},
]


def test_spans_tile_the_template_text_and_split_each_message() -> None:
    tokenizer = ChatMLTokenizer()
    prompt = chat_prompt(MESSAGES, tokenizer)
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert prompt.token_ids == tuple(tokenizer.encode(text))
    names = [s.name for s in prompt.spans]
    assert names == [
        "message_0_header", "message_0_system", "message_0_footer",
        "message_1_header", "message_1_user", "message_1_footer", "generation_prompt",
    ]  # fmt: skip
    cursor = 0
    for span in prompt.spans:
        assert span.start == cursor and span.end > span.start
        cursor = span.end
    content = prompt.spans[4]
    assert tokenizer.decode(prompt.token_ids[content.start : content.end]) == "Sort a list."


def test_a_longer_conversation_extends_the_shorter_one_token_for_token() -> None:
    tokenizer = ChatMLTokenizer()
    short = chat_prompt(MESSAGES, tokenizer)
    answer_ids = (65, 66, 67)  # what the model generated, kept verbatim
    longer = chat_prompt(
        [*MESSAGES, {"role": "assistant", "content": "ABC"}, {"role": "user", "content": "Go"}],
        tokenizer,
        known_outputs={"ABC": answer_ids},
    )
    assert longer.token_ids[: len(short.token_ids)] == short.token_ids
    assert longer.token_ids[len(short.token_ids) : len(short.token_ids) + 3] == answer_ids


def test_a_default_system_turn_is_its_own_span() -> None:
    prompt = chat_prompt([{"role": "user", "content": "hi"}], ChatMLTokenizer())
    assert prompt.spans[0].name == "message_0_header"
    assert (
        ChatMLTokenizer()
        .decode(prompt.token_ids[: prompt.spans[0].end])
        .startswith("<|im_start|>system\nbe nice")
    )


def test_bad_messages_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one message"):
        chat_prompt([], ChatMLTokenizer())
    with pytest.raises(ValueError, match="role"):
        chat_prompt([{"content": "no role"}], ChatMLTokenizer())


def run_worker(target: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    worker = Path(__file__).with_name("chat_worker.py")
    done = subprocess.run(
        [sys.executable, str(worker), target, "chat-two-workers", json.dumps(messages)],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_second_worker_process_reuses_what_the_first_computed() -> None:
    with EmbeddedStore(loopback_config(None)) as store:
        first = run_worker(store.target, MESSAGES)
        assert first["num_reused_tokens"] == 0 and first["num_failed_puts"] == 0
        follow_up = [
            *MESSAGES,
            {"role": "assistant", "content": first["text"]},
            {"role": "user", "content": "Now in reverse."},
        ]
        second = run_worker(store.target, follow_up)
    # every token of the first worker's prompt is an exact hit, fetched from the sidecar
    assert second["num_reused_tokens"] >= first["num_prompt_tokens"]
    assert second["fetch_s"] > 0
    assert second["matches_dense"] and second["max_abs_logit_diff"] <= 1e-3
