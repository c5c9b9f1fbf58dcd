"""The chat side of a Hugging Face model directory: its chat template, special tokens and end tokens.

Read by `import-hf` into the checkpoint (the template and the special tokens as its chat template,
the end tokens as its end_token_ids) and written back by `export-hf`, where transformers reads them:

    chat_template.jinja               the template (transformers 5 writes it here)
    additional_chat_templates/*.jinja the named templates besides `default`
    tokenizer_config.json             `chat_template` (text, or a list of named ones: transformers 4),
                                      bos_token, eos_token and the other `*_token` entries
    chat_template.json                `chat_template` (what processors save)
    generation_config.json            eos_token_id: one id or a list, every one ending a generation
    config.json                       eos_token_id, when there is no generation_config.json

A template file found first in that order wins; the end tokens are the tokenizer's eos_token and
every eos_token_id, as transformers' `generate` and vLLM stop on them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanoserve.model.chat_template import MAX_JINJA_CHARS, ChatTemplateError, from_hf, is_jinja, to_hf
from nanoserve.model.checkpoint import read_json_object
from nanoserve.model.tokenizer import Tokenizer

TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_JSON = "chat_template.json"
CHAT_TEMPLATES_DIR = "additional_chat_templates"


class HFChatError(ValueError):
    """A chat file that cannot be read; the message names the file and the problem."""


@dataclass
class HFChat:
    """What a directory says about chat: a Jinja template (None: it has none) and the end tokens."""

    template: dict[str, Any] | None = None
    end_token_ids: list[int] = field(default_factory=list)


def read_chat(src: Path, model_config: dict[str, Any], tokenizer: Tokenizer) -> HFChat:
    tok_config = _json(src / TOKENIZER_CONFIG)
    specials = special_tokens(tok_config)
    source: object = None
    where = src / TOKENIZER_CONFIG
    for path, value in ((src / CHAT_TEMPLATE_FILE, lambda p: _text(p)),
                        (src / CHAT_TEMPLATE_JSON, lambda p: _json(p).get("chat_template")),
                        (src / TOKENIZER_CONFIG, lambda p: tok_config.get("chat_template"))):
        if path.is_file() and (source := value(path)) is not None:
            where = path
            break
    template = None
    if source is not None:
        try:
            template = from_hf(source, specials)
        except ChatTemplateError as e:
            raise HFChatError(f"{where}: {e}") from None
        extra = sorted((src / CHAT_TEMPLATES_DIR).glob("*.jinja"))
        if extra:
            template["named"] = {**template.get("named", {}), **{p.stem: _text(p) for p in extra}}
    generation = _json(src / GENERATION_CONFIG)
    ids = generation.get("eos_token_id", model_config.get("eos_token_id"))
    return HFChat(template, end_ids(tokenizer, specials.get("eos_token"), ids))


def special_tokens(tok_config: dict[str, Any]) -> dict[str, str]:
    """The `*_token` entries (text, or an AddedToken object's content): what transformers hands a
    template as variables (its `special_tokens_map`)."""
    out = {}
    for key, value in tok_config.items():
        if isinstance(value, dict):
            value = value.get("content")
        if key.endswith("_token") and isinstance(value, str):
            out[key] = value
    return out


def end_ids(tokenizer: Tokenizer, eos_token: str | None, eos_token_id: object) -> list[int]:
    """The eos token's id and every eos_token_id, once each, in that order. Ids the tokenizer does
    not have are left out: the engine never samples them (a config's default eos_token_id often
    belongs to another vocabulary)."""
    ids: list[int] = []
    try:
        found = tokenizer.encode(eos_token) if eos_token else []
    except ValueError:  # a character or word the vocabulary does not have
        found = []
    if len(found) == 1:
        ids.append(found[0])
    listed = eos_token_id if isinstance(eos_token_id, list) else [eos_token_id]
    ids += [i for i in listed if type(i) is int and 0 <= i < tokenizer.vocab_size]
    return list(dict.fromkeys(ids))


def write_chat(out: Path, template: dict[str, Any], eos_ids: list[int]) -> None:
    """Add the checkpoint's Jinja template and special tokens to the exported tokenizer_config.json,
    and its end tokens as generation_config.json's eos_token_id (one id, or the list)."""
    if is_jinja(template):
        path = out / TOKENIZER_CONFIG
        tok_config = _json(path)
        tok_config.update(template.get("special_tokens", {}), chat_template=to_hf(template))
        path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    if eos_ids:
        generation = {"eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}
        (out / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")


def _json(path: Path) -> dict[str, Any]:
    return read_json_object(path, HFChatError) if path.is_file() else {}


def _text(path: Path) -> str:
    try:
        if path.stat().st_size > MAX_JINJA_CHARS:
            raise HFChatError(f"{path}: larger than {MAX_JINJA_CHARS} bytes")
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise HFChatError(f"{path}: cannot read it ({e})") from None
