"""The Llama family as a configuration of the one decoder: RMSNorm, SwiGLU, rotary positions,
grouped-query attention and untied output, against transformers' LlamaForCausalLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nanoserve.model.checkpoint import load_checkpoint, save_checkpoint
from nanoserve.model.config import GPTConfig
from nanoserve.model.gpt import GPT
from nanoserve.model.hf import HFConversionError, export_hf, import_hf
from nanoserve.model.reference import reference_generate
from nanoserve.model.tokenizer import BPETokenizer, CharTokenizer

LLAMA = {"norm": "rmsnorm", "mlp": "swiglu", "positions": "rope", "bias": False}


def tiny_llama(vocab: int = 40, **over: object) -> GPTConfig:
    fields = {"vocab_size": vocab, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 32,
              "n_kv_head": 2, "tie_embeddings": False, **LLAMA, **over}
    return GPTConfig(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("fields", "problem"), [
    ({"n_kv_head": 3}, "multiple of n_kv_head"),
    ({"norm": "batchnorm"}, "norm must be one of"),
    ({"mlp": "relu"}, "mlp must be one of"),
    ({"positions": "alibi"}, "positions must be one of"),
    ({"n_embd": 36, "n_head": 4, "n_kv_head": 4}, "even head size"),  # head size 9 cannot rotate
    ({"rope_theta": float("nan")}, "rope_theta"),
    ({"tie_embeddings": "no"}, "tie_embeddings must be true or false"),
    ({"mlp_hidden": 0}, "mlp_hidden"),
    ({"n_kv_head": True}, "n_kv_head"),
])
def test_every_invalid_combination_is_refused_naming_it(fields: dict[str, object], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        tiny_llama(**fields)


def test_a_gpt2_config_is_written_as_before() -> None:
    # GPT-2 checkpoints keep their config.json: the family fields appear only where they differ.
    gpt2 = GPTConfig(vocab_size=50, n_layer=2, n_head=2, n_embd=16)
    assert gpt2.family == "gpt2" and set(gpt2.to_dict()) == {
        "vocab_size", "block_size", "n_layer", "n_head", "n_embd", "dropout", "bias", "layer_norm_epsilon"}
    llama = tiny_llama()
    assert llama.family == "llama" and GPTConfig.from_dict(llama.to_dict()) == llama
    assert llama.hidden == 128  # 8/3 x 32, rounded up to a multiple of 64


def test_the_cache_holds_the_key_value_heads_and_cached_equals_uncached() -> None:
    torch.manual_seed(0)
    model = GPT(tiny_llama()).eval()
    cache = model.new_cache(2)
    assert cache.layers[0].k.shape == (2, 2, 32, 8)  # n_kv_head 2, not n_head 4: GQA's saving
    x = torch.randint(0, 40, (2, 20))
    with torch.no_grad():
        full = model(x)
        pieces = [model(x[:, a:b], input_pos=torch.arange(a, b).expand(2, b - a), cache=cache,
                        slots=torch.arange(2)) for a, b in ((0, 7), (7, 8), (8, 20))]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)


def test_a_future_token_never_changes_past_logits() -> None:
    torch.manual_seed(1)
    model = GPT(tiny_llama()).eval()
    x = torch.randint(0, 40, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 40
    with torch.no_grad():
        torch.testing.assert_close(model(x)[:, :10], model(y)[:, :10])


def test_an_untied_llama_checkpoint_round_trips(tmp_path: Path) -> None:
    torch.manual_seed(2)
    tok = CharTokenizer.train("abcdefghijklmnopqrstuvwxyz\n")
    model = GPT(tiny_llama(vocab=tok.vocab_size)).eval()
    ckpt = load_checkpoint(save_checkpoint(tmp_path / "c", model, tok, name="llama-tiny"))
    assert ckpt.config == model.config
    back = ckpt.build_model()
    assert back.lm_head.weight is not back.wte.weight
    x = torch.randint(0, tok.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(back(x), model(x))


def _hf_llama(tmp: Path, tok: BPETokenizer, **shape: int | bool) -> tuple[torch.nn.Module, Path]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=tok.vocab_size, max_position_embeddings=64, rms_norm_eps=1e-5,
                         rope_theta=50000.0, **shape)
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp / "hf", safe_serialization=True)
    tok.save(tmp / "hf" / "tokenizer.json")
    return hf, tmp / "hf"


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    return BPETokenizer.train("the quick brown fox jumps over the lazy dog, again and again. " * 40, 300)


def test_import_and_export_match_transformers(tmp_path: Path, bpe: BPETokenizer) -> None:
    hf, src = _hf_llama(tmp_path, bpe, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    ckpt = load_checkpoint(import_hf(src, tmp_path / "ours"))
    assert (ckpt.config.n_kv_head, ckpt.config.rope_theta, ckpt.config.tie_embeddings) == (2, 50000.0, False)
    ours = ckpt.build_model()
    x = torch.randint(0, bpe.vocab_size, (3, 17))
    with torch.no_grad():
        want = hf(x).logits
        torch.testing.assert_close(ours(x), want, rtol=0, atol=1e-4)
    from transformers import LlamaForCausalLM

    again = LlamaForCausalLM.from_pretrained(export_hf(ckpt, tmp_path / "back")).eval()
    with torch.no_grad():
        assert torch.equal(again(x).logits, want)


def test_import_refuses_what_the_decoder_cannot_hold(tmp_path: Path, bpe: BPETokenizer) -> None:
    _, src = _hf_llama(tmp_path, bpe, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1)
    config = json.loads((src / "config.json").read_text())
    yarn = {"rope_type": "yarn", "factor": 4.0}
    for key, value, problem in (("hidden_act", "gelu", "hidden_act='gelu'"),
                                ("rope_parameters", yarn, "rope_type='yarn'")):
        (src / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(HFConversionError, match=problem):
            import_hf(src, tmp_path / f"out-{key}")


@pytest.mark.slow
def test_a_smollm2_135m_shape_imports_with_transformers_logits_and_greedy_tokens(
    tmp_path: Path,
) -> None:
    # SmolLM2-135M's shape with random weights (no hub here): 30 layers, width 576, 9 heads, 3
    # key/value heads, MLP 1536, tied embeddings; GPT-2's vocabulary as the tokenizer.
    data = Path(__file__).resolve().parents[1] / "data" / "gpt2"
    tok = BPETokenizer.from_gpt2_files(data / "vocab.json", data / "merges.txt")
    hf, src = _hf_llama(tmp_path, tok, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                        num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    ckpt = load_checkpoint(import_hf(src, tmp_path / "ours"))
    ours = ckpt.build_model()
    prompt = tok.encode("The quick brown fox")
    x = torch.tensor([prompt])
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, rtol=0, atol=1e-4)
        want = hf.generate(x, max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    assert reference_generate(ours, prompt, 12, policy="shift") == want
