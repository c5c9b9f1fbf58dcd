"""Structured output: a request's grammar (JSON Schema or regex) as a token mask, via llguidance.

`Grammars` compiles a request's grammar against the model's tokenizer when the request is
submitted, so an invalid schema or regex, or one this vocabulary cannot start to write, is refused
before any work. Each constrained request carries a `Constraint` (one llguidance matcher); the
runner asks `GrammarMask` for the masks of the constrained rows of a step only and sets their
disallowed tokens to -inf in the logits, which both backends' samplers (and the greedy pick) read.

llguidance was chosen over xgrammar and outlines-core, measured on GPT-2's vocabulary with a small
JSON schema: it compiles a schema in ~0.5-1 ms (xgrammar ~9 ms, outlines-core ~30 ms), and every
request brings its own schema; its mask costs ~0.02-0.1 ms a row (xgrammar's is ~0.01 ms, outlines-
core's ~0.6 ms, listing allowed ids in Python). It ships as one abi3 wheel without further native
dependencies (xgrammar needs apache-tvm-ffi), is actively released, and vLLM, SGLang and llama.cpp
use it.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance as llg
import numpy as np
import torch

from nanoserve.engine.types import GrammarSpec, InvalidRequest
from nanoserve.model.tokenizer import BPETokenizer, Tokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

MAX_GRAMMAR_CHARS = 64 * 1024  # a schema or regex longer than this is refused
# JSON is written in one layout, `{"a": 1, "b": [2, 3]}`: with free whitespace a model may pad
# forever (every step could pick a space) and never close the object.
JSON_LAYOUT: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ",
                                       "key_separator": ": "}


@dataclass(eq=False)
class Constraint:
    """One request's grammar state: advanced with each accepted token on the engine thread."""

    matcher: llg.LLMatcher
    n_vocab: int  # the width of the matcher's mask (the tokenizer's vocabulary)

    def accept(self, token: int) -> None:
        self.matcher.consume_token(token)

    @property
    def complete(self) -> bool:
        """The grammar allows nothing more but the end of the text."""
        return bool(self.matcher.is_stopped())


class _CharVocab:
    """llguidance's view of a character vocabulary (each token is its own text)."""

    def __init__(self, tokenizer: Tokenizer, eos: int) -> None:
        pieces = tokenizer.pieces or ()
        self.tokens = [p.encode("utf-8") for p in pieces] + [b"<|eos|>"] * (eos - len(pieces) + 1)
        self.eos_token_id = eos
        self.bos_token_id = None
        self.special_token_ids = [eos]
        self._stoi = {p: i for i, p in enumerate(pieces)}

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):  # llguidance passes bytes when the callable takes them
            text = text.decode("utf-8", errors="replace")
        return [self._stoi[ch] for ch in text if ch in self._stoi]


class Grammars:
    """Compiles requests' grammars against one tokenizer (its llguidance view is built once)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._ll: llg.LLTokenizer | None = None
        self._lock = threading.Lock()

    def _lltokenizer(self, param: str) -> llg.LLTokenizer:
        with self._lock:  # ~0.3 s for GPT-2's vocabulary: built on the first constrained request
            if self._ll is None:
                tok = self.tokenizer
                if isinstance(tok, BPETokenizer):
                    self._ll = llg.LLTokenizer(json.dumps(tok.to_json()), eos_token=tok.eos_id)
                elif tok.pieces is not None:
                    # A vocabulary without an end-of-text token gets one past its ids, never sampled.
                    eos = tok.eos_id if tok.eos_id is not None else tok.vocab_size
                    self._ll = llg.LLTokenizer(llg.TokenizerWrapper(_CharVocab(tok, eos)))
                else:
                    raise InvalidRequest(f"{param}: this model's {tok.kind} tokenizer cannot be constrained "
                                         "by a grammar (its tokens are not pieces of the text)", param=param)
            return self._ll

    def constraint(self, spec: GrammarSpec, param: str) -> Constraint:
        """A fresh matcher for `spec`; raises InvalidRequest naming `param` when the grammar is
        invalid or this vocabulary cannot begin to write it."""
        if len(spec.value) > MAX_GRAMMAR_CHARS:
            raise InvalidRequest(f"{param}: the grammar has {len(spec.value)} characters, more than "
                                 f"{MAX_GRAMMAR_CHARS}", param=param)
        try:
            if spec.kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(spec.value)
            else:
                grammar = llg.LLMatcher.grammar_from_json_schema(spec.value, defaults=JSON_LAYOUT)
        except Exception as e:  # the library reports a bad schema or regex as ValueError or its own
            raise InvalidRequest(f"{param}: invalid {_kind_name(spec)}: {e}", param=param) from None
        ll = self._lltokenizer(param)
        matcher = llg.LLMatcher(ll, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"{param}: invalid {_kind_name(spec)}: {matcher.get_error()}", param=param)
        constraint = Constraint(matcher, ll.vocab_size)
        self._check_expressible(constraint, param)
        return constraint

    def _check_expressible(self, c: Constraint, param: str) -> None:
        """Refuse a grammar whose first character no token of this vocabulary can write (a
        character model without `{` asked for JSON). Whitespace-only tokens do not count: a JSON
        grammar allows them before its first bracket, and they lead nowhere by themselves."""
        if c.matcher.is_accepting():
            return
        words = np.frombuffer(c.matcher.compute_bitmask(), dtype=np.int32).reshape(1, -1)
        banned = _disallowed(words, min(c.n_vocab, self.tokenizer.vocab_size))[0]
        for token in np.flatnonzero(~banned).tolist():
            if token != self.tokenizer.eos_id and self.tokenizer.decode([token]).strip():
                return
        raise InvalidRequest(f"{param}: this model's vocabulary cannot express the grammar: no token "
                             "can begin the required output", param=param)


def _kind_name(spec: GrammarSpec) -> str:
    return "regular expression" if spec.kind == "regex" else "JSON schema"


def _disallowed(words: np.ndarray, n_vocab: int) -> np.ndarray:
    """(N, W) int32 bitmask words (bit t set: token t allowed) -> (N, n_vocab) bool, true where a
    token is NOT allowed. numpy's unpackbits is one C pass (a torch shift-and-mask over the
    unpacked words took ~10x as long at 32 rows of GPT-2's vocabulary)."""
    bits = np.unpackbits(np.invert(words.view(np.uint8)), axis=1, count=n_vocab, bitorder="little")
    return bits.view(np.bool_)


# CPU logits are masked through numpy: one thread, no intra-op pool (torch's masked_fill_ on two
# threads of a busy machine took ~8 ms for one row of 50k logits, numpy ~0.1 ms).
_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


class GrammarMask:
    """Masks the constrained rows of a step's logits; unconstrained rows cost nothing."""

    def __init__(self) -> None:
        self._executor: Any = None
        self._buf = np.zeros((0, 0), dtype=np.int32)

    def apply(self, rows: list[tuple[int, Constraint]], logits: torch.Tensor) -> None:
        """rows: (row of logits, its constraint). Disallowed tokens become -inf in place."""
        for _, c in rows:
            # A matcher in error (a resource limit hit mid-text) would mask every token: fail its
            # row by name instead (the scheduler isolates a sampling failure to its own rows).
            if c.matcher.is_error():
                raise RuntimeError(f"the grammar failed: {c.matcher.get_error()}")
        n_vocab = rows[0][1].n_vocab
        width = (n_vocab + 31) // 32
        if self._buf.shape[0] < len(rows) or self._buf.shape[1] != width:
            self._buf = np.zeros((max(len(rows), 8), width), dtype=np.int32)
        buf = self._buf[: len(rows)]
        ptr = buf.ctypes.data
        if len(rows) == 1:
            rows[0][1].matcher.unsafe_compute_mask_ptr(ptr, width * 4)
        else:  # llguidance fills the rows on its own threads, without the GIL
            if self._executor is None:
                self._executor = llg.LLExecutor(max(1, min(8, os.cpu_count() or 1)))
            self._executor.unsafe_compute_mask_ptr(
                [(c.matcher, k) for k, (_, c) in enumerate(rows)], ptr, width * 4, len(rows))
        cols = min(n_vocab, logits.shape[1])
        banned = _disallowed(buf, cols)
        every_row = [j for j, _ in rows] == list(range(logits.shape[0]))
        if logits.device.type == "cpu" and logits.dtype in _NUMPY_DTYPES and logits.is_contiguous():
            arr = logits.numpy()
            if every_row:
                np.copyto(arr[:, :cols], -np.inf, where=banned)
            for k, (j, _) in enumerate(rows if not every_row else ()):
                np.copyto(arr[j, :cols], -np.inf, where=banned[k])
            return
        mask = torch.from_numpy(banned).to(logits.device)
        if every_row:  # one in-place fill
            logits[:, :cols].masked_fill_(mask, float("-inf"))
            return
        for k, (j, _) in enumerate(rows):  # views of single rows: in place, no gather/scatter copy
            logits[j, :cols].masked_fill_(mask[k], float("-inf"))
