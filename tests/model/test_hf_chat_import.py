"""`import-hf` carries a Hugging Face model's chat template, special tokens and end tokens into the
checkpoint, the checkpoint renders prompts token for token as transformers does, and `export-hf`
writes them back where transformers reads them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from nanoserve.cli import main
from nanoserve.model.chat_template import render_chat
from nanoserve.model.checkpoint import CheckpointError, load_checkpoint
from nanoserve.model.reference import reference_generate
from tests.conftest import require_module
from tests.model.chatml_llama import MESSAGES, REPLY, TEMPLATE, ChatMLLlama, save_chatml_llama


@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> ChatMLLlama:
    require_module("transformers")
    return save_chatml_llama(tmp_path_factory.mktemp("chatml-llama"))


@pytest.fixture(scope="module")
def imported(chatml: ChatMLLlama, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("imported") / "ckpt"
    assert main(["import-hf", str(chatml.path), str(out)]) == 0
    return out


def test_import_carries_the_template_special_tokens_and_end_tokens(chatml: ChatMLLlama,
                                                                   imported: Path) -> None:
    assert (chatml.path / "chat_template.jinja").is_file()  # transformers 5 writes the template here
    ckpt = load_checkpoint(imported)
    assert ckpt.chat_template["jinja"] == TEMPLATE
    assert ckpt.chat_template["special_tokens"] == {
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>"}
    # The tokenizer's eos_token, then generation_config.json's list.
    assert ckpt.end_token_ids == (chatml.im_end, chatml.endoftext)
    assert ckpt.tokenizer.end_ids == {chatml.im_end, chatml.endoftext}


@pytest.mark.parametrize("turns", [1, 2, 4])
def test_prompt_ids_equal_apply_chat_template(chatml: ChatMLLlama, imported: Path, turns: int) -> None:
    ckpt = load_checkpoint(imported)
    reply = {"role": "assistant", "content": "Hello!"}
    messages = [MESSAGES[1] if i % 2 == 0 else reply for i in range(turns)]
    for convo in (messages, [MESSAGES[0], *messages]):  # SmolLM2's default system prompt, and one given
        theirs = chatml.tokenizer.apply_chat_template(convo, add_generation_prompt=True, return_dict=False)
        ours = ckpt.tokenizer.encode(render_chat(ckpt.chat_template, convo))
        assert ours == theirs
        assert ours.count(chatml.im_end) == len(convo) + (convo[0]["role"] != "system")


def test_the_model_says_its_reply_and_ends_its_turn_as_transformers_generates(
    chatml: ChatMLLlama, imported: Path
) -> None:
    """The fixture's weights are what the served tests rely on: greedy text "ab", then <|im_end|>."""
    import torch

    ckpt = load_checkpoint(imported)
    prompt = ckpt.tokenizer.encode(render_chat(ckpt.chat_template, MESSAGES))
    with torch.no_grad():
        theirs = chatml.model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    new = theirs[0, len(prompt):].tolist()
    assert new == [*ckpt.tokenizer.encode(REPLY), chatml.im_end]  # transformers stops at <|im_end|> too
    ours = reference_generate(ckpt.build_model(), prompt, 3)
    assert ours == new


def test_export_writes_them_back_where_transformers_reads_them(chatml: ChatMLLlama, imported: Path,
                                                                tmp_path: Path) -> None:
    import transformers

    assert main(["export-hf", str(imported), str(tmp_path / "hf")]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tok.chat_template == TEMPLATE and tok.eos_token == "<|im_end|>" and tok.bos_token == "<|im_start|>"
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [chatml.im_end, chatml.endoftext]
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False) == \
        chatml.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    back, first = load_checkpoint(tmp_path / "back"), load_checkpoint(imported)
    assert (back.chat_template, back.end_token_ids) == (first.chat_template, first.end_token_ids)


def _copy(src: Path, dst: Path, **tok_config: Any) -> Path:
    shutil.copytree(src, dst)
    path = dst / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **tok_config}))
    return dst


def test_a_list_of_named_templates_keeps_them_all_and_uses_default(chatml: ChatMLLlama,
                                                                    tmp_path: Path) -> None:
    src = _copy(chatml.path, tmp_path / "src", chat_template=[
        {"name": "default", "template": TEMPLATE}, {"name": "tool_use", "template": "{{ tools|tojson }}"}])
    (src / "chat_template.jinja").unlink()
    assert main(["import-hf", str(src), str(tmp_path / "ckpt")]) == 0
    template = load_checkpoint(tmp_path / "ckpt").chat_template
    assert template["jinja"] == TEMPLATE and template["named"] == {"tool_use": "{{ tools|tojson }}"}
    assert render_chat(template, MESSAGES, tools=[{"name": "f"}]) == '[{"name": "f"}]'


@pytest.mark.parametrize(("template", "says"), [
    ("{% for m in messages %}{{ m.content }",
     "chat template cannot be served: jinja does not compile: line 1"),
    ("{{ raise_exception('no chats here') }}", "cannot render a user message and a reply: no chats here"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "rendering took more than 1 s"),
    ([{"name": "tool_use", "template": "x"}], "none of the named chat templates (tool_use) is 'default'"),
])
def test_a_template_that_cannot_serve_is_refused_at_import(
    chatml: ChatMLLlama, tmp_path: Path, template: Any, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _copy(chatml.path, tmp_path / "src", chat_template=template)
    (src / "chat_template.jinja").unlink()
    assert main(["import-hf", str(src), str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("nanoserve import-hf: error: ") and says in err, err


def test_a_checkpoint_with_a_bad_end_token_is_refused_naming_it(imported: Path, tmp_path: Path) -> None:
    ckpt = shutil.copytree(imported, tmp_path / "ckpt")
    manifest = json.loads((ckpt / "config.json").read_text())
    manifest["end_token_ids"] = [5, 100000]
    (ckpt / "config.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"end_token_ids must be a list of token ids from 0 to \d+"):
        load_checkpoint(ckpt)
    del manifest["end_token_ids"]  # a checkpoint written before end tokens: eos_id alone
    (ckpt / "config.json").write_text(json.dumps(manifest))
    assert load_checkpoint(ckpt).end_token_ids == ()
