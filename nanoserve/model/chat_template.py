"""Chat templates: how a checkpoint turns a conversation into the text its model has learned.

A template is one of two kinds, both stored in the checkpoint's config.json. A Hugging Face
model's is Jinja (nanoserve/model/jinja_template.py renders it as transformers does):

    {"jinja": "{% for message in messages %}...", "named": {"tool_use": "..."},
     "special_tokens": {"bos_token": "<s>", "eos_token": "<|im_end|>"}}

`named` keeps every named template a model has (`tool_use` renders requests with tools), and
`special_tokens` are the variables the template sees. A trained model's template is plain data:

    {"roles": {"system": "CHORUS", "user": "ROMEO", "assistant": "JULIET"},
     "message": "{role}:\\n{content}\\n\\n", "generation_prompt": "{role}:\\n", "stop": ["\\n\\n"]}

A message's optional `name` replaces its role's speaker name, so a chat can cast any characters.
`validate_template` is what a checkpoint's template must pass at load (and `nanoserve train
--chat-template` before training): a speaker for each of system, user and assistant; `message`
uses {content} and at most {role}, `generation_prompt` at most {role} (`{{`/`}}` for literal
braces, no other fields, conversions or format specs); up to 8 stop strings of 1 to 256 characters.
A Jinja template must compile and render a two-message conversation.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from string import Formatter
from typing import Any

from nanoserve.model.jinja_template import JinjaTemplateError, compile_template, render

# The roles a chat request can carry (the OpenAI schema's `developer` is rendered as `system`):
# a template must name a speaker for each, or every request using the missing one fails.
REQUIRED_ROLES = ("system", "user", "assistant")
# The placeholders each template string may use: `str.format` would otherwise also evaluate
# `{content.__class__}` or `{0}`, or fail with KeyError on a typo, at every chat request.
PLACEHOLDERS = {"message": ("role", "content"), "generation_prompt": ("role",)}
# A template's stop strings are added to each chat request's own; the engine takes at most 16 per
# request of 1 to 256 characters each, and 8 of those are left to the client.
MAX_STOPS = 8
MAX_STOP_CHARS = 256
# Bounds that keep a template from making every prompt huge.
MAX_ROLE_CHARS = 256
MAX_FORMAT_CHARS = 4096
# Published Jinja templates run to a few tens of kB; special tokens are short strings.
MAX_JINJA_CHARS = 1 << 20
MAX_NAMED_TEMPLATES = 16
MAX_SPECIAL_TOKENS = 64
# The conversation a Jinja template must render at load: one user turn and one reply, which every
# published template accepts (some refuse a system message, others a conversation not opened by
# the user).
PROBE = ({"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there."})


class ChatTemplateError(ValueError):
    pass


def validate_template(template: object) -> None:
    """Raise ChatTemplateError naming the first problem of a checkpoint's chat template.

    Checked once at load, so that a template that cannot render refuses the checkpoint instead of
    failing every chat request (or blaming the client, as an empty stop string would).
    """
    if not isinstance(template, dict):
        raise ChatTemplateError(f"must be a JSON object, got {type(template).__name__}")
    if is_jinja(template):
        _validate_jinja(template)
        return
    allowed = {"roles", "message", "generation_prompt", "stop"}
    unknown = sorted(set(template) - allowed)
    if unknown:
        raise ChatTemplateError(f"unknown field(s) {', '.join(map(repr, unknown))}")
    for key in ("roles", "message", "generation_prompt"):
        if key not in template:
            raise ChatTemplateError(
                f"no {key!r} field (a template needs roles, message and generation_prompt)"
            )
    _check_roles(template["roles"])
    for key, names in PLACEHOLDERS.items():
        _check_format(key, template[key], names)
    _check_stops(template.get("stop", []))
    # Every role once, with and without a caller's name: the exact calls a chat request makes.
    probe = [{"role": role, "content": "probe"} for role in template["roles"]]
    probe.append({"role": "user", "content": "probe", "name": "probe"})
    render_chat(template, probe)


def _check_roles(roles: object) -> None:
    if not isinstance(roles, dict):
        raise ChatTemplateError("roles must be an object mapping each role to its speaker's name")
    missing = [r for r in REQUIRED_ROLES if r not in roles]
    if missing:
        raise ChatTemplateError(f"roles has no speaker for {', '.join(map(repr, missing))}")
    for role, speaker in roles.items():
        if not isinstance(speaker, str) or len(speaker) > MAX_ROLE_CHARS:
            raise ChatTemplateError(
                f"roles.{role} must be a string of at most {MAX_ROLE_CHARS} characters, got {speaker!r}"
            )


def _check_format(key: str, text: object, names: tuple[str, ...]) -> None:
    if not isinstance(text, str) or len(text) > MAX_FORMAT_CHARS:
        raise ChatTemplateError(f"{key} must be a string of at most {MAX_FORMAT_CHARS} characters")
    allowed = " and ".join("{" + n + "}" for n in names)
    try:
        fields = [(f, spec, conv) for _, f, spec, conv in Formatter().parse(text) if f is not None]
    except ValueError as e:  # a lone brace: "{{" and "}}" are how a template writes literal ones
        raise ChatTemplateError(f"{key} {text!r} is not a valid format string ({e})") from None
    for field, spec, conversion in fields:
        if field not in names or spec or conversion:
            written = field + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
            raise ChatTemplateError(f"{key} uses {{{written}}}; it may use only {allowed}")
    if "content" in names and "content" not in [f for f, _, _ in fields]:
        # Every message would render without its text: the model would never see the conversation.
        raise ChatTemplateError(f"{key} {text!r} never uses {{content}}")


def _check_stops(stops: object) -> None:
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ChatTemplateError(f"stop must be a list of strings, got {stops!r}")
    if len(stops) > MAX_STOPS:
        raise ChatTemplateError(f"stop has {len(stops)} strings, more than the limit of {MAX_STOPS}")
    for s in stops:
        if not 1 <= len(s) <= MAX_STOP_CHARS:
            raise ChatTemplateError(
                f"stop strings must have 1 to {MAX_STOP_CHARS} characters, got {s!r}"
            )


def is_jinja(template: Mapping[str, Any]) -> bool:
    return "jinja" in template


def _validate_jinja(template: dict[str, Any]) -> None:
    unknown = sorted(set(template) - {"jinja", "named", "special_tokens"})
    if unknown:
        raise ChatTemplateError(f"unknown field(s) {', '.join(map(repr, unknown))}")
    named = template.get("named", {})
    if not isinstance(named, dict) or len(named) > MAX_NAMED_TEMPLATES:
        raise ChatTemplateError(f"named must be an object of at most {MAX_NAMED_TEMPLATES} templates")
    specials = template.get("special_tokens", {})
    if not isinstance(specials, dict) or len(specials) > MAX_SPECIAL_TOKENS or not all(
        isinstance(k, str) and isinstance(v, str) and len(v) <= MAX_ROLE_CHARS for k, v in specials.items()
    ):
        raise ChatTemplateError(
            f"special_tokens must map at most {MAX_SPECIAL_TOKENS} names to strings of at most "
            f"{MAX_ROLE_CHARS} characters"
        )
    for where, source in [("jinja", template["jinja"]), *((f"named.{k}", v) for k, v in named.items())]:
        if not isinstance(source, str) or not source or len(source) > MAX_JINJA_CHARS:
            raise ChatTemplateError(f"{where} must be a Jinja template of 1 to {MAX_JINJA_CHARS} characters")
        try:
            compile_template(source)
        except JinjaTemplateError as e:
            raise ChatTemplateError(f"{where} {e}") from None
    try:
        render(template["jinja"], PROBE, special_tokens=specials)
    except JinjaTemplateError as e:
        raise ChatTemplateError(f"jinja cannot render a user message and a reply: {e}") from None


def render_chat(
    template: Mapping[str, Any],
    messages: Iterable[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The conversation as the model's prompt; ChatTemplateError when the template refuses it (a
    role it has no speaker for, a Jinja template's own `raise_exception`, a bound it passed).

    `tools` (JSON schemas) go to a Jinja template, its `tool_use` one when it has that; a data-only
    template cannot show them to the model and refuses them.
    """
    if is_jinja(template):
        named = template.get("named", {})
        source = named["tool_use"] if tools is not None and "tool_use" in named else template["jinja"]
        try:
            return render(source, list(messages), special_tokens=template.get("special_tokens", {}),
                          add_generation_prompt=add_generation_prompt, tools=tools)
        except JinjaTemplateError as e:
            raise ChatTemplateError(f"the model's chat template refused these messages: {e}") from None
    if tools:
        raise ChatTemplateError("this model's chat template has no way to show tools to the model")
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


def from_hf(value: object, special_tokens: Mapping[str, str]) -> dict[str, Any]:
    """A template as tokenizer_config.json holds it (Jinja text, or a list of {"name", "template"}
    of which `default` is the one used and every other is kept under `named`), unvalidated."""
    if isinstance(value, list):
        pairs = [(t.get("name"), t.get("template")) for t in value if isinstance(t, dict)]
        if len(pairs) != len(value) or not all(isinstance(n, str) for n, _ in pairs):
            raise ChatTemplateError('a list of chat templates holds {"name": ..., "template": ...} objects')
        named: dict[str, Any] = dict(pairs)  # type: ignore[arg-type]  # the names checked just above
        if "default" not in named:
            listed = ", ".join(sorted(named))
            raise ChatTemplateError(f"none of the named chat templates ({listed}) is 'default'")
        value = named.pop("default")
        return {"jinja": value, "named": named, "special_tokens": dict(special_tokens)}
    return {"jinja": value, "special_tokens": dict(special_tokens)}


def to_hf(template: Mapping[str, Any]) -> str | list[dict[str, str]]:
    """A Jinja template as tokenizer_config.json's `chat_template` writes it (from_hf's inverse)."""
    if not template.get("named"):
        return str(template["jinja"])
    return [{"name": "default", "template": template["jinja"]},
            *({"name": k, "template": v} for k, v in template["named"].items())]


def template_from_file(path: Path, special_tokens: Mapping[str, str]) -> dict[str, Any]:
    """The template in `path` (`serve --chat-template`), validated as a checkpoint's is: Jinja
    text, rendered with `special_tokens`; or a JSON file holding a data-only template, or a
    tokenizer_config.json whose `chat_template` is taken."""
    try:
        if path.stat().st_size > MAX_JINJA_CHARS * 4:
            raise ChatTemplateError(f"{path}: larger than {MAX_JINJA_CHARS * 4} bytes")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"{path}: cannot read it ({e})") from None
    template: Any = {"jinja": text, "special_tokens": dict(special_tokens)}
    if path.suffix == ".json":
        try:
            template = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ChatTemplateError(f"{path}: not valid JSON ({e})") from None
        if isinstance(template, dict) and "chat_template" in template:
            template = from_hf(template["chat_template"], special_tokens)
    try:
        validate_template(template)
    except ChatTemplateError as e:
        raise ChatTemplateError(f"{path}: {e}") from None
    return dict(template)


def template_stop_sequences(template: Mapping[str, Any]) -> list[str]:
    """Stop strings that end the assistant's turn under this template (a Jinja template has none:
    its model ends a turn with an end token, which the checkpoint's end_token_ids stop on)."""
    return list(template.get("stop", []))


def fit_chat(
    template: Mapping[str, Any], messages: Sequence[Mapping[str, Any]], fits: Callable[[str], bool],
    tools: list[dict[str, Any]] | None = None,
) -> tuple[str, int]:
    """The conversation rendered with as few of its oldest turns dropped as make `fits` accept it:
    (text, messages dropped).

    System messages and the last message are never dropped: cropping the rendered text from the
    left (what a model's window otherwise forces) would lose the system prompt first, the part of
    a conversation meant to hold throughout. When even the system messages and the last message
    do not fit, nothing is dropped: the caller crops the whole text from the left, which keeps
    the most recent context. `fits` must accept any text shorter than one it accepts (the count
    of dropped turns is found by bisection). A template that refuses a count (a Jinja template
    that wants the user's turn first) gets the next one up.
    """
    text = render_chat(template, messages, tools=tools)
    if fits(text):
        return text, 0
    droppable = [i for i, m in enumerate(messages[:-1]) if m.get("role") != "system"]

    def without(k: int) -> tuple[int, str] | None:
        """The k oldest droppable messages left out (or k + 1, where the template refuses k)."""
        for count in range(k, min(k + 2, len(droppable) + 1)):
            gone = set(droppable[:count])
            try:
                kept = [m for i, m in enumerate(messages) if i not in gone]
                return count, render_chat(template, kept, tools=tools)
            except ChatTemplateError:
                continue
        return None

    def fitting(k: int) -> bool:
        found = without(k)
        return found is not None and fits(found[1])

    if not droppable or not fitting(len(droppable)):
        return text, 0
    lo, hi = 1, len(droppable)  # fitting(hi) holds; find the smallest such count
    while lo < hi:
        mid = (lo + hi) // 2
        if fitting(mid):
            hi = mid
        else:
            lo = mid + 1
    found = without(lo)
    assert found is not None  # fitting(lo) held
    return found[1], found[0]
