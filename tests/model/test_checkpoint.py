"""Checkpoints: the round trip, and every way a bad directory is refused with a specific message."""

from __future__ import annotations

import json
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoserve.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from nanoserve.model.config import GPTConfig
from nanoserve.model.gpt import GPT
from nanoserve.model.tokenizer import CharTokenizer
from tests.conftest import make_tiny_checkpoint


@pytest.fixture
def ckpt_dir(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny checkpoint that a test may damage."""
    return Path(shutil.copytree(tiny_checkpoint, tmp_path / "ckpt"))


def _edit_weights(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


@torch.no_grad()
def test_round_trip_gives_identical_logits(tmp_path: Path) -> None:
    tok = CharTokenizer.train("abcdefgh \n")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=16, n_layer=2, n_head=2, n_embd=16,
                          bias=False)).eval()
    template = {"roles": {"system": "S", "user": "A", "assistant": "B"}, "message": "{role}: {content}\n",
                "generation_prompt": "{role}:", "stop": ["\n"]}
    save_checkpoint(tmp_path / "c", model, tok, name="rt", chat_template=template,
                    provenance={"steps": 3}, card="# rt\n")
    ckpt = load_checkpoint(tmp_path / "c")
    assert (ckpt.name, ckpt.chat_template, ckpt.provenance) == ("rt", template, {"steps": 3})
    assert ckpt.dtype == "float32"
    assert ckpt.config == model.config and ckpt.tokenizer.encode("bad") == tok.encode("bad")
    assert (tmp_path / "c" / "README.md").read_text() == "# rt\n"
    idx = torch.randint(0, tok.vocab_size, (2, 16))
    loaded = ckpt.build_model()
    assert loaded.lm_head.weight is loaded.wte.weight  # still tied after loading
    assert torch.equal(loaded(idx), model(idx))


@torch.no_grad()
def test_a_converted_model_holds_the_converted_weights_tied(tmp_path: Path) -> None:
    # build_model converts one tensor at a time (handing each one's file pages back): the result
    # is what converting the whole state dict gives, and the output layer stays the embedding.
    ckpt = load_checkpoint(make_tiny_checkpoint(tmp_path / "a"))
    model = ckpt.build_model(dtype=torch.bfloat16)
    assert model.lm_head.weight is model.wte.weight
    state = model.state_dict()
    for name, tensor in ckpt.state_dict.items():
        assert torch.equal(state[name], tensor.to(torch.bfloat16)), name
    on_disk = load_file(str(tmp_path / "a" / "model.safetensors"))  # the paged-out source reads the same
    assert all(torch.equal(ckpt.state_dict[name], t) for name, t in on_disk.items())


@torch.no_grad()
def test_bfloat16_weights_round_trip_in_bfloat16(tmp_path: Path) -> None:
    ckpt = load_checkpoint(make_tiny_checkpoint(tmp_path / "a"))
    model = ckpt.build_model(dtype=torch.bfloat16)
    save_checkpoint(tmp_path / "b", model, ckpt.tokenizer, name="bf16")
    again = load_checkpoint(tmp_path / "b")
    assert again.dtype == "bfloat16" and again.state_dict["wte.weight"].dtype == torch.bfloat16
    assert torch.equal(again.state_dict["wte.weight"], model.wte.weight)


def _drop(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda t: t.__delitem__(name)


def _set(name: str, value: torch.Tensor) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda t: t.__setitem__(name, value)


BAD_WEIGHTS = {
    "missing": (_drop("h.1.mlp.c_fc.weight"), r"model.safetensors: missing tensor\(s\): h.1.mlp.c_fc.weight"),
    "extra": (_set("h.2.ln_1.weight", torch.ones(32)), r"unexpected tensor\(s\): h.2.ln_1.weight"),
    "shape": (_set("wpe.weight", torch.zeros(32, 32)),
              r"tensor wpe.weight has shape \[32, 32\], config.json implies \[64, 32\]"),
    "dtype": (_set("ln_f.bias", torch.zeros(32, dtype=torch.float16)),
              "tensor ln_f.bias has dtype float16, config.json says float32"),
    "nan": (_set("ln_f.weight", torch.full((32,), float("nan"))),
            "tensor ln_f.weight contains NaN or infinite values"),
}


@pytest.mark.parametrize("case", sorted(BAD_WEIGHTS))
def test_bad_tensors_are_rejected_by_name(ckpt_dir: Path, case: str) -> None:
    edit, message = BAD_WEIGHTS[case]
    _edit_weights(ckpt_dir, edit)
    with pytest.raises(CheckpointError, match=message) as e:
        load_checkpoint(ckpt_dir)
    assert str(ckpt_dir / "model.safetensors") in str(e.value)


def test_corrupt_safetensors_is_rejected(ckpt_dir: Path) -> None:
    weights = ckpt_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a valid safetensors file"):
        load_checkpoint(ckpt_dir)
    weights.write_bytes(b"\x00" * 7)
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        load_checkpoint(ckpt_dir)


def _forbid_unpickling(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("something was unpickled")

    for target, attr in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(target, attr, boom)


def test_a_pickle_checkpoint_is_refused_without_unpickling(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = load_file(str(ckpt_dir / "model.safetensors"))
    torch.save(weights, ckpt_dir / "pytorch_model.bin")  # a real pickle, as older tools write them
    (ckpt_dir / "model.safetensors").unlink()
    _forbid_unpickling(monkeypatch)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ckpt_dir)
    assert str(e.value) == (
        f"{ckpt_dir / 'model.safetensors'}: missing "
        "(found pytorch_model.bin: pickle files are never loaded)"
    )


def test_loading_a_good_checkpoint_unpickles_nothing(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _forbid_unpickling(monkeypatch)
    ckpt = load_checkpoint(tiny_checkpoint)
    ckpt.build_model()


def _rewrite_config(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: (p / "config.json").unlink(), r"config.json: missing \(a checkpoint needs config.json\)"),
        (lambda p: (p / "config.json").write_text("{nope"), "config.json: not valid JSON"),
        (lambda p: _rewrite_config(p, format_version=99), "format_version 99 is not supported"),
        (lambda p: _rewrite_config(p, dtype="int8"), "dtype 'int8' is not supported"),
        (lambda p: _rewrite_config(p, model={"vocab_size": 96, "n_heads": 2}),
         "invalid model config: unknown GPTConfig fields: n_heads"),
        (lambda p: (p / "tokenizer.json").unlink(), "tokenizer.json: missing"),
        (lambda p: (p / "tokenizer.json").write_text('{"kind": "morse"}'),
         "tokenizer.json: cannot load tokenizer"),
    ],
    ids=["no-config", "bad-json", "version", "dtype-name", "config-field", "no-tokenizer", "bad-tokenizer"],
)
def test_bad_manifests_are_rejected_by_name(ckpt_dir: Path, damage, message: str) -> None:  # type: ignore[no-untyped-def]
    damage(ckpt_dir)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(ckpt_dir)


def test_missing_directory_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="checkpoint directory not found"):
        load_checkpoint(tmp_path / "nowhere")


def _rewrite_model(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg["model"].update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


# Each model config value is refused by name at load: strict types (a bool is not an int, a string
# not a bool), bounds that keep absurd sizes from allocating anything, and values that would only
# fail at the first forward (a LayerNorm epsilon that is not a finite positive number).
BAD_MODEL_FIELDS: dict[str, tuple[dict[str, object], str]] = {
    "bias-string": ({"bias": "yes"}, "bias must be true or false, got 'yes'"),
    "bias-int": ({"bias": 1}, "bias must be true or false, got 1"),
    "layers-float": ({"n_layer": 2.0}, "n_layer must be a positive integer, got 2.0"),
    "layers-bool": ({"n_layer": True}, "n_layer must be a positive integer, got True"),
    "layers-huge": ({"n_layer": 100000}, "n_layer is 100000, more than the limit of 1024"),
    "width-2**40": ({"n_embd": 2**40}, "n_embd is 1099511627776, more than the limit of 65536"),
    "vocab-huge": ({"vocab_size": 2**40}, "vocab_size is 1099511627776, more than the limit"),
    "block-zero": ({"block_size": 0}, "block_size must be a positive integer, got 0"),
    "block-negative": ({"block_size": -64}, "block_size must be a positive integer, got -64"),
    "heads-indivisible": ({"n_head": 3}, r"n_embd \(32\) must be divisible by n_head \(3\)"),
    "eps-negative": ({"layer_norm_epsilon": -1e-5}, "layer_norm_epsilon must be a finite number above 0"),
    "eps-zero": ({"layer_norm_epsilon": 0}, "layer_norm_epsilon must be a finite number above 0"),
    "eps-nan": ({"layer_norm_epsilon": float("nan")}, "layer_norm_epsilon .* got nan"),
    "eps-infinite": ({"layer_norm_epsilon": float("inf")}, "layer_norm_epsilon .* got inf"),
    "eps-string": ({"layer_norm_epsilon": "1e-5"}, "layer_norm_epsilon .* got '1e-5'"),
    "dropout-bool": ({"dropout": False}, "dropout must be a number in"),
    "dropout-one": ({"dropout": 1.0}, "dropout must be a number in"),
}


@pytest.mark.parametrize("case", sorted(BAD_MODEL_FIELDS))
def test_bad_model_config_values_are_rejected_by_name(ckpt_dir: Path, case: str) -> None:
    changes, message = BAD_MODEL_FIELDS[case]
    _rewrite_model(ckpt_dir, **changes)
    with pytest.raises(CheckpointError, match=f"config.json: invalid model config: GPTConfig.{message}"):
        load_checkpoint(ckpt_dir)


def test_a_missing_vocab_size_is_named(ckpt_dir: Path) -> None:
    cfg = json.loads((ckpt_dir / "config.json").read_text())
    del cfg["model"]["vocab_size"]
    (ckpt_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="missing GPTConfig field: vocab_size"):
        load_checkpoint(ckpt_dir)


def _refuse_reading_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("the weights were read before the config was checked against them")

    monkeypatch.setattr("nanoserve.model.checkpoint.load_file", boom)


def test_a_config_that_does_not_describe_the_file_is_refused_from_its_header(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 1,000 layers is within the bounds; the 2-layer file's header is what refuses it, in one line
    # that names the first missing tensors and counts the rest, and no tensor is read to find out.
    _rewrite_model(ckpt_dir, n_layer=1000)
    _refuse_reading_weights(monkeypatch)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ckpt_dir)
    message = str(e.value)
    assert message.startswith(f"{ckpt_dir / 'model.safetensors'}: missing tensor(s): h.10.attn.c_attn.bias, ")
    assert message.endswith(" and 11968 more") and "\n" not in message


@pytest.mark.parametrize(
    ("changes", "message"),
    [({"n_embd": 64}, r"tensor wte.weight has shape \[\d+, 32\], config.json implies \[\d+, 64\]"),
     ({"block_size": 4096}, r"tensor wpe.weight has shape \[64, 32\], config.json implies \[4096, 32\]")],
    ids=["width", "context"],
)
def test_sizes_that_do_not_match_the_header_are_refused_before_reading(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch, changes: dict[str, int], message: str
) -> None:
    _rewrite_model(ckpt_dir, **changes)
    _refuse_reading_weights(monkeypatch)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(ckpt_dir)


def test_a_file_with_the_wrong_dtype_is_refused_before_reading(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _rewrite_config(ckpt_dir, dtype="bfloat16")
    _refuse_reading_weights(monkeypatch)
    with pytest.raises(CheckpointError, match=r"tensor .* has dtype float32, config.json says bfloat16"):
        load_checkpoint(ckpt_dir)


def _nested_config(path: Path) -> None:
    # Valid JSON that Python's parser cannot hold: it recurses once per level.
    (path / "config.json").write_text('{"format_version": 1, "model": ' + "[" * 100000 + "]" * 100000 + "}")


def _template(**changes: object) -> Callable[[Path], None]:
    template: dict[str, object] = {"roles": {"system": "S", "user": "U", "assistant": "A"},
                                   "message": "{role}: {content}\n", "generation_prompt": "{role}:",
                                   "stop": ["\n"]}
    template.update(changes)
    return lambda p: _rewrite_config(p, chat_template=template)


def _tokenizer_vocab(vocab: object) -> Callable[[Path], None]:
    def damage(p: Path) -> None:
        (p / "tokenizer.json").write_text(json.dumps({"kind": "char", "vocab": vocab}))

    return damage


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_nested_config, r"config.json: not valid JSON \(nested too deeply\)"),
        (lambda p: (p / "config.json").write_text(" " * (16 * 2**20 + 1)),
         "config.json: 16777217 bytes, more than the limit of 16777216"),
        (lambda p: _rewrite_config(p, format_version=True), "format_version True is not supported"),
        (lambda p: _rewrite_config(p, dtype=["float32"]), r"dtype \['float32'\] is not supported"),
        (lambda p: _rewrite_config(p, model=[1, 2]), "config.json: model must be a JSON object"),
        (lambda p: _rewrite_config(p, tokenizer="char"), "config.json: tokenizer must be a JSON object"),
        (lambda p: _rewrite_config(p, provenance=[]), "config.json: provenance must be a JSON object"),
        (lambda p: _rewrite_config(p, name=7), "name must be 1 to 256 printable characters, got 7"),
        (lambda p: _rewrite_config(p, name="a\nb"), r"name must be .* got 'a\\nb'"),
        (lambda p: _rewrite_config(p, tokenizer={"kind": "char", "vocab_size": 7, "eos_id": None}),
         "config.json: tokenizer.vocab_size is 7 but tokenizer.json has 96"),
        (lambda p: _rewrite_config(p, tokenizer={"kind": "word", "vocab_size": 96, "eos_id": None}),
         "config.json: tokenizer.kind is 'word' but tokenizer.json has 'char'"),
        (_tokenizer_vocab(["a", 5]), "vocab must be a non-empty list of non-empty strings"),
        (_tokenizer_vocab("abc"), "vocab must be a non-empty list of non-empty strings"),
        (_tokenizer_vocab(["a", "b", "a"]), "the char vocabulary has duplicate entries"),
        (lambda p: (p / "tokenizer.json").write_text("[" * 100000 + "]" * 100000),
         "tokenizer.json: cannot load tokenizer"),
        (_template(message="{role}: {text}\n"), r"invalid chat_template: message uses \{text\}"),
        (_template(roles={"user": "U", "system": "S"}),
         "invalid chat_template: roles has no speaker for 'assistant'"),
        (_template(stop=[""]), "invalid chat_template: stop strings must have 1 to 256 characters, got ''"),
        (lambda p: _rewrite_config(p, chat_template="chatml"),
         "invalid chat_template: must be a JSON object"),
    ],
    ids=["nested", "oversized", "version-bool", "dtype-list", "model-list", "tokenizer-string",
         "provenance-list", "name-int", "name-newline", "tokenizer-size", "tokenizer-kind",
         "vocab-types", "vocab-string", "vocab-duplicates", "tokenizer-nested", "template-placeholder",
         "template-role", "template-empty-stop", "template-string"],
)
def test_bad_manifest_values_are_rejected_by_name(ckpt_dir: Path, damage, message: str) -> None:  # type: ignore[no-untyped-def]
    damage(ckpt_dir)
    with pytest.raises(CheckpointError, match=message) as e:
        load_checkpoint(ckpt_dir)
    assert "\n" not in str(e.value)


def test_tokenizer_ids_beyond_its_vocabulary_are_refused(ckpt_dir: Path) -> None:
    from nanoserve.model.tokenizer import BPETokenizer

    bpe = BPETokenizer.train("hello world, hello there " * 20, 300).to_json()
    vocab = bpe["model"]["vocab"]
    vocab[max(vocab, key=vocab.get)] = 5000  # a gap: ids no longer run 0..vocab_size-1
    (ckpt_dir / "tokenizer.json").write_text(json.dumps(bpe))
    with pytest.raises(CheckpointError, match=r"tokenizer.json: cannot load tokenizer .*found id 5000"):
        load_checkpoint(ckpt_dir)


def test_an_absent_or_null_template_is_the_default_one(ckpt_dir: Path) -> None:
    from nanoserve.model.checkpoint import DEFAULT_CHAT_TEMPLATE

    _rewrite_config(ckpt_dir, chat_template=None)
    assert load_checkpoint(ckpt_dir).chat_template == DEFAULT_CHAT_TEMPLATE


def _rewrite_header(path: Path, edit: Callable[[dict], None]) -> None:  # type: ignore[type-arg]
    data = (path / "model.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    (path / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n :])


def _claim_huge_embedding(header: dict) -> None:  # type: ignore[type-arg]
    # Shape and offsets of a 4 TiB tensor in a file of a few hundred kB: nothing may allocate it.
    start = header["wte.weight"]["data_offsets"][0]
    header["wte.weight"].update(shape=[2**35, 32], data_offsets=[start, start + 2**42])


@pytest.mark.parametrize(
    "damage",
    [lambda p: (p / "model.safetensors").open("ab").write(b"\0" * 64),
     lambda p: _rewrite_header(p, _claim_huge_embedding)],
    ids=["trailing-bytes", "huge-declared-tensor"],
)
def test_a_file_whose_bytes_do_not_match_its_header_is_refused_before_reading(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch, damage
) -> None:  # type: ignore[no-untyped-def]
    damage(ckpt_dir)
    _refuse_reading_weights(monkeypatch)
    with pytest.raises(CheckpointError, match=r"model.safetensors: not a valid safetensors file"):
        load_checkpoint(ckpt_dir)


def test_a_template_that_loading_would_refuse_is_never_saved(tmp_path: Path) -> None:
    from nanoserve.model.chat_template import ChatTemplateError

    ckpt = load_checkpoint(make_tiny_checkpoint(tmp_path / "a"))
    bad = {"roles": {"user": "U", "assistant": "A"}, "message": "{role}: {content}",
           "generation_prompt": "{role}:"}
    with pytest.raises(ChatTemplateError, match="roles has no speaker for 'system'"):
        save_checkpoint(tmp_path / "b", ckpt.build_model(), ckpt.tokenizer, name="b", chat_template=bad)
    assert not (tmp_path / "b").exists()


def test_an_absent_or_null_name_is_the_directory_name(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _rewrite_config(ckpt_dir, name=None)
    assert load_checkpoint(ckpt_dir).name == "ckpt"
    monkeypatch.chdir(ckpt_dir)
    assert load_checkpoint(".").name == "ckpt"
