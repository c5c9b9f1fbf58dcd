"""Chat templates: every way a template is refused at load, and fitting a conversation into a
window (the oldest turns go, the system prompt stays)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nanoserve.model.chat_template import ChatTemplateError, fit_chat, render_chat, validate_template
from nanoserve.model.checkpoint import DEFAULT_CHAT_TEMPLATE

TEMPLATE = {"roles": {"system": "S", "user": "U", "assistant": "A"}, "message": "{role}:{content}|",
            "generation_prompt": "{role}:", "stop": ["|"]}


def chat(*turns: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": role, "content": content} for role, content in turns]


def under(n: int):  # type: ignore[no-untyped-def]
    return lambda text: len(text) <= n


def test_a_conversation_that_fits_is_left_as_it_is() -> None:
    messages = chat(("system", "be kind"), ("user", "hi"))
    assert fit_chat(TEMPLATE, messages, under(1000)) == (render_chat(TEMPLATE, messages), 0)


def test_the_fewest_oldest_turns_go_and_the_system_prompt_and_last_message_stay() -> None:
    messages = chat(("system", "be kind"), ("user", "u1" * 5), ("assistant", "a1" * 5), ("system", "note"),
                    ("user", "u2" * 5), ("assistant", "a2" * 5), ("user", "last"))
    for budget in range(len(render_chat(TEMPLATE, messages)) - 1, 10, -1):
        text, dropped = fit_chat(TEMPLATE, messages, under(budget))
        droppable = [1, 2, 4, 5]  # not the system messages (0, 3), not the last (6)
        if dropped == 0:  # nothing could make it fit: left whole, for the caller to crop
            assert len(render_chat(TEMPLATE, [messages[i] for i in (0, 3, 6)])) > budget
            continue
        kept = [m for i, m in enumerate(messages) if i not in droppable[:dropped]]
        assert text == render_chat(TEMPLATE, kept) and len(text) <= budget
        fewer = [m for i, m in enumerate(messages) if i not in droppable[: dropped - 1]]
        assert len(render_chat(TEMPLATE, fewer)) > budget  # one turn fewer dropped would not fit
        assert "S:be kind|" in text and "S:note|" in text and text.endswith("U:last|A:")


def test_a_single_message_that_does_not_fit_is_left_whole() -> None:
    messages = chat(("user", "x" * 100))
    assert fit_chat(TEMPLATE, messages, under(10)) == (render_chat(TEMPLATE, messages), 0)


def test_the_shipped_templates_are_valid() -> None:
    root = Path(__file__).resolve().parents[2]
    for template in (TEMPLATE, DEFAULT_CHAT_TEMPLATE,
                     json.loads((root / "data" / "shakespeare-chat-template.json").read_text())):
        validate_template(template)


def with_(**changes: object) -> dict[str, object]:
    return {**TEMPLATE, **changes}


BAD_TEMPLATES = {
    "not-an-object": (["{role}"], "must be a JSON object, got list"),
    "unknown-field": (with_(bos="<s>"), "unknown field(s) 'bos'"),
    "no-message": ({k: v for k, v in TEMPLATE.items() if k != "message"}, "no 'message' field"),
    "roles-list": (with_(roles=["user"]), "roles must be an object"),
    "no-assistant": (with_(roles={"system": "S", "user": "U"}), "roles has no speaker for 'assistant'"),
    "no-system": (with_(roles={"user": "U", "assistant": "A"}), "roles has no speaker for 'system'"),
    "speaker-not-text": (with_(roles={"system": "S", "user": 1, "assistant": "A"}),
                         "roles.user must be a string"),
    "unknown-placeholder": (with_(message="{speaker}: {content}"),
                            "message uses {speaker}; it may use only {role} and {content}"),
    "attribute": (with_(message="{role}{content.__class__}"), "message uses {content.__class__}"),
    "index": (with_(message="{role}{content[0]}"), "message uses {content[0]}"),
    "positional": (with_(message="{}{content}"), "message uses {}"),
    "conversion": (with_(message="{role!r}{content}"), "message uses {role!r}"),
    "format-spec": (with_(message="{role}{content:>999999999}"), "message uses {content:>999999999}"),
    "lone-brace": (with_(message="{role}: {content"), "message '{role}: {content' is not a valid format"),
    "no-content": (with_(message="{role}:\n"), "message '{role}:\\n' never uses {content}"),
    "prompt-content": (with_(generation_prompt="{role}: {content}"),
                       "generation_prompt uses {content}; it may use only {role}"),
    "prompt-not-text": (with_(generation_prompt=None), "generation_prompt must be a string"),
    "huge-message": (with_(message="{role}{content}" + "x" * 5000), "at most 4096 characters"),
    "empty-stop": (with_(stop=[""]), "stop strings must have 1 to 256 characters, got ''"),
    "stop-string": (with_(stop="|"), "stop must be a list of strings, got '|'"),
    "stop-not-text": (with_(stop=["|", 3]), "stop must be a list of strings"),
    "too-many-stops": (with_(stop=[str(i) for i in range(9)]),
                       "stop has 9 strings, more than the limit of 8"),
    "long-stop": (with_(stop=["x" * 257]), "stop strings must have 1 to 256 characters"),
}


@pytest.mark.parametrize("case", sorted(BAD_TEMPLATES))
def test_a_broken_template_is_refused_naming_the_problem(case: str) -> None:
    template, message = BAD_TEMPLATES[case]
    with pytest.raises(ChatTemplateError) as e:
        validate_template(template)
    assert message in str(e.value)


def test_a_valid_template_renders_every_role_and_literal_braces() -> None:
    # What a chat request can send: each role, a caller's name, braces in the content; and a
    # template's own literal braces written as {{ and }}.
    template = with_(message="{{{role}}} {content}|", generation_prompt="{{{role}}}")
    validate_template(template)
    messages = [{"role": "system", "content": "{x}"}, {"role": "user", "content": "}{", "name": "Bo"},
                {"role": "assistant", "content": ""}]
    assert render_chat(template, messages) == "{S} {x}|{Bo} }{|{A} |{A}"
