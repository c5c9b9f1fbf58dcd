"""The Jinja environment: transformers' sandbox and helpers, the bounds that keep a template from
holding the server, and `--chat-template` files of each kind."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from nanoserve.model.chat_template import ChatTemplateError, render_chat, template_from_file
from nanoserve.model.checkpoint import DEFAULT_CHAT_TEMPLATE
from nanoserve.model.jinja_template import RENDER_TIMEOUT_S, JinjaTemplateError, render

HELLO = [{"role": "user", "content": "Hello <b>&</b>", "name": None}]


def _render(source: str) -> str:
    return render(source, HELLO, special_tokens={"eos_token": "</s>"})


@pytest.mark.parametrize(("source", "expected"), [
    # transformers' tojson: no HTML escaping, keys in order, its indent option
    ("{{ {'b': messages[0].content, 'a': 1} | tojson }}", '{"b": "Hello <b>&</b>", "a": 1}'),
    ("{{ [1] | tojson(indent=2) }}", "[\n  1\n]"),
    # None-valued fields are left out, as transformers does: templates test for presence
    ("{{ 'name' in messages[0] }} {{ messages[0].name is defined }}", "False False"),
    ("{{ eos_token }}{{ bos_token is defined }}", "</s>False"),
    ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
     "{{ ns.n }}", "1"),
    ("{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}", "01"),
    ("{% generation %}{{ messages[0].role }}{% endgeneration %}", "user"),
    ("{{ dict(a=1) | tojson }} {{ strftime_now('%Y') | length }}", '{"a": 1} 4'),
    ("{% for m in messages %}{{ loop.length }}{{ loop.last }}{% endfor %}", "1True"),
    ("{{ 'ab' * 3 }}", "ababab"),
])
def test_transformers_helpers_and_semantics(source: str, expected: str) -> None:
    assert _render(source) == expected


@pytest.mark.parametrize(("source", "says"), [
    ("{{ ''.__class__.__mro__ }}", "unsafe"),  # the sandbox: no way to Python's internals
    ("{{ messages.append(1) }}", "unsafe"),  # immutable: a template cannot change its input
    ("{% set ns = namespace(_x=1) %}", "underscore-prefixed"),
    ("{{ raise_exception('bad turn order') }}", "bad turn order"),
    ("{{ range(100001) | list }}", "Range too big"),
    ("{{ 'x' * 100000000 }}", "`*` would make more than 1048576 items"),
    ("{{ 10 ** 100000 }}", "`**` takes exponents of at most 1024"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    ("{{ messages[0].content + 1 }}", "TypeError"),
    ("{% for i in range(100000) %}{{ 'y' * 1000000 }}{% endfor %}", "passed 16777216 characters"),
])
def test_what_a_template_cannot_do_is_an_error_naming_it(source: str, says: str) -> None:
    with pytest.raises(JinjaTemplateError, match=says.replace("*", r"\*")):
        _render(source)


@pytest.mark.parametrize("source", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% set r = range(100000) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}",  # no call inside
    "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}",
])
def test_a_loop_is_cut_off_at_the_render_bound(source: str) -> None:
    start = time.monotonic()
    with pytest.raises(JinjaTemplateError, match=f"rendering took more than {RENDER_TIMEOUT_S:g} s"):
        _render(source)
    assert time.monotonic() - start < RENDER_TIMEOUT_S + 2  # the bound, not the loop's 10^10 turns


def test_chat_template_files_of_each_kind(tmp_path: Path) -> None:
    specials = {"eos_token": "<|im_end|>"}
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{% for m in messages %}{{ m.content + eos_token }}{% endfor %}", encoding="utf-8")
    assert render_chat(template_from_file(jinja, specials), HELLO) == "Hello <b>&</b><|im_end|>"
    tok_config = tmp_path / "tokenizer_config.json"
    tok_config.write_text(json.dumps({"chat_template": jinja.read_text(), "eos_token": "ignored"}))
    assert template_from_file(tok_config, specials) == template_from_file(jinja, specials)
    data = tmp_path / "data.json"
    data.write_text(json.dumps(DEFAULT_CHAT_TEMPLATE))
    assert template_from_file(data, specials) == DEFAULT_CHAT_TEMPLATE
    data.write_text(json.dumps({**DEFAULT_CHAT_TEMPLATE, "message": "{text}"}))
    with pytest.raises(ChatTemplateError, match=r"data\.json: message uses \{text\}"):
        template_from_file(data, specials)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ChatTemplateError, match=r"bad\.json: not valid JSON"):
        template_from_file(tmp_path / "bad.json", specials)
