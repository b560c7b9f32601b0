"""Templates and rendering: placeholder grammar, literal braces, exact span ranges."""

from __future__ import annotations

import pytest
from helpers.agents import CharTokenizer
from hypothesis import example, given
from hypothesis import strategies as st

from kvsplice.agents.chat import CHATML, chat_template
from kvsplice.agents.render import render
from kvsplice.agents.template import (
    Placeholder,
    PlaceholderPart,
    PromptTemplate,
    TextPart,
    agent_current,
    agent_history,
)


@pytest.mark.parametrize(
    ("name", "kind", "source_id", "turn"),
    [
        ("user_question", "user_question", "", 0),
        ("agent_3_current", "agent_current", "3", 0),
        ("agent_12_history_-1", "agent_history", "12", -1),
        ("agent_coder_history_2", "agent_history", "coder", 2),
        ("condition_2_current", "condition_current", "2", 0),
        ("condition_4_history_-3", "condition_history", "4", -3),
    ],
)
def test_placeholder_names_parse(name: str, kind: str, source_id: str, turn: int) -> None:
    assert Placeholder.parse(name) == Placeholder(name, kind, source_id, turn)  # type: ignore[arg-type]
    assert Placeholder.parse("{" + name + "}").name == name


@pytest.mark.parametrize(
    "name",
    ["question", "agent__current", "agent_1_now", "agent_1_history", "agent_a_b_current", "user"],
)
def test_non_placeholders_are_rejected(name: str) -> None:
    with pytest.raises(ValueError, match="not a placeholder"):
        Placeholder.parse(name)


def test_helpers_build_valid_names() -> None:
    assert agent_current("2") == "agent_2_current"
    assert agent_history("2") == "agent_2_history_-1"
    with pytest.raises(ValueError, match="negative"):
        agent_history("2", 0)


def test_parse_alternates_text_and_placeholders_and_keeps_literal_braces() -> None:
    template = PromptTemplate.parse(
        'Q: {user_question}\n{"json": 1} {agent_1_current}{agent_2_current} {x}'
    )
    assert template.parts == (
        TextPart("Q: "),
        PlaceholderPart(Placeholder.parse("user_question")),
        TextPart('\n{"json": 1} '),
        PlaceholderPart(Placeholder.parse("agent_1_current")),
        PlaceholderPart(Placeholder.parse("agent_2_current")),
        TextPart(" {x}"),
    )
    # Placeholders render as their braced name, never as a Python set ("{'agent_1_current'}").
    assert "'" not in template.source_text().replace('"json"', "")


@given(st.text(alphabet="ab{}_ \nuser_questionagent1current", min_size=1, max_size=60))
@example("x{user_question}{agent_1_current}y{z}{agent_2_history_-1}")
def test_parse_round_trips_source_text(text: str) -> None:
    assert PromptTemplate.parse(text).source_text() == text


def test_whitespace_only_text_between_placeholders_is_kept() -> None:
    tokenizer = CharTokenizer()
    template = PromptTemplate.parse("{agent_1_current}\n{agent_2_current}")
    rendered = render(template, {"agent_1_current": "a", "agent_2_current": "b"}, tokenizer)
    assert [s.name for s in rendered.spans] == ["agent_1_current", "text_1", "agent_2_current"]
    assert rendered.token_ids == tuple(tokenizer.encode("a\nb"))


def test_render_spans_are_exact_and_ids_concatenate_per_part() -> None:
    tokenizer = CharTokenizer()
    template = chat_template("Be brief.", "Task: {user_question}\nPrev: {agent_1_current}\nGo.")
    values = {"user_question": "add 2 and 3", "agent_1_current": (7, 8, 9)}
    rendered = render(template, values, tokenizer)
    expected_parts = [
        tokenizer.encode(
            f"{CHATML.system_start}Be brief.{CHATML.turn_end}\n{CHATML.user_start}Task: "
        ),
        tokenizer.encode("add 2 and 3"),
        tokenizer.encode("\nPrev: "),
        [7, 8, 9],
        tokenizer.encode(f"\nGo.{CHATML.turn_end}\n{CHATML.assistant_start}"),
    ]
    assert [rendered.span_ids(s) for s in rendered.spans] == [tuple(p) for p in expected_parts]
    assert rendered.token_ids == tuple(t for part in expected_parts for t in part)
    assert [(s.kind, s.name) for s in rendered.spans] == [
        ("text", "text_0"),
        ("placeholder", "user_question"),
        ("text", "text_2"),
        ("placeholder", "agent_1_current"),
        ("text", "text_4"),
    ]
    assert rendered.spans[0].start == 0 and rendered.spans[-1].end == rendered.num_tokens
    assert tokenizer.encode(CHATML.turn_end) == [1001]


def test_empty_values_give_no_span() -> None:
    template = PromptTemplate.parse("A{user_question}B{agent_1_current}")
    rendered = render(template, {"user_question": "", "agent_1_current": ()}, CharTokenizer())
    assert [s.name for s in rendered.spans] == ["text_0", "text_2"]
    assert rendered.token_ids == (ord("A"), ord("B"))


def test_missing_value_is_an_error() -> None:
    with pytest.raises(ValueError, match="agent_1_current"):
        render(PromptTemplate.parse("{agent_1_current}"), {}, CharTokenizer())


@pytest.mark.slow
def test_smollm2_tokenizer_renders_chat_markers_as_single_tokens(smollm2_tokenizer) -> None:
    template = chat_template("You plan.", "Problem:\n{user_question}\nPlan it.")
    rendered = render(template, {"user_question": "def f(x):\n    return x"}, smollm2_tokenizer)
    for span in rendered.spans:
        text = smollm2_tokenizer.decode(list(rendered.span_ids(span)))
        assert tuple(smollm2_tokenizer.encode(text, add_special_tokens=False)) == rendered.span_ids(
            span
        )
    im_start = smollm2_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert rendered.token_ids[0] == im_start
    assert rendered.token_ids.count(im_start) == 3
