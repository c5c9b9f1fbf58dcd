"""Chat templates: how a checkpoint turns a conversation into the text its model has learned.

A template is plain data stored in the checkpoint's config.json (never code, never Jinja):

    {"roles": {"system": "CHORUS", "user": "ROMEO", "assistant": "JULIET"},
     "message": "{role}:\\n{content}\\n\\n", "generation_prompt": "{role}:\\n", "stop": ["\\n\\n"]}

A message's optional `name` replaces its role's speaker name, so a chat can cast any characters.
`validate_template` is what a checkpoint's template must pass at load (and `nanoserve train
--chat-template` before training): a speaker for each of system, user and assistant; `message`
uses {content} and at most {role}, `generation_prompt` at most {role} (`{{`/`}}` for literal
braces, no other fields, conversions or format specs); up to 8 stop strings of 1 to 256 characters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from string import Formatter
from typing import Any

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


class ChatTemplateError(ValueError):
    pass


def validate_template(template: object) -> None:
    """Raise ChatTemplateError naming the first problem of a checkpoint's chat template.

    Checked once at load, so that a template that cannot render refuses the checkpoint instead of
    failing every chat request (or blaming the client, as an empty stop string would).
    """
    if not isinstance(template, dict):
        raise ChatTemplateError(f"must be a JSON object, got {type(template).__name__}")
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
