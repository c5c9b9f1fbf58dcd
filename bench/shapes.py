"""The benchmarks' models: the issue's GPT-2-architecture shapes and a Llama-family one with random
weights, their dtypes, and the prompts every peer is given."""

from __future__ import annotations

from typing import Any

import torch

from nanoserve.model.checkpoint import Checkpoint
from nanoserve.model.config import GPTConfig
from nanoserve.model.gpt import GPT
from nanoserve.model.tokenizer import CharTokenizer, WordTokenizer

SHAPES: dict[str, GPTConfig] = {
    # nanoGPT's shakespeare_char model (10.7M parameters) and GPT-2 small (124M).
    "10.7M": GPTConfig(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384),
    "124M": GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    # SmolLM2-135M's shape, the Llama family: 30 layers of width 576, 9 query and 3 key/value
    # heads, a SwiGLU MLP of 1536, rotary positions, RMSNorm, no biases, tied embeddings.
    "135M": GPTConfig(vocab_size=49152, block_size=8192, n_layer=30, n_head=9, n_embd=576, bias=False,
                      norm="rmsnorm", mlp="swiglu", mlp_hidden=1536, positions="rope", rope_theta=100000.0,
                      n_kv_head=3),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def random_model(shape: str, dtype: str = "float32") -> tuple[GPT, Any]:
    """One of the issue's shapes with random weights (seed 0), and a tokenizer every id of its
    vocabulary decodes with."""
    cfg = SHAPES[shape]
    if cfg.vocab_size <= 256:
        tok: Any = CharTokenizer([chr(32 + i) for i in range(cfg.vocab_size)])
    else:  # a synthetic word vocabulary of GPT-2's size: every id decodes
        tok = WordTokenizer([f"w{i}" for i in range(cfg.vocab_size - 1)])
    torch.manual_seed(0)
    return GPT(cfg).to(DTYPES[dtype]), tok


def make_checkpoint(shape: str, dtype: str) -> Checkpoint:
    model, tok = random_model(shape, dtype)
    cfg = model.config
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    return Checkpoint(config=cfg, tokenizer=tok, state_dict=state, name=f"random-{shape}", dtype=dtype)


def prompts_for(ckpt: Checkpoint, n: int, length: int) -> list[list[int]]:
    return random_prompts(ckpt.tokenizer.vocab_size, n, length)


def random_prompts(vocab: int, n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]
