"""Conversion between our Llama-family checkpoints and Hugging Face `LlamaForCausalLM` directories.

The layouts differ in naming and in two fusions of ours: the attention's query, key and value
projections are one matrix (`c_attn`: queries, then keys, then values), and the SwiGLU MLP's gate
and up projections are one (`c_fc`: gate, then up). Both are plain concatenations along the output
dimension, so conversion is exact in either direction. nanoserve/model/hf.py reads and writes the files and
calls these for `model_type: llama`.
"""

from __future__ import annotations

from typing import Any

import torch

from nanoserve.model.config import GPTConfig

LLAMA_ARCH = "LlamaForCausalLM"


class LlamaConfigError(ValueError):
    """A Llama config.json field this decoder cannot represent (the message names it)."""


def config_from_llama(raw: dict[str, Any]) -> GPTConfig:
    """Our config for a Hugging Face Llama config.json (refusing what the module cannot hold)."""
    hidden = raw.get("hidden_size", 4096)
    heads = raw.get("num_attention_heads", 32)
    same_bias = raw.get("attention_bias", False) == raw.get("mlp_bias", False)
    head_dims: set[Any] = {None, hidden // heads if isinstance(heads, int) and heads else None}
    # transformers 5 writes rope_parameters {rope_theta, rope_type}; 4 wrote rope_theta and
    # rope_scaling (null for plain rotary positions).
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise LlamaConfigError(f"rope_parameters={rope!r} is not an object")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    refused: dict[str, tuple[Any, set[Any]]] = {
        "hidden_act": (raw.get("hidden_act", "silu"), {"silu"}),
        "rope_type": (rope_type, {"default"}),
        "pretraining_tp": (raw.get("pretraining_tp", 1), {1}),
        "attention_bias == mlp_bias": (same_bias, {True}),
        "head_dim": (raw.get("head_dim"), head_dims),
    }
    for key, (value, allowed) in refused.items():
        if value not in allowed:
            raise LlamaConfigError(f"{key}={value!r} is not supported by this decoder")
    return GPTConfig(
        vocab_size=raw.get("vocab_size", 32000),
        block_size=raw.get("max_position_embeddings", 2048),
        n_layer=raw.get("num_hidden_layers", 32),
        n_head=heads,
        n_embd=hidden,
        dropout=0.0,  # a training setting; the imported model is for inference
        bias=bool(raw.get("attention_bias", False)),
        layer_norm_epsilon=float(raw.get("rms_norm_eps", 1e-6)),
        norm="rmsnorm",
        mlp="swiglu",
        mlp_hidden=raw.get("intermediate_size", 11008),
        positions="rope",
        rope_theta=float(theta),
        n_kv_head=raw.get("num_key_value_heads", heads),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )


def llama_config(cfg: GPTConfig, dtype: str, eos: int | None, extra: dict[str, Any]) -> dict[str, Any]:
    """The config.json of a Hugging Face Llama directory for `cfg`."""
    return {
        "architectures": [LLAMA_ARCH],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.hidden,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.block_size,
        "rms_norm_eps": cfg.layer_norm_epsilon,
        "rope_theta": cfg.rope_theta,  # transformers 4
        "rope_scaling": None,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},  # transformers 5
        "hidden_act": "silu",
        "attention_bias": cfg.bias,
        "mlp_bias": cfg.bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "torch_dtype": dtype,
        **extra,
    }


def check_exportable(cfg: GPTConfig) -> None:
    """Llama's layout: RMSNorm, SwiGLU and rotary positions (any key/value head count, tied or not)."""
    if (cfg.norm, cfg.mlp, cfg.positions) != ("rmsnorm", "swiglu", "rope"):
        raise LlamaConfigError(
            f"a Llama directory needs rmsnorm, swiglu and rope; this checkpoint has {cfg.norm}, "
            f"{cfg.mlp} and {cfg.positions} positions"
        )


def to_llama_names(state: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """Our state dict -> LlamaForCausalLM's tensor names (the fused projections split)."""
    q, kv = cfg.n_embd, cfg.kv_heads * cfg.head_dim
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": state["wte.weight"],
                                    "model.norm.weight": state["ln_f.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(cfg.n_layer):
        ours, hf = f"h.{i}.", f"model.layers.{i}."
        out[hf + "input_layernorm.weight"] = state[ours + "ln_1.weight"]
        out[hf + "post_attention_layernorm.weight"] = state[ours + "ln_2.weight"]
        for kind in ("weight", "bias") if cfg.bias else ("weight",):
            qp, kp, vp = state[f"{ours}attn.c_attn.{kind}"].split([q, kv, kv])
            out[f"{hf}self_attn.q_proj.{kind}"], out[f"{hf}self_attn.k_proj.{kind}"] = qp, kp
            out[f"{hf}self_attn.v_proj.{kind}"] = vp
            out[f"{hf}self_attn.o_proj.{kind}"] = state[f"{ours}attn.c_proj.{kind}"]
            gate, up = state[f"{ours}mlp.c_fc.{kind}"].chunk(2)
            out[f"{hf}mlp.gate_proj.{kind}"], out[f"{hf}mlp.up_proj.{kind}"] = gate, up
            out[f"{hf}mlp.down_proj.{kind}"] = state[f"{ours}mlp.c_proj.{kind}"]
    return {k: v.contiguous() for k, v in out.items()}


def from_llama_names(hf: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM's tensors -> our names (the projections fused). A missing tensor raises
    KeyError naming it; the caller checks names and shapes against the config."""
    hf = {k: v for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq")}  # a buffer, not a weight
    out = {"wte.weight": hf.pop("model.embed_tokens.weight"), "ln_f.weight": hf.pop("model.norm.weight")}
    if "lm_head.weight" in hf:
        head = hf.pop("lm_head.weight")
        if not cfg.tie_embeddings:
            out["lm_head.weight"] = head
    for i in range(cfg.n_layer):
        ours, src = f"h.{i}.", f"model.layers.{i}."
        out[ours + "ln_1.weight"] = hf.pop(src + "input_layernorm.weight")
        out[ours + "ln_2.weight"] = hf.pop(src + "post_attention_layernorm.weight")
        for kind in ("weight", "bias") if cfg.bias else ("weight",):
            out[f"{ours}attn.c_attn.{kind}"] = torch.cat(
                [hf.pop(f"{src}self_attn.{p}_proj.{kind}") for p in ("q", "k", "v")])
            out[f"{ours}attn.c_proj.{kind}"] = hf.pop(f"{src}self_attn.o_proj.{kind}")
            out[f"{ours}mlp.c_fc.{kind}"] = torch.cat(
                [hf.pop(f"{src}mlp.{p}_proj.{kind}") for p in ("gate", "up")])
            out[f"{ours}mlp.c_proj.{kind}"] = hf.pop(f"{src}mlp.down_proj.{kind}")
    for name, t in hf.items():  # left over: reported as unexpected by the caller's name check
        out[name] = t
    return {k: v.contiguous() for k, v in out.items()}
