"""Prompt layouts: where an agent's persona, the shared context and earlier answers go.

Owns `LAYOUTS` and `lay_out`, which turns a persona plus the answers an agent sees
into its `PromptTemplate`. The layout decides how much of a prompt an exact
(zero-drift) lookup can find: `persona-first` (KVComm's) starts every prompt with
the agent's own system text, so the exact chain breaks at token one;
`shared-first` puts a common preamble, the question and earlier answers first and
the role's instruction last; `transcript` is one growing group conversation, so
agent i's prompt is agent i−1's prompt plus its answer plus i's own turn. Which
answers an agent sees is `graph`'s job; the wording of personas is `personas`'.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal

from kvsplice.agents.chat import CHATML, ChatFormat, chat_template
from kvsplice.agents.personas import Persona
from kvsplice.agents.template import PromptTemplate, agent_current, agent_history

if TYPE_CHECKING:
    from kvsplice.agents.roles import AgentRole

logger = logging.getLogger(__name__)

Layout = Literal["persona-first", "shared-first", "transcript"]
LAYOUTS: tuple[Layout, ...] = ("persona-first", "shared-first", "transcript")
DEFAULT_LAYOUT: Layout = "persona-first"

# NOTE: the preamble names every agent of the pipeline (the roster), so it is one
# text for all agents and all questions: the first exact hit of every call.
GROUP_PREAMBLE = (
    "You are one of several agents who solve a problem together in a shared conversation. "
    "The agents are:\n"
)
GROUP_CLOSING = "When it is your turn, read everything above and do only what your turn asks."


def check_layout(layout: str) -> Layout:
    """`layout` if it is one of `LAYOUTS`, else `ValueError` naming the choices."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} not in {LAYOUTS}")
    return layout


def lay_out(
    layout: Layout,
    role: AgentRole,
    current: Sequence[AgentRole],
    history: Sequence[AgentRole],
    roster: Sequence[AgentRole],
    chat: ChatFormat,
) -> PromptTemplate:
    """The template of `role` seeing this round's `current` answers and last round's `history`.

    `roster`: every agent of the pipeline, in order (the shared preamble names them).
    """
    assert role.persona is not None  # roles without a persona keep their template
    if layout == "persona-first":
        return persona_template(role.persona, current, history, chat)
    if layout == "shared-first":
        return _shared_first(role, current, history, roster, chat)
    return _transcript(role, current, history, roster, chat)


def persona_template(
    persona: Persona,
    current: Sequence[AgentRole] = (),
    history: Sequence[AgentRole] = (),
    chat: ChatFormat = CHATML,
) -> PromptTemplate:
    """System = persona; user = question, answers of `current`, answers of `history`, instruction."""
    sections = (
        ("Answers from the other agents", current, agent_current),
        ("Their answers in the previous round", history, _previous_round),
    )
    return chat_template(persona.system, _user_text(sections, persona.instruction), chat)


def group_preamble(roster: Sequence[AgentRole]) -> str:
    """The system text every agent of a shared layout starts with: who is in the group."""
    lines = "".join(f"- {_who(r)}: {_persona(r).system}\n" for r in roster)
    return f"{GROUP_PREAMBLE}{lines}{GROUP_CLOSING}"


def _shared_first(
    role: AgentRole,
    current: Sequence[AgentRole],
    history: Sequence[AgentRole],
    roster: Sequence[AgentRole],
    chat: ChatFormat,
) -> PromptTemplate:
    sections = (
        ("Answers in the previous round", history, _previous_round),
        ("Answers so far", current, agent_current),
    )
    return chat_template(group_preamble(roster), _user_text(sections, _turn_text(role)), chat)


def _user_text(
    sections: Sequence[tuple[str, Sequence[AgentRole], Callable[[str], str]]], closing: str
) -> str:
    """The question, then each non-empty section of answers under its heading, then `closing`."""
    user = "Problem:\n{user_question}\n"
    for heading, roles, placeholder_of in sections:
        if roles:
            user += f"\n{heading}:\n" + _answers(roles, placeholder_of)
    return user + f"\n{closing}"


def _transcript(
    role: AgentRole,
    current: Sequence[AgentRole],
    history: Sequence[AgentRole],
    roster: Sequence[AgentRole],
    chat: ChatFormat,
) -> PromptTemplate:
    text = (
        f"{chat.system_start}{group_preamble(roster)}{chat.turn_end}\n"
        f"{chat.user_start}Problem:\n{{user_question}}{chat.turn_end}\n"
    )
    for speaker in history:
        text += _turn(speaker, chat) + f"{{{_previous_round(speaker.agent_id)}}}{chat.turn_end}\n"
    for speaker in current:
        text += _turn(speaker, chat) + f"{{{agent_current(speaker.agent_id)}}}{chat.turn_end}\n"
    return PromptTemplate.parse(text + _turn(role, chat))


def _turn(role: AgentRole, chat: ChatFormat) -> str:
    """One agent's user turn, then its open assistant turn (its answer follows)."""
    return f"{chat.user_start}{_turn_text(role)}{chat.turn_end}\n{chat.assistant_start}"


def _turn_text(role: AgentRole) -> str:
    return f"{_who(role)}, your turn. {_persona(role).instruction}"


def _who(role: AgentRole) -> str:
    return f"Agent {role.agent_id} ({role.name})"


def _persona(role: AgentRole) -> Persona:
    if role.persona is None:
        raise ValueError(f"agent {role.agent_id} has no persona: shared layouts need one per agent")
    return role.persona


def _previous_round(agent_id: str) -> str:
    return agent_history(agent_id, -1)


def _answers(roles: Sequence[AgentRole], placeholder_of: Callable[[str], str]) -> str:
    return "".join(
        f"--- Agent {r.agent_id} ({r.name}):\n{{{placeholder_of(r.agent_id)}}}\n" for r in roles
    )
