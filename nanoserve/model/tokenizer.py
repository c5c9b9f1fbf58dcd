"""Tokenizers behind one interface: character-level, word-level and byte-level BPE.

Every tokenizer serialises to one JSON document (`tokenizer.json` in a checkpoint). Character and
word vocabularies use a small format of ours (`{"kind": ..., "vocab": [...]}`); byte-level BPE is
the `tokenizers` library's own format, so files made by Hugging Face tools load unchanged.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections import Counter
from functools import cached_property
from pathlib import Path
from typing import Any

EOT = "<|endoftext|>"
_WORD_RE = re.compile(r"\w+|[^\w\s]")
# Word-level decoding re-inserts the spaces the regex dropped, except around these characters.
_NO_SPACE_BEFORE = set(".,!?;:')]}\"")
_NO_SPACE_AFTER = set("'([{\"")


class TokenizerError(ValueError):
    """Text that this tokenizer cannot represent; the message names what and where."""


class Tokenizer(ABC):
    kind: str
    # Set where decode(ids) is always the concatenation of pieces[i] (a token's text never depends
    # on its neighbours: character vocabularies), so a stream can emit each token's text as it is.
    pieces: tuple[str, ...] | None = None
    # Tokens besides eos_id that end a generation (a checkpoint's end_token_ids: a chat model's
    # end-of-turn token, generation_config.json's eos_token_id list); set by Checkpoint.
    end_ids: frozenset[int] = frozenset()

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def eos_id(self) -> int | None:
        """Id of the end-of-text token, or None when the vocabulary has none."""

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: list[int]) -> str: ...

    @abstractmethod
    def to_json(self) -> dict[str, Any]: ...

    def id_to_piece(self, token_id: int) -> str:
        """The text of one token on its own (for logprob listings and /tokenize)."""
        return self.decode([token_id])

    @cached_property
    def max_piece_chars(self) -> int:
        """The most characters one token can stand for: a text of n characters encodes to at least
        ceil(n / max_piece_chars) tokens, which lets a server refuse an over-long prompt before
        paying for its encoding."""
        return max((len(self.id_to_piece(i)) for i in range(self.vocab_size)), default=1) or 1

    def is_special(self, token_id: int) -> bool:
        return token_id == self.eos_id or token_id in self.end_ids

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), ensure_ascii=False), encoding="utf-8")


class CharTokenizer(Tokenizer):
    kind = "char"

    def __init__(self, vocab: list[str]) -> None:
        if len(set(vocab)) != len(vocab):
            raise ValueError("character vocabulary has duplicate entries")
        self.vocab = list(vocab)
        self.pieces = tuple(self.vocab)
        self._stoi = {ch: i for i, ch in enumerate(self.vocab)}

    @classmethod
    def train(cls, text: str) -> CharTokenizer:
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def eos_id(self) -> int | None:
        return self._stoi.get(EOT)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._stoi[ch] for ch in text]
        except KeyError:
            for pos, ch in enumerate(text):
                if ch not in self._stoi:
                    raise TokenizerError(
                        f"character {ch!r} (U+{ord(ch):04X}) at position {pos} is not in this "
                        f"model's vocabulary of {len(self.vocab)} characters"
                    ) from None
            raise

    def decode(self, ids: list[int]) -> str:
        return "".join(self.vocab[i] for i in ids)

    @cached_property
    def max_piece_chars(self) -> int:
        return 1  # encode maps each character to one token (a multi-character entry never matches)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "vocab": self.vocab}


class WordTokenizer(Tokenizer):
    """Words and punctuation (regex ``\\w+|[^\\w\\s]``) plus an end-of-text token.

    Spaces are not tokens, so decoding re-inserts them by rule; encode(decode(x)) is stable.
    """

    kind = "word"

    def __init__(self, vocab: list[str]) -> None:
        if EOT not in vocab:
            vocab = [*vocab, EOT]
        self.vocab = list(vocab)
        self._stoi = {w: i for i, w in enumerate(self.vocab)}

    @classmethod
    def train(cls, text: str) -> WordTokenizer:
        # The corpus separates documents with the end-of-text marker; keep it one token.
        words = Counter(w for part in text.split(EOT) for w in _WORD_RE.findall(part))
        return cls([EOT, *sorted(words)])

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def eos_id(self) -> int | None:
        return self._stoi[EOT]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, part in enumerate(text.split(EOT)):
            if i:
                ids.append(self._stoi[EOT])
            for m in _WORD_RE.finditer(part):
                token_id = self._stoi.get(m.group())
                if token_id is None:
                    raise TokenizerError(
                        f"word {m.group()!r} at position {m.start()} is not in this model's "
                        f"vocabulary of {len(self.vocab)} words"
                    )
                ids.append(token_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        out: list[str] = []
        prev = ""
        for i in ids:
            word = self.vocab[i]
            if out and not (word[:1] in _NO_SPACE_BEFORE or prev[-1:] in _NO_SPACE_AFTER):
                out.append(" ")
            out.append(word)
            prev = word
        return "".join(out)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "vocab": self.vocab}


# Longer texts are encoded with the GIL released; shorter ones take the call that costs ~15 us less.
RELEASE_GIL_CHARS = 4096


class BPETokenizer(Tokenizer):
    """Byte-level BPE (GPT-2's scheme) backed by the `tokenizers` library."""

    kind = "bpe"

    def __init__(self, backend: Any) -> None:
        self._tok = backend
        self._eos = backend.token_to_id(EOT)

    @classmethod
    def train(cls, text: str, vocab_size: int) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator([text], trainer=trainer)
        return cls(tok)

    @classmethod
    def from_gpt2_files(cls, vocab_json: str | Path, merges_txt: str | Path) -> BPETokenizer:
        """GPT-2's own vocabulary (vocab.json + merges.txt), as Hugging Face ships it."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        tok = HFTokenizer(models.BPE.from_file(str(vocab_json), str(merges_txt)))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        if tok.token_to_id(EOT) is not None:
            # As in transformers' GPT-2 tokenizer: the literal text "<|endoftext|>" is one token,
            # the same one a trained BPE vocabulary makes of it.
            tok.add_special_tokens([EOT])
        return cls(tok)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    @cached_property
    def max_piece_chars(self) -> int:
        # Vocabulary entries are byte strings (one character per byte in the byte-level alphabet),
        # and a token's text has at most as many characters as bytes.
        return max((len(k) for k in self._tok.get_vocab(with_added_tokens=True)), default=1) or 1

    @property
    def eos_id(self) -> int | None:
        return self._eos

    def largest_id(self) -> int:
        """The largest id in the vocabulary (vocab_size - 1 unless the ids have gaps)."""
        return max(self._tok.get_vocab().values(), default=-1)

    def encode(self, text: str) -> list[int]:
        # Byte-level BPE encodes UTF-8, which a lone surrogate (JSON's "\ud800") has none of: the
        # library would raise an error that names nothing.
        if not text.isascii():
            _require_utf8(text)
        if len(text) > RELEASE_GIL_CHARS:
            # encode_batch runs without the GIL (encode holds it: ~0.8 s for a megabyte, during
            # which no other thread of the process, the engine's included, runs Python).
            return list(self._tok.encode_batch([text], add_special_tokens=False)[0].ids)
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        # A token sequence that ends inside a multi-byte character decodes to U+FFFD here;
        # incremental decoders hold such text back until the character completes.
        return str(self._tok.decode(ids, skip_special_tokens=False))

    def to_json(self) -> dict[str, Any]:
        return dict(json.loads(self._tok.to_str()))


def _require_utf8(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TokenizerError(
            f"character {e.start} is a lone surrogate (U+{ord(text[e.start]):04X}), not a Unicode "
            "character: the text is not valid UTF-8"
        ) from None


def tokenizer_from_json(data: Any) -> Tokenizer:
    """The tokenizer a `tokenizer.json` document describes; ValueError names what is wrong."""
    if not isinstance(data, dict):
        raise ValueError(f"must hold a JSON object, got {type(data).__name__}")
    kind = data.get("kind")
    if kind in ("char", "word"):
        vocab = data.get("vocab")
        # Decoding joins these strings: anything else would fail at the first response, not here.
        if not isinstance(vocab, list) or not vocab or not all(isinstance(w, str) and w for w in vocab):
            raise ValueError(f"a {kind} tokenizer's vocab must be a non-empty list of non-empty strings")
        if len(set(vocab)) != len(vocab):
            raise ValueError(f"the {kind} vocabulary has duplicate entries")
        return CharTokenizer(vocab) if kind == "char" else WordTokenizer(vocab)
    if kind is None and "model" in data:
        from tokenizers import Tokenizer as HFTokenizer

        tok = BPETokenizer(HFTokenizer.from_str(json.dumps(data)))
        # The engine masks ids from vocab_size up as padding: an id above them would be a token
        # that encode() produces and the model's embedding may not have.
        top = tok.largest_id()
        if top >= tok.vocab_size:
            raise ValueError(f"token ids must run from 0 to {tok.vocab_size - 1}, found id {top}")
        return tok
    raise ValueError(f"unknown tokenizer kind {kind!r}")


def load_tokenizer(path: str | Path) -> Tokenizer:
    return tokenizer_from_json(json.loads(Path(path).read_text(encoding="utf-8")))


def train_tokenizer(spec: str, text: str) -> Tokenizer:
    """Build a tokenizer from a `--tokenizer` spec: `char`, `word` or `bpe:VOCAB_SIZE`."""
    if spec == "char":
        return CharTokenizer.train(text)
    if spec == "word":
        return WordTokenizer.train(text)
    if spec.startswith("bpe:"):
        size = spec.removeprefix("bpe:")
        if not size.isdigit() or int(size) < 257:
            raise ValueError(f"--tokenizer bpe:VOCAB needs a vocabulary size of at least 257, got {size!r}")
        return BPETokenizer.train(text, int(size))
    raise ValueError(f"--tokenizer must be char, word or bpe:VOCAB_SIZE, got {spec!r}")
