"""Chat templates: how a checkpoint turns a conversation into the text its model has learned.

A template is plain data stored in the checkpoint's config.json (never code, never Jinja):

    {"roles": {"system": "CHORUS", "user": "ROMEO", "assistant": "JULIET"},
     "message": "{role}:\\n{content}\\n\\n", "generation_prompt": "{role}:\\n", "stop": ["\\n\\n"]}

A message's optional `name` replaces its role's speaker name, so a chat can cast any characters.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
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
