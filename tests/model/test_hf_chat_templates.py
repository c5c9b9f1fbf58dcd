"""Published models' Jinja chat templates render to the same token ids as transformers'
`apply_chat_template`, and refuse what transformers refuses (tests/data/chat_templates/)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nanoserve.model.chat_template import ChatTemplateError, fit_chat, from_hf, render_chat, validate_template
from nanoserve.model.tokenizer import BPETokenizer
from tests.conftest import require_module
from tests.model.chatml_llama import byte_level_bpe

TEMPLATES = Path(__file__).parent.parent / "data" / "chat_templates"
MODELS: dict[str, Any] = json.loads((TEMPLATES / "models.json").read_text(encoding="utf-8"))
SPECIALS = sorted({t for m in MODELS.values() for t in [*m["special_tokens"].values(), *m["end_tokens"]]}
                  | {"<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<start_of_turn>",
                     "<end_of_turn>"})
CORPUS = ("You are a helpful assistant. What is the capital of France? Paris is the capital of France. "
          "The weather in Paris is sunny, 22 degrees. Call get_weather with a city. Thanks! ") * 4

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CHAT: list[dict[str, Any]] = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "  Paris.  "},
    {"role": "user", "content": "And its weather? <é ü 🌧>"},
]
SYSTEM = {"role": "system", "content": "You are a terse assistant."}
TOOL_TURNS: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 22 degrees"},
]


@pytest.fixture(scope="module")
def backend() -> Any:
    """A small byte-level BPE whose added special tokens are every template's control tokens."""
    return byte_level_bpe(SPECIALS, CORPUS, 400)


def _theirs(backend: Any, name: str) -> Any:
    require_module("transformers")
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=backend, **MODELS[name]["special_tokens"])
    hf.chat_template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    return hf


def _ours(name: str) -> dict[str, Any]:
    template = from_hf((TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8"),
                       MODELS[name]["special_tokens"])
    validate_template(template)
    return template


CASES: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = {
    "plain": (CHAT, None),
    "system": ([SYSTEM, *CHAT], None),
    "one turn": (CHAT[:1], None),
    "tools": ([SYSTEM, *TOOL_TURNS], [WEATHER_TOOL]),
}
# The conversations a template refuses (transformers raises too): Mistral and Gemma have no system
# role, SmolLM2 reads every message's content, which a tool call's reply has none of.
REFUSED = {("mistral", "system"), ("gemma2", "system"), ("mistral", "tools"), ("gemma2", "tools"),
           ("smollm2", "tools")}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("generation_prompt", [True, False], ids=["prompt", "no-prompt"])
def test_the_same_token_ids_as_apply_chat_template(backend: Any, name: str, case: str,
                                                   generation_prompt: bool) -> None:
    messages, tools = CASES[case]
    hf, ours_template = _theirs(backend, name), _ours(name)
    if (name, case) in REFUSED:
        with pytest.raises(Exception):  # noqa: B017 (jinja's UndefinedError or TemplateError)
            hf.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt)
        with pytest.raises(ChatTemplateError, match="the model's chat template refused these messages"):
            render_chat(ours_template, messages, add_generation_prompt=generation_prompt, tools=tools)
        return
    theirs = hf.apply_chat_template(
        messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False)
    text = render_chat(ours_template, messages, add_generation_prompt=generation_prompt, tools=tools)
    ours = BPETokenizer(backend).encode(text)
    assert ours == theirs
    # The comparison means something: control tokens are there as single ids, and the conversation.
    assert {backend.token_to_id(t) for t in SPECIALS} & set(ours)
    assert "capital" in text or "Paris" in text


@pytest.mark.parametrize(("name", "case", "message"), [
    ("mistral", "system", "Conversation roles must alternate"),
    ("gemma2", "system", "System role not supported"),
])
def test_a_template_that_raises_refuses_as_transformers_does(backend: Any, name: str, case: str,
                                                            message: str) -> None:
    messages, tools = CASES[case]
    with pytest.raises(Exception, match=message):
        _theirs(backend, name).apply_chat_template(messages, tokenize=False)
    with pytest.raises(ChatTemplateError, match=f"refused these messages: {message}"):
        render_chat(_ours(name), messages, tools=tools)


def test_tools_select_a_named_tool_use_template(backend: Any) -> None:
    qwen = (TEMPLATES / "qwen2.5.jinja").read_text(encoding="utf-8")
    smol = (TEMPLATES / "smollm2.jinja").read_text(encoding="utf-8")
    named = [{"name": "default", "template": smol}, {"name": "tool_use", "template": qwen}]
    template = from_hf(named, MODELS["qwen2.5"]["special_tokens"])
    validate_template(template)
    assert template["named"] == {"tool_use": qwen}
    hf = _theirs(backend, "qwen2.5")
    hf.chat_template = {"default": smol, "tool_use": qwen}
    for tools in (None, [WEATHER_TOOL]):
        theirs = hf.apply_chat_template(CHAT, tools=tools, add_generation_prompt=True, tokenize=False)
        assert render_chat(template, CHAT, tools=tools) == theirs
    assert "# Tools" in render_chat(template, CHAT, tools=[WEATHER_TOOL])


def test_a_data_only_template_refuses_tools() -> None:
    from nanoserve.model.checkpoint import DEFAULT_CHAT_TEMPLATE

    with pytest.raises(ChatTemplateError, match="no way to show tools"):
        render_chat(DEFAULT_CHAT_TEMPLATE, CHAT, tools=[WEATHER_TOOL])


def test_dropping_old_turns_keeps_a_strict_template_satisfied() -> None:
    """Mistral's template refuses a conversation that does not open with the user: fit_chat drops
    the next turn too rather than offer it one."""
    template = _ours("mistral")
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "x" * 40}
             for i in range(9)]
    budget = len(render_chat(template, turns)) - 60  # one turn must go
    text, dropped = fit_chat(template, turns, lambda t: len(t) <= budget)
    assert dropped == 2 and text == render_chat(template, turns[2:])
