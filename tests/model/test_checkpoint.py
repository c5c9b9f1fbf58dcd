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

from model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from model.config import GPTConfig
from model.gpt import GPT
from model.tokenizer import CharTokenizer
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
    template = {"roles": {"user": "A", "assistant": "B"}, "message": "{role}: {content}\n",
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
