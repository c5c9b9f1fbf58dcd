"""A tiny Llama-family model saved by transformers with a ChatML template and <|im_end|> as its end
token, as a user's Hugging Face directory holds one.

Its weights make the reply known in advance: with every attention and MLP output projection zero,
the residual stream is the current token's embedding alone, so the next token is a function of the
last one. The prompt's last token leads to "a", "a" to "b" and "b" to <|im_end|>: the model says
"ab" and ends its turn; everything else is random.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TEMPLATES = Path(__file__).parent.parent / "data" / "chat_templates"
TEMPLATE = (TEMPLATES / "smollm2.jinja").read_text(encoding="utf-8")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = "You are a helpful assistant. Say hello. Hello! How are you today? I am fine, thanks. " * 4
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
REPLY = "ab"


@dataclass
class ChatMLLlama:
    path: Path
    tokenizer: Any  # transformers' PreTrainedTokenizerFast
    model: Any  # transformers' LlamaForCausalLM
    im_end: int
    endoftext: int


def byte_level_bpe(special_tokens: list[str], corpus: str, vocab_size: int) -> Any:
    """A small `tokenizers` byte-level BPE with `special_tokens` added (as single ids, first)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([corpus], trainer=trainer)
    return backend


def save_chatml_llama(path: Path) -> ChatMLLlama:
    import transformers

    backend = byte_level_bpe(SPECIALS, CORPUS, 300)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>",
                                               eos_token="<|im_end|>", pad_token="<|im_end|>",
                                               unk_token="<|endoftext|>")
    tok.chat_template = TEMPLATE
    im_end, endoftext = _id(backend, "<|im_end|>"), _id(backend, "<|endoftext|>")
    config = transformers.LlamaConfig(
        vocab_size=backend.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=backend.token_to_id("<|im_start|>"), eos_token_id=im_end, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    assert isinstance(prompt, list) and isinstance(prompt[-1], int)
    chain = [prompt[-1], *(_id(backend, c) for c in REPLY), im_end]
    _next_token_chain(model, chain)
    model.generation_config.eos_token_id = [im_end, endoftext]
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return ChatMLLlama(path, tok, model, im_end, endoftext)


def _id(backend: Any, token: str) -> int:
    found = backend.token_to_id(token)
    assert isinstance(found, int), token
    return found


def _next_token_chain(model: Any, chain: list[int]) -> None:
    """Make chain[i] be followed by chain[i + 1] (each link's embedding a basis vector its
    successor's output row reads)."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        for k, (token, successor) in enumerate(itertools.pairwise(chain)):
            emb[token] = 0.0
            emb[token, k] = 1.0
            head[successor, k] = 10.0
