"""Conversion between our checkpoints and Hugging Face GPT-2 and Llama directories.

Export writes what `transformers.GPT2LMHeadModel.from_pretrained(OUT)` (or `LlamaForCausalLM`, for
a Llama-family checkpoint) loads (config.json + model.safetensors); import turns such a directory
(weights a user has on disk) into one of our checkpoints. Nothing is unpickled: `pytorch_model.bin`
directories are refused. The Llama mapping is nanoserve/model/hf_llama.py.

The two layouts differ only in naming and in one detail of GPT-2's code: its `Conv1D` layers store
weights as (in, out), the transpose of `nn.Linear`'s (out, in).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from nanoserve.model.chat_template import ChatTemplateError, validate_template
from nanoserve.model.checkpoint import (
    Checkpoint,
    expected_tensors,
    name_mismatch,
    read_json_object,
    save_checkpoint,
)
from nanoserve.model.config import GPTConfig
from nanoserve.model.hf_chat import HFChat, HFChatError, read_chat, write_chat
from nanoserve.model.hf_llama import (
    LlamaConfigError,
    check_exportable,
    config_from_llama,
    from_llama_names,
    llama_config,
    to_llama_names,
)
from nanoserve.model.tokenizer import BPETokenizer, Tokenizer, tokenizer_from_json

HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
HF_TOKENIZER = "tokenizer.json"
# Char/word vocabularies have no Hugging Face equivalent; export keeps ours beside the weights
# under a name no HF tool reads, so an exported directory imports back losslessly.
OUR_TOKENIZER = "nanoserve_tokenizer.json"
# GPT-2's Conv1D layers: their weights are stored transposed relative to nn.Linear.
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Non-persistent attention-mask buffers that old transformers versions saved with the weights.
_IGNORED = re.compile(r"^(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)$")
_PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.ckpt", "tf_model.h5")
# GPT-2's "gelu_new" is the tanh approximation our MLP uses; other activations are other models.
_GELU_TANH: set[Any] = {"gelu_new", "gelu_pytorch_tanh", "gelu_fast"}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class HFConversionError(ValueError):
    """A directory or checkpoint that cannot be converted; the message names the file and why."""


# ----------------------------------------------------------------------------------- export


def export_hf(ckpt: Checkpoint, out_dir: str | Path) -> Path:
    """Write `ckpt` as a Hugging Face GPT-2 directory; returns its path."""
    out = Path(out_dir)
    cfg = ckpt.config
    if cfg.family == "llama":
        return _export_llama(ckpt, out)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in ckpt.state_dict.items():
        if any(name.endswith(s) for s in _CONV1D):
            t = t.t()
        tensors[f"transformer.{name}"] = t.contiguous()
    if not cfg.bias:
        # HF GPT-2 always has biases; zeros are exactly "no bias" (LayerNorm and Linear alike).
        for name, shape in _bias_shapes(cfg).items():
            tensors[f"transformer.{name}"] = torch.zeros(shape, dtype=_torch_dtype(ckpt.dtype))
    eos = ckpt.tokenizer.eos_id
    hf_config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,
        "activation_function": "gelu_new",
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "layer_norm_epsilon": cfg.layer_norm_epsilon,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "dtype": ckpt.dtype,
        "nanoserve": {"name": ckpt.name, "tokenizer_kind": ckpt.tokenizer.kind},
    }
    save_file(tensors, str(out / HF_WEIGHTS), metadata={"format": "pt"})
    (out / HF_CONFIG).write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")
    _export_tokenizer(ckpt.tokenizer, out)
    write_chat(out, ckpt.chat_template, list(ckpt.end_token_ids))
    return out


def _export_llama(ckpt: Checkpoint, out: Path) -> Path:
    try:
        check_exportable(ckpt.config)
    except LlamaConfigError as e:
        raise HFConversionError(f"{ckpt.name}: {e}") from None
    out.mkdir(parents=True, exist_ok=True)
    extra = {"nanoserve": {"name": ckpt.name, "tokenizer_kind": ckpt.tokenizer.kind}}
    hf_config = llama_config(ckpt.config, ckpt.dtype, ckpt.tokenizer.eos_id, extra)
    save_file(to_llama_names(ckpt.state_dict, ckpt.config), str(out / HF_WEIGHTS), metadata={"format": "pt"})
    (out / HF_CONFIG).write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")
    _export_tokenizer(ckpt.tokenizer, out)
    write_chat(out, ckpt.chat_template, list(ckpt.end_token_ids))
    return out


def _bias_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The bias tensors a bias-free config lacks, named as in our state dict."""
    full = expected_tensors(GPTConfig(**{**cfg.to_dict(), "bias": True}))
    have = expected_tensors(cfg)
    return {name: shape for name, (shape, _) in full.items() if name not in have}


def _export_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    if isinstance(tokenizer, BPETokenizer):
        # Our BPE format *is* the `tokenizers` library's, which transformers reads directly.
        tokenizer.save(out / HF_TOKENIZER)
        special = tokenizer.id_to_piece(tokenizer.eos_id) if tokenizer.eos_id is not None else None
        tok_config: dict[str, Any] = {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False,
                                      "model_max_length": None}
        if special is not None:
            tok_config.update(bos_token=special, eos_token=special, unk_token=special)
        (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n",
                                                   encoding="utf-8")
    else:
        tokenizer.save(out / OUR_TOKENIZER)


# ----------------------------------------------------------------------------------- import


def import_hf(
    hf_dir: str | Path, out_dir: str | Path, *, name: str | None = None, dtype: str | None = None
) -> Path:
    """Convert a Hugging Face GPT-2 or Llama directory into a checkpoint at `out_dir`; returns its
    path. Its chat template, special tokens and end tokens come along (nanoserve/model/hf_chat.py).

    `dtype` (float32 | bfloat16 | float16) casts the weights; by default they keep the source's
    dtype when all tensors share a supported one, and become float32 otherwise.
    """
    src = Path(hf_dir)
    if not src.is_dir():
        raise HFConversionError(f"{src}: not a directory")
    config = _read_hf_config(src)
    tokenizer = _read_hf_tokenizer(src)
    chat = _read_chat(src, tokenizer)
    hf_tensors, weights_desc = _read_hf_weights(src)
    state_dict = _to_our_names(hf_tensors, config, weights_desc)
    dtypes = {t.dtype for t in state_dict.values()}
    if dtype is None:
        dtype = _DTYPE_NAMES.get(dtypes.pop(), "float32") if len(dtypes) == 1 else "float32"
    if dtype not in _DTYPE_NAMES.values():
        raise HFConversionError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if tokenizer.vocab_size > config.vocab_size:
        raise HFConversionError(
            f"{src}: the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size "
            f"is {config.vocab_size}"
        )
    target = _torch_dtype(dtype)
    state_dict = {k: v.to(target) for k, v in state_dict.items()}
    ckpt = Checkpoint(config=config, tokenizer=tokenizer, state_dict=state_dict,
                      name=name or src.resolve().name, dtype=dtype, end_token_ids=tuple(chat.end_token_ids))
    provenance = {
        "imported_from": str(src.resolve()),
        "source_format": f"huggingface-{config.family}",
        "source_weights": weights_desc,
        "source_weights_sha256": _sha256_of_weights(src),
    }
    model = ckpt.build_model("cpu")
    card = _import_card(ckpt.name, provenance, config)
    return save_checkpoint(out_dir, model, tokenizer, name=ckpt.name, provenance=provenance, card=card,
                           chat_template=chat.template, end_token_ids=chat.end_token_ids)


def _read_chat(src: Path, tokenizer: Tokenizer) -> HFChat:
    """The directory's chat template (checked as loading will check it) and end tokens."""
    try:
        chat = read_chat(src, read_json_object(src / HF_CONFIG, HFConversionError), tokenizer)
        if chat.template is not None:
            validate_template(chat.template)
    except HFChatError as e:
        raise HFConversionError(str(e)) from None
    except ChatTemplateError as e:
        raise HFConversionError(f"{src}: its chat template cannot be served: {e}") from None
    return chat


def _read_hf_config(src: Path) -> GPTConfig:
    path = src / HF_CONFIG
    if not path.is_file():
        raise HFConversionError(f"{path}: missing (a Hugging Face model directory needs {HF_CONFIG})")
    raw = read_json_object(path, HFConversionError)
    model_type = raw.get("model_type")
    if model_type == "llama":
        try:
            return config_from_llama(raw)
        except (TypeError, ValueError) as e:
            raise HFConversionError(f"{path}: {e}") from None
    if model_type != "gpt2":
        raise HFConversionError(f"{path}: model_type is {model_type!r}; 'gpt2' and 'llama' can be imported")
    supported: dict[str, tuple[Any, set[Any]]] = {
        "activation_function": (raw.get("activation_function", "gelu_new"), _GELU_TANH),
        "scale_attn_weights": (raw.get("scale_attn_weights", True), {True}),
        "scale_attn_by_inverse_layer_idx": (raw.get("scale_attn_by_inverse_layer_idx", False), {False}),
        "add_cross_attention": (raw.get("add_cross_attention", False), {False}),
    }
    for key, (value, allowed) in supported.items():
        if value not in allowed:
            raise HFConversionError(f"{path}: {key}={value!r} is not supported by this GPT")
    n_embd = raw.get("n_embd", 768)
    n_inner = raw.get("n_inner")
    if n_inner not in (None, 4 * n_embd if isinstance(n_embd, int) else None):
        raise HFConversionError(f"{path}: n_inner={n_inner!r}; only 4 * n_embd is supported")
    try:
        return GPTConfig(
            vocab_size=raw.get("vocab_size", 50257),
            block_size=raw.get("n_positions") or raw.get("n_ctx") or 1024,
            n_layer=raw.get("n_layer", 12),
            n_head=raw.get("n_head", 12),
            n_embd=n_embd,
            dropout=0.0,  # dropout is a training setting; the imported model is for inference
            bias=True,
            layer_norm_epsilon=float(raw.get("layer_norm_epsilon", 1e-5)),
        )
    except (TypeError, ValueError) as e:
        raise HFConversionError(f"{path}: {e}") from None


def _read_hf_tokenizer(src: Path) -> Tokenizer:
    """tokenizer.json (the `tokenizers` format), or GPT-2's vocab.json + merges.txt."""
    for fname in (OUR_TOKENIZER, HF_TOKENIZER):
        path = src / fname
        if path.is_file():
            try:
                return tokenizer_from_json(json.loads(path.read_text(encoding="utf-8")))
            except Exception as e:  # the tokenizers library raises bare Exception
                raise HFConversionError(f"{path}: cannot load tokenizer ({e})") from None
    vocab, merges = src / "vocab.json", src / "merges.txt"
    if vocab.is_file() and merges.is_file():
        try:
            return BPETokenizer.from_gpt2_files(vocab, merges)
        except Exception as e:
            raise HFConversionError(f"{vocab}, {merges}: cannot load GPT-2 tokenizer ({e})") from None
    raise HFConversionError(
        f"{src}: no tokenizer found (need {HF_TOKENIZER}, or vocab.json and merges.txt)"
    )


def _read_hf_weights(src: Path) -> tuple[dict[str, torch.Tensor], str]:
    single, index = src / HF_WEIGHTS, src / HF_INDEX
    if single.is_file():
        return _load_safetensors(single), str(single)
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise HFConversionError(f"{index}: not a valid safetensors index ({e})") from None
        tensors: dict[str, torch.Tensor] = {}
        for shard in shards:
            if Path(shard).name != shard:
                raise HFConversionError(f"{index}: shard name {shard!r} must be a plain file name")
            tensors.update(_load_safetensors(src / shard))
        return tensors, f"{index} ({len(shards)} shards)"
    pickles = [p for p in _PICKLES if (src / p).exists()]
    hint = f"; found {', '.join(pickles)}, which is never loaded (pickle/other format): " \
           "convert it to safetensors first" if pickles else ""
    raise HFConversionError(f"{single}: missing{hint}")


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise HFConversionError(f"{path}: missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise HFConversionError(f"{path}: not a valid safetensors file ({e})") from None


def _to_our_names(
    hf: dict[str, torch.Tensor], config: GPTConfig, source: str
) -> dict[str, torch.Tensor]:
    """Rename (and un-transpose) HF tensors; every name, shape and the tie are checked."""
    if config.family == "llama":
        return _check_names_and_shapes(_from_llama(hf, config, source), config, source)
    ours: dict[str, torch.Tensor] = {}
    lm_head = None
    for hf_name, t in hf.items():
        if _IGNORED.match(hf_name):
            continue
        if hf_name == "lm_head.weight":
            lm_head = t
            continue
        name = hf_name.removeprefix("transformer.")
        if any(name.endswith(s) for s in _CONV1D) and t.dim() == 2:
            t = t.t()
        ours[name] = t.contiguous()
    _check_names_and_shapes(ours, config, source, transposed=lambda n: any(n.endswith(s) for s in _CONV1D))
    if lm_head is not None and not torch.equal(lm_head, ours["wte.weight"]):
        # Only tied output embeddings exist in this GPT.
        raise HFConversionError(
            f"{source}: lm_head.weight differs from wte.weight (untied output embeddings are not supported)"
        )
    return ours


def _from_llama(hf: dict[str, torch.Tensor], config: GPTConfig, source: str) -> dict[str, torch.Tensor]:
    try:
        return from_llama_names(hf, config)
    except KeyError as e:
        raise HFConversionError(f"{source}: missing tensor {e.args[0]}") from None
    except RuntimeError as e:  # torch.cat of mismatched q/k/v or gate/up shapes
        raise HFConversionError(f"{source}: projections of inconsistent shapes ({e})") from None


def _check_names_and_shapes(ours: dict[str, torch.Tensor], config: GPTConfig, source: str,
                            transposed: Callable[[str], bool] = lambda name: False
                            ) -> dict[str, torch.Tensor]:
    """Every name the config implies, no other, each of its shape; `transposed(name)`: the HF file
    stores that tensor transposed (GPT-2's Conv1D), so its shapes are reported as stored."""
    expected = expected_tensors(config)
    problem = name_mismatch(expected, ours)
    if problem:
        raise HFConversionError(f"{source}: {problem}")
    for name, (shape, _) in expected.items():
        if tuple(ours[name].shape) != shape:
            got, want = list(ours[name].shape), list(shape)
            if transposed(name):
                got, want = got[::-1], want[::-1]
            raise HFConversionError(f"{source}: tensor {name} has shape {got}, config.json implies {want}")
    return ours


def _sha256_of_weights(src: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(src.glob("*.safetensors")):
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _torch_dtype(name: str) -> torch.dtype:
    return {v: k for k, v in _DTYPE_NAMES.items()}[name]


def _import_card(name: str, provenance: dict[str, Any], config: GPTConfig) -> str:
    return "\n".join([
        f"# {name}",
        "",
        f"{'Llama-family' if config.family == 'llama' else 'GPT-2'} weights imported from a Hugging Face "
        "directory by `nanoserve import-hf`.",
        "",
        f"- source: `{provenance['source_weights']}` (sha256 `{provenance['source_weights_sha256']}`)",
        f"- layers {config.n_layer}, heads {config.n_head}, width {config.n_embd}, "
        f"context {config.block_size}, vocabulary {config.vocab_size}",
        "",
        "Licence and training data are those of the source model.",
        "",
    ])
