"""Fitting a conversation into a window: the oldest turns go, the system prompt stays."""

from __future__ import annotations

from model.chat_template import fit_chat, render_chat

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
