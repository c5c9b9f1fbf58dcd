"""Structured-output requests in each API family's shape, turned into the engine's GrammarSpec.

OpenAI: `response_format` {"type": "text"} | {"type": "json_object"} |
{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}.
TGI (router/src/lib.rs GrammarType, tagged by "type" with content "value"): {"type": "json",
"value": <schema>} (alias "json_object"), {"type": "regex", "value": "<pattern>"} and
{"type": "json_schema", "value": {"name", "schema"}}.
On the OpenAI routes `response_format` takes either family's shapes (`response_format_grammar`),
as TGI's chat route does.
Shapes are checked here (4xx naming the field); whether a schema or regex compiles, and whether the
model's vocabulary can write it, is checked by the engine when the request is submitted.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic_core import PydanticCustomError

from nanoserve.engine.types import GrammarSpec

ANY_OBJECT = '{"type": "object"}'  # JSON mode: any JSON object, as OpenAI's json_object


def _bad(message: str) -> PydanticCustomError:
    return PydanticCustomError("value_error", message)


def _schema_text(schema: Any, where: str) -> str:
    if isinstance(schema, str):  # TGI also takes the schema as JSON text
        try:
            schema = json.loads(schema)
        except ValueError:
            raise _bad(f"{where} is a string that is not JSON") from None
    if not isinstance(schema, dict | bool):
        raise _bad(f"{where} must be a JSON Schema (an object)")
    return json.dumps(schema)


def openai_grammar(fmt: dict[str, Any] | None) -> GrammarSpec | None:
    """OpenAI's response_format as a grammar (None for plain text)."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text" and set(fmt) == {"type"}:
        return None
    if kind == "json_object" and set(fmt) == {"type"}:
        return GrammarSpec("json_schema", ANY_OBJECT)
    if kind == "json_schema" and set(fmt) == {"type", "json_schema"}:
        spec = fmt["json_schema"]
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise _bad('response_format.json_schema must be an object with a string "name"')
        extra = set(spec) - {"name", "schema", "strict", "description"}
        if extra:
            raise _bad(f"response_format.json_schema has unknown fields: {sorted(extra)}")
        schema = _schema_text(spec.get("schema", {}), "response_format.json_schema.schema")
        return GrammarSpec("json_schema", schema)
    raise _bad('response_format must be {"type": "text"}, {"type": "json_object"} or '
               '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}')


def tgi_grammar(grammar: dict[str, Any] | None, field: str = "grammar") -> GrammarSpec | None:
    """TGI's parameters.grammar (or, on its chat route, `response_format`: `field`) as a grammar
    (None when absent)."""
    if grammar is None:
        return None
    kind, value = grammar.get("type"), grammar.get("value")
    if set(grammar) != {"type", "value"}:
        raise _bad(f'{field} must be {{"type": "json" | "regex" | "json_schema", "value": ...}}')
    if kind in ("json", "json_object"):
        return GrammarSpec("json_schema", _schema_text(value, f"{field}.value"))
    if kind == "json_schema":
        if not isinstance(value, dict) or "schema" not in value:
            raise _bad(f'{field}.value of type json_schema must be {{"name": ..., "schema": {{...}}}}')
        return GrammarSpec("json_schema", _schema_text(value["schema"], f"{field}.value.schema"))
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise _bad(f"{field}.value of type regex must be a non-empty string")
        return GrammarSpec("regex", value)
    raise _bad(f'{field}.type must be "json", "json_schema" or "regex", got {kind!r}')


def response_format_grammar(fmt: dict[str, Any] | None) -> GrammarSpec | None:
    """`response_format` of the OpenAI routes: OpenAI's shapes, or TGI's (its chat route takes a
    grammar there: {"type": ..., "value": ...}, as huggingface_hub sends it)."""
    if fmt is not None and "value" in fmt:
        return tgi_grammar(fmt, "response_format")
    if fmt is not None and fmt.get("type") in ("json", "regex"):
        raise _bad(f'response_format of type {fmt.get("type")!r} (TGI\'s) needs its "value"')
    return openai_grammar(fmt)
