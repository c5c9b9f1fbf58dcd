"""Hugging Face GPT-2 export/import: logits parity with transformers, and clear refusals."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoserve.cli import main
from nanoserve.model.checkpoint import load_checkpoint, save_checkpoint
from nanoserve.model.config import GPTConfig
from nanoserve.model.gpt import GPT
from nanoserve.model.hf import export_hf
from nanoserve.model.tokenizer import CharTokenizer, Tokenizer, train_tokenizer
from tests.conftest import require_module

GPT2_DIR = Path(__file__).parent.parent / "data" / "gpt2"
TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune "


@pytest.fixture(scope="module")
def hf() -> Any:
    require_module("transformers")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Every tensor random and O(0.1): default inits leave biases and LayerNorms at 0/1, so a
    misplaced bias or a missed transpose would go unnoticed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if p.dim() == 1 else 0.0))


def _assert_parity(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert theirs.std() > 0.1, "logits too small for the comparison to mean anything"
    assert (ours - theirs).abs().max() < 1e-4


def _our_checkpoint(path: Path, tok: Tokenizer, *, bias: bool = True) -> Path:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=48, n_layer=2, n_head=4, n_embd=32,
                          bias=bias))
    _randomise(model, 1)
    return save_checkpoint(path, model, tok, name="ours")


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_exported_directory_loads_in_transformers_with_the_same_logits(
    hf: Any, tmp_path: Path, bias: bool
) -> None:
    tok = CharTokenizer.train(TEXT)
    ckpt = load_checkpoint(_our_checkpoint(tmp_path / "ckpt", tok, bias=bias))
    assert main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    theirs = hf.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    idx = torch.randint(0, tok.vocab_size, (2, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _assert_parity(ckpt.build_model()(idx), theirs(idx).logits)


def test_exported_bpe_tokenizer_loads_in_transformers(hf: Any, tmp_path: Path) -> None:
    tok = train_tokenizer("bpe:300", TEXT * 10)
    export_hf(load_checkpoint(_our_checkpoint(tmp_path / "ckpt", tok)), tmp_path / "hf")
    theirs = hf.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = TEXT + "<|endoftext|> naïve 🙂"
    assert theirs.encode(text) == tok.encode(text)
    assert theirs.eos_token_id == tok.eos_id


def test_export_then_import_is_lossless_for_a_char_checkpoint(tmp_path: Path) -> None:
    tok = CharTokenizer.train(TEXT)
    src = load_checkpoint(_our_checkpoint(tmp_path / "ckpt", tok))
    export_hf(src, tmp_path / "hf")
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    back = load_checkpoint(tmp_path / "back")
    assert back.tokenizer.kind == "char" and back.tokenizer.encode(TEXT) == tok.encode(TEXT)
    assert back.config == src.config
    for name, t in src.state_dict.items():
        assert torch.equal(back.state_dict[name], t), name


def _hf_directory(hf: Any, path: Path, vocab_size: int, **save: Any) -> Any:
    """A random small GPT-2 saved by transformers itself, as users' directories are."""
    torch.manual_seed(0)
    cfg = hf.GPT2Config(vocab_size=vocab_size, n_positions=48, n_embd=32, n_layer=2, n_head=4)
    model = hf.GPT2LMHeadModel(cfg).eval()
    _randomise(model, 3)
    model.save_pretrained(str(path), safe_serialization=True, **save)
    return model


def _check_imported(theirs: Any, ckpt_dir: Path, vocab_size: int) -> None:
    ckpt = load_checkpoint(ckpt_dir)
    assert ckpt.provenance["source_format"] == "huggingface-gpt2"
    idx = torch.randint(0, vocab_size, (2, 48), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _assert_parity(ckpt.build_model()(idx), theirs(idx).logits)


def test_import_gpt2_directory_with_vocab_and_merges(hf: Any, tmp_path: Path) -> None:
    theirs = _hf_directory(hf, tmp_path / "hf", 50257)
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(GPT2_DIR / name, tmp_path / "hf" / name)
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt"), "--name", "g"]) == 0
    _check_imported(theirs, tmp_path / "ckpt", 50257)
    ckpt = load_checkpoint(tmp_path / "ckpt")
    assert ckpt.name == "g" and ckpt.tokenizer.encode("Hello world") == [15496, 995]


def test_import_gpt2_directory_with_tokenizer_json(hf: Any, tmp_path: Path) -> None:
    tok = train_tokenizer("bpe:300", TEXT * 10)
    theirs = _hf_directory(hf, tmp_path / "hf", 300)
    tok.save(tmp_path / "hf" / "tokenizer.json")
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt"), "--dtype", "bfloat16"]) == 0
    ckpt = load_checkpoint(tmp_path / "ckpt")
    assert ckpt.dtype == "bfloat16" and ckpt.tokenizer.encode(TEXT) == tok.encode(TEXT)
    main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "fp32")])
    _check_imported(theirs, tmp_path / "fp32", 300)


def test_import_sharded_gpt2_directory(hf: Any, tmp_path: Path) -> None:
    theirs = _hf_directory(hf, tmp_path / "hf", 300, max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    train_tokenizer("bpe:300", TEXT * 10).save(tmp_path / "hf" / "tokenizer.json")
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    _check_imported(theirs, tmp_path / "ckpt", 300)


def _forbid_unpickling(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("something was unpickled")

    for target, attr in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(target, attr, boom)


def _pickle_only(d: Path) -> None:
    torch.save(load_file(str(d / "model.safetensors")), d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()


def _edit_weights(d: Path, name: str, value: torch.Tensor | None) -> None:
    tensors = load_file(str(d / "model.safetensors"))
    if value is None:
        del tensors[name]
    else:
        tensors[name] = value
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})


def _edit_config(d: Path, **changes: Any) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


BAD_HF_DIRS = {
    "no-tokenizer": (lambda d: (d / "tokenizer.json").unlink(),
                     "no tokenizer found (need tokenizer.json, or vocab.json and merges.txt)"),
    "pickle": (_pickle_only, "found pytorch_model.bin, which is never loaded"),
    "not-gpt2": (lambda d: _edit_config(d, model_type="mistral"),
                 "model_type is 'mistral'; 'gpt2' and 'llama'"),
    "activation": (lambda d: _edit_config(d, activation_function="relu"),
                   "activation_function='relu' is not supported"),
    "missing": (lambda d: _edit_weights(d, "transformer.h.1.mlp.c_fc.bias", None),
                "missing tensor(s): h.1.mlp.c_fc.bias"),
    "shape": (lambda d: _edit_weights(d, "transformer.h.0.attn.c_attn.weight", torch.zeros(96, 32)),
              "tensor h.0.attn.c_attn.weight has shape [96, 32], config.json implies [32, 96]"),
    "untied": (lambda d: _edit_weights(d, "lm_head.weight", torch.zeros(300, 32)),
               "lm_head.weight differs from wte.weight"),
    "corrupt": (lambda d: (d / "model.safetensors").write_bytes(b"\x00\x01garbage"),
                "model.safetensors: not a valid safetensors file"),
}


@pytest.fixture(scope="module")
def good_hf_dir(hf: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "good"
    _hf_directory(hf, path, 300)
    train_tokenizer("bpe:300", TEXT * 10).save(path / "tokenizer.json")
    return path


@pytest.mark.parametrize("case", sorted(BAD_HF_DIRS))
def test_bad_hf_directories_are_refused_with_one_clear_line(
    good_hf_dir: Path, tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    src = Path(shutil.copytree(good_hf_dir, tmp_path / "src"))
    damage, message = BAD_HF_DIRS[case]
    damage(src)
    _forbid_unpickling(monkeypatch)
    capsys.readouterr()
    assert main(["import-hf", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("nanoserve import-hf: error: "), err
    assert message in err
    assert not (tmp_path / "out" / "config.json").exists()


def test_export_refuses_a_bad_checkpoint_and_an_occupied_output(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["export-hf", str(tmp_path / "nowhere"), str(tmp_path / "a")]) == 2
    assert "checkpoint directory not found" in capsys.readouterr().err
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "keep.txt").write_text("x")
    assert main(["export-hf", str(tiny_checkpoint), str(tmp_path / "b")]) == 2
    assert "already exists and is not an empty directory" in capsys.readouterr().err
    assert main(["export-hf", str(tiny_checkpoint), str(tmp_path / "c")]) == 0
