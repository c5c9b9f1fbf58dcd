"""Tokenizers: round trips, specific errors, serialisation, and GPT-2 parity with transformers."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanoserve.model.tokenizer import (
    EOT,
    BPETokenizer,
    CharTokenizer,
    TokenizerError,
    WordTokenizer,
    load_tokenizer,
    tokenizer_from_json,
    train_tokenizer,
)
from tests.conftest import require_module

GPT2_DIR = Path(__file__).parent.parent / "data" / "gpt2"
TEXT = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
    "All:\nSpeak, speak. Don't you know? (Yes!) 'Tis true.\n"
)
SAMPLES = ["Hello world", "a<|endoftext|>b", "  spaces\n\n tabs\t", "naïve café 東京 🙂", "I'm, don't",
           "", " leading", "trailing  ", "12345 + 67890 = 80235"]


def _round_trip(tok, tmp_path: Path):  # type: ignore[no-untyped-def]
    tok.save(tmp_path / "tok.json")
    return load_tokenizer(tmp_path / "tok.json")


def test_char_tokenizer_round_trips_and_names_unknown_characters(tmp_path: Path) -> None:
    tok = CharTokenizer.train(TEXT)
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert tok.vocab_size == len(set(TEXT)) and tok.eos_id is None
    assert _round_trip(tok, tmp_path).encode(TEXT) == tok.encode(TEXT)
    with pytest.raises(TokenizerError) as e:
        tok.encode("Speak €uro")
    assert "'€'" in str(e.value) and "U+20AC" in str(e.value) and "position 6" in str(e.value)


def test_char_vocabulary_may_hold_the_end_of_text_marker() -> None:
    tok = CharTokenizer(["a", "b", EOT])
    assert tok.eos_id == 2 and tok.is_special(2) and not tok.is_special(0)
    with pytest.raises(ValueError, match="duplicate"):
        CharTokenizer(["a", "a"])


def test_word_tokenizer(tmp_path: Path) -> None:
    corpus = f"Knock knock. Who's there?{EOT}Lettuce. Lettuce who? Lettuce in, it's cold!{EOT}"
    tok = WordTokenizer.train(corpus)
    ids = tok.encode(f"Knock knock.{EOT}Lettuce who?")
    assert ids.count(tok.eos_id) == 1  # type: ignore[arg-type]
    assert tok.decode(ids) == f"Knock knock. {EOT} Lettuce who?"
    # Spaces are re-inserted by rule, so encode(decode(ids)) is the stable round trip.
    text = "Lettuce in, it's cold!"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode("Who ' s there ?")) == "Who's there?"
    assert tok.encode(tok.decode(tok.encode(text))) == tok.encode(text)
    assert _round_trip(tok, tmp_path).encode(text) == tok.encode(text)
    with pytest.raises(TokenizerError, match=r"word 'banana' at position 6 is not in this model's"):
        tok.encode("Knock banana")


def test_bpe_train_round_trips_any_text(tmp_path: Path) -> None:
    tok = train_tokenizer("bpe:300", TEXT * 20)
    assert isinstance(tok, BPETokenizer) and tok.vocab_size == 300
    assert tok.eos_id is not None and tok.encode(EOT) == [tok.eos_id]
    # Byte-level: text never seen in training (CJK, emoji) still encodes and decodes exactly.
    for text in [*SAMPLES, TEXT]:
        assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("Speak, speak.")) < len("Speak, speak.")  # merges were learned
    loaded = _round_trip(tok, tmp_path)
    assert isinstance(loaded, BPETokenizer) and loaded.encode(TEXT) == tok.encode(TEXT)


@pytest.mark.parametrize("spec", ["bpe:12", "bpe:x", "bpe:", "sentencepiece", ""])
def test_bad_tokenizer_specs_are_rejected_by_name(spec: str) -> None:
    with pytest.raises(ValueError, match="--tokenizer"):
        train_tokenizer(spec, TEXT)


def test_unknown_tokenizer_kind_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown tokenizer kind 'morse'"):
        tokenizer_from_json({"kind": "morse", "vocab": []})


def test_gpt2_files_give_the_same_ids_as_transformers() -> None:
    require_module("transformers")
    from transformers import GPT2TokenizerFast  # type: ignore[attr-defined]  # lazy alias in v5

    ours = BPETokenizer.from_gpt2_files(GPT2_DIR / "vocab.json", GPT2_DIR / "merges.txt")
    theirs = GPT2TokenizerFast.from_pretrained(str(GPT2_DIR))
    assert ours.vocab_size == 50257 and ours.eos_id == 50256
    for text in [*SAMPLES, TEXT]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == text
    assert ours.id_to_piece(15496) == "Hello" and ours.is_special(50256)
