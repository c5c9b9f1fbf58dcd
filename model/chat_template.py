"""Chat templates: how a checkpoint turns a conversation into the text its model has learned.

A template is plain data stored in the checkpoint's config.json (never code, never Jinja):

    {"roles": {"system": "CHORUS", "user": "ROMEO", "assistant": "JULIET"},
     "message": "{role}:\\n{content}\\n\\n", "generation_prompt": "{role}:\\n", "stop": ["\\n\\n"]}

A message's optional `name` replaces its role's speaker name, so a chat can cast any characters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any


class ChatTemplateError(ValueError):
    pass


def render_chat(
    template: Mapping[str, Any], messages: Iterable[Mapping[str, Any]], add_generation_prompt: bool = True
) -> str:
    roles: Mapping[str, str] = template["roles"]
    parts: list[str] = []
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if not isinstance(role, str) or role not in roles:
            raise ChatTemplateError(
                f"messages[{i}].role {role!r} is not one of {', '.join(sorted(roles))}"
            )
        speaker = msg.get("name") or roles[role]
        parts.append(template["message"].format(role=speaker, content=msg.get("content") or ""))
    if add_generation_prompt:
        parts.append(template["generation_prompt"].format(role=roles["assistant"]))
    return "".join(parts)


def template_stop_sequences(template: Mapping[str, Any]) -> list[str]:
    """Stop strings that end the assistant's turn under this template."""
    return list(template.get("stop", []))


def fit_chat(
    template: Mapping[str, Any], messages: Sequence[Mapping[str, Any]], fits: Callable[[str], bool]
) -> tuple[str, int]:
    """The conversation rendered with as few of its oldest turns dropped as make `fits` accept it:
    (text, messages dropped).

    System messages and the last message are never dropped: cropping the rendered text from the
    left (what a model's window otherwise forces) would lose the system prompt first, the part of
    a conversation meant to hold throughout. When even the system messages and the last message
    do not fit, nothing is dropped: the caller crops the whole text from the left, which keeps
    the most recent context. `fits` must accept any text shorter than one it accepts (the count
    of dropped turns is found by bisection).
    """
    text = render_chat(template, messages)
    if fits(text):
        return text, 0
    droppable = [i for i, m in enumerate(messages[:-1]) if m.get("role") != "system"]

    def without(k: int) -> str:  # the k oldest droppable messages left out
        gone = set(droppable[:k])
        return render_chat(template, [m for i, m in enumerate(messages) if i not in gone])

    if not droppable or not fits(without(len(droppable))):
        return text, 0
    lo, hi = 1, len(droppable)  # fits(without(hi)) holds; find the smallest such count
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(without(mid)):
            hi = mid
        else:
            lo = mid + 1
    return without(lo), lo
