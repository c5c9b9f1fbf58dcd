"""Hugging Face chat templates: Jinja, rendered in a sandbox the way transformers renders it.

The environment is transformers' (`transformers.utils.chat_template_utils`): an
`ImmutableSandboxedEnvironment` with trim_blocks and lstrip_blocks, the `loopcontrols` extension and
the `{% generation %}` tag, `raise_exception`, a `tojson` that neither escapes HTML nor sorts keys,
`strftime_now`, and its restricted `dict` and `namespace`. A template sees `messages` (None-valued
fields dropped, reasoning under all its names, as transformers passes them), `tools`, `documents`,
`add_generation_prompt` and the special tokens (`bos_token`, `eos_token`, ...). So the text, and
the tokens it encodes to, are those of `tokenizer.apply_chat_template`.

A template is the checkpoint's, or the operator's: a client sends only messages. Still, a template
must not be able to hold the server, so rendering is bounded beyond transformers' sandbox:
- `range()` yields at most 100,000 items (Jinja's sandbox limit);
- `*` makes at most MAX_REPEAT items or characters, and `**` takes exponents up to MAX_EXPONENT;
- a render ends with an error after RENDER_TIMEOUT_S: every `for` loop's iterable is wrapped (at
  compile time) in a filter that checks the clock, as are every call, attribute and item lookup,
  and every piece of output; a template has no other way to loop (recursion ends in RecursionError);
- the output is at most MAX_OUTPUT_CHARS.
"""

from __future__ import annotations

import json
import math
import operator
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_TIMEOUT_S = 1.0  # real templates render a long conversation in milliseconds
MAX_REPEAT = 1 << 20
MAX_EXPONENT = 1024
MAX_OUTPUT_CHARS = 16 << 20
# The filter every `for` loop's iterable passes through; a template may name it too, harmlessly.
BOUNDED_FILTER = "nanoserve_bounded"
_CHECK_EVERY = 256  # loop iterations between clock checks
# Names transformers passes a message's reasoning under (the first is what templates read).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

_deadline: ContextVar[float] = ContextVar("jinja_render_deadline", default=math.inf)


class JinjaTemplateError(ValueError):
    """A template that does not compile, or a render that failed (the message says why)."""


class _RenderTimeout(TemplateError):
    pass


def _check_clock() -> None:
    if time.monotonic() > _deadline.get():
        raise _RenderTimeout(f"rendering took more than {RENDER_TIMEOUT_S:g} s (a template that loops?)")


def _bounded(iterable: Iterable[Any]) -> Iterator[Any]:
    for i, item in enumerate(iterable):
        if i % _CHECK_EVERY == 0:
            _check_clock()
        yield item


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with the clock checked at every call and lookup and `*`/`**` capped."""

    intercepted_binops = frozenset({"*", "**"})

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _check_clock()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _check_clock()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _check_clock()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        if op == "*":
            for seq, count in ((left, right), (right, left)):
                sized = isinstance(seq, (str, list, tuple)) and isinstance(count, int)
                if sized and len(seq) * count > MAX_REPEAT:
                    raise SecurityError(f"`*` would make more than {MAX_REPEAT} items")
            return operator.mul(left, right)
        if isinstance(right, int) and abs(right) > MAX_EXPONENT and isinstance(left, int) and abs(left) > 1:
            raise SecurityError(f"`**` takes exponents of at most {MAX_EXPONENT}")
        return operator.pow(left, right)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's tokens with it
    (for training masks); the body renders as it is."""

    tags = {"generation"}  # noqa: RUF012 (Extension declares it a plain attribute)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers' own: Jinja's built-in escapes HTML characters and sorts keys.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)`, and nothing of the dict type to reach through."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore-prefixed names (no way to CPython's internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Namespace's own signature trick: self in args
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a namespace cannot hold underscore-prefixed names, got {name!r}")


@lru_cache(maxsize=1)
def _environment() -> _BoundedEnvironment:
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                              extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters[BOUNDED_FILTER] = _bounded
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_TemplateDict(), namespace=_TemplateNamespace)
    return env


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template (cached by its text); JinjaTemplateError names a syntax error's line."""
    env = _environment()
    try:
        tree = env.parse(source)
        for loop in list(tree.find_all(jinja2.nodes.For)):
            loop.iter = jinja2.nodes.Filter(loop.iter, BOUNDED_FILTER, [], [], None, None,
                                            lineno=loop.lineno)
        return env.from_string(tree)
    except TemplateSyntaxError as e:
        raise JinjaTemplateError(f"does not compile: line {e.lineno}: {e.message}") from None
    except TemplateError as e:  # an unknown filter or test is found when compiling
        raise JinjaTemplateError(f"does not compile: {e}") from None


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as transformers hands them to a template: fields that are None left out (templates
    test for a field's presence), a message's reasoning under each of its names."""
    out = []
    for message in messages:
        msg = {k: v for k, v in message.items() if v is not None}
        reasoning = next((msg[k] for k in _REASONING_FIELDS if k in msg), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


def render(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    special_tokens: Mapping[str, str],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The conversation as `tokenizer.apply_chat_template(messages, tokenize=False, ...)` renders it.

    Raises JinjaTemplateError with the template's own message (its `raise_exception`), or naming
    the bound it passed or the Python error it hit.
    """
    template = compile_template(source)
    token = _deadline.set(time.monotonic() + RENDER_TIMEOUT_S)
    try:
        parts: list[str] = []
        size = 0
        for part in template.generate(messages=template_messages(messages), tools=tools, documents=None,
                                      add_generation_prompt=add_generation_prompt, **special_tokens):
            size += len(part)
            if size > MAX_OUTPUT_CHARS:
                raise SecurityError(f"the rendered text passed {MAX_OUTPUT_CHARS} characters")
            _check_clock()
            parts.append(part)
        return "".join(parts)
    except TemplateError as e:  # raise_exception, a sandbox refusal, the clock
        raise JinjaTemplateError(str(e) or type(e).__name__) from None
    except (TypeError, ValueError, LookupError, ArithmeticError, RecursionError) as e:
        raise JinjaTemplateError(f"the template failed: {type(e).__name__}: {e}") from None
    finally:
        _deadline.reset(token)
