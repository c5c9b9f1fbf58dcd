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
import logging
import threading
import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance as llg
import numpy as np
import torch

from nanoserve.engine import grammar_limits as limits
from nanoserve.engine.types import GrammarSpec, InvalidRequest
from nanoserve.engine.worker_priority import lower_thread_priority
from nanoserve.model.tokenizer import BPETokenizer, Tokenizer

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# JSON is written in one layout, `{"a": 1, "b": [2, 3]}`: with free whitespace a model may pad
# forever (every step could pick a space) and never close the object.
JSON_LAYOUT: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ",
                                       "key_separator": ": "}


@dataclass(eq=False)
class Constraint:
    """One request's grammar state: advanced with each accepted token on the engine thread.

    `failure` is set, once, when the grammar can no longer be followed: the matcher went into
    error (a limit hit while generating) or its masks ran past their time budget. The request
    then ends with that error (Request.accept_token), never with a finish read as complete."""

    matcher: llg.LLMatcher
    n_vocab: int  # the width of the matcher's mask (the tokenizer's vocabulary)
    failure: str | None = None
    consumed: int = 0  # tokens accepted so far
    mask_s: float = 0.0  # what its masks took, all together
    masks: int = 0
    words: np.ndarray | None = None  # the mask computed for `masked_at` tokens (GrammarMask.start)
    masked_at: int = -1
    job: Future[np.ndarray] | None = None  # its mask being computed beside a forward

    def copy(self) -> Constraint:
        """A matcher for another choice of the same request: the compiled grammar is shared."""
        return Constraint(self.matcher.deep_copy(), self.n_vocab, consumed=self.consumed,
                          words=self.words, masked_at=self.masked_at)

    def accept(self, token: int) -> None:
        self.consumed += 1
        if not self.matcher.consume_token(token) and self.failure is None:
            self.failure = limits.matcher_failure(self.matcher.get_error())

    @property
    def complete(self) -> bool:
        """The grammar allows nothing more but the end of the text (a matcher in error is stopped
        too, and is not complete)."""
        return bool(self.matcher.is_stopped()) and not self.matcher.is_error()

    def compute_mask(self, width: int) -> np.ndarray:
        """This state's mask as (width,) int32 words, timed against the request's budget."""
        words = np.zeros(width, dtype=np.int32)
        t0 = time.perf_counter()
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, width * 4)
        took = time.perf_counter() - t0
        self.mask_s += took
        self.masks += 1
        if self.failure is None:
            if self.matcher.is_error():
                self.failure = limits.matcher_failure(self.matcher.get_error())
            else:
                self.failure = limits.mask_failure(took, self.mask_s, self.masks)
        self.words, self.masked_at = words, self.consumed
        return words


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
        """A fresh matcher for `spec`, its first mask computed; raises InvalidRequest naming
        `param` when the grammar is invalid, passes one of grammar_limits' bounds, or this
        vocabulary cannot begin to write it. Choices of one request copy it (Constraint.copy)."""
        if len(spec.value) > limits.MAX_GRAMMAR_CHARS:
            raise InvalidRequest(f"{param}: the grammar has {len(spec.value)} characters, more than "
                                 f"{limits.MAX_GRAMMAR_CHARS} (max_grammar_chars)", param=param)
        t0 = time.perf_counter()
        try:
            if spec.kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(spec.value)
            else:
                grammar = llg.LLMatcher.grammar_from_json_schema(spec.value, defaults=JSON_LAYOUT)
        except Exception as e:  # the library reports a bad schema or regex as ValueError or its own
            raise InvalidRequest(f"{param}: invalid {_kind_name(spec)}: {e}", param=param) from None
        ll = self._lltokenizer(param)
        constraint = Constraint(llg.LLMatcher(ll, grammar, log_level=0, limits=limits.parser_limits()),
                                ll.vocab_size)
        self._check_matcher(constraint, spec, param, "invalid")
        self._check_expressible(constraint, param)  # computes the first mask: the start's lexer states
        self._check_matcher(constraint, spec, param, "unwritable")
        self._check_matcher(self._probe(constraint), spec, param, "unwritable")
        took = time.perf_counter() - t0
        if took > limits.MAX_COMPILE_S:
            raise InvalidRequest(f"{param}: the grammar took {took:.2f} s to compile, more than the limit "
                                 f"of {limits.MAX_COMPILE_S:.1f} s (max_compile_s)", param=param)
        # The first mask was the compile's (bounded by max_compile_s): the budget starts at generation.
        constraint.mask_s, constraint.masks, constraint.failure = 0.0, 0, None
        return constraint

    def _probe(self, c: Constraint) -> Constraint:
        """A copy of `c` walked PROBE_TOKENS tokens down one path (the first token each mask
        allows), its masks computed: llguidance builds a lexeme's states when the text enters it,
        so a bound a grammar passes only past its first character (`x{100000}`, a JSON string's
        pattern) is found here, at compile, rather than while generating."""
        probe = c.copy()
        width = (c.n_vocab + 31) // 32
        words = probe.words if probe.words is not None else probe.compute_mask(width)
        for _ in range(limits.PROBE_TOKENS):
            if probe.matcher.is_error() or probe.matcher.is_stopped():
                break
            allowed = np.flatnonzero(~_disallowed(words.reshape(1, -1), c.n_vocab)[0])
            allowed = allowed[allowed != self.tokenizer.eos_id]
            if not len(allowed) or not probe.matcher.consume_token(int(allowed[0])):
                break
            probe.consumed += 1
            words = probe.compute_mask(width)
        return probe

    @staticmethod
    def _check_matcher(c: Constraint, spec: GrammarSpec, param: str, otherwise: str) -> None:
        """Refuse a matcher in error: by the limit it hit, else as an `invalid` grammar (its
        compile failed) or an `unwritable` one (a text this vocabulary writes breaks it)."""
        if not c.matcher.is_error():
            return
        error = c.matcher.get_error()
        limit = limits.limit_hit(error)
        if limit is not None:
            raise InvalidRequest(f"{param}: the {_kind_name(spec)} exceeds {limit}: "
                                 f"{limits.first_line(error)}", param=param)
        if otherwise == "unwritable":
            raise InvalidRequest(f"{param}: this model's vocabulary cannot express the grammar: "
                                 f"{limits.first_line(error)}", param=param)
        raise InvalidRequest(f"{param}: invalid {_kind_name(spec)}: {error.strip()}", param=param)

    def _check_expressible(self, c: Constraint, param: str) -> None:
        """Refuse a grammar whose first character no token of this vocabulary can write (a
        character model without `{` asked for JSON). Whitespace-only tokens do not count: a JSON
        grammar allows them before its first bracket, and they lead nowhere by themselves."""
        words = c.compute_mask((c.n_vocab + 31) // 32).reshape(1, -1)
        stuck = c.matcher.is_error() and "NoExtensionBias" in c.matcher.get_error()  # no token fits
        if not stuck and (c.matcher.is_error() or c.matcher.is_accepting()):
            return  # an error is reported by _check_matcher, naming its limit
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
    """Masks the constrained rows of a step's logits; unconstrained rows cost nothing.

    `start` computes the masks of the rows a step will sample on a thread of its own while the
    forward runs (llguidance drops the GIL, as the forward's kernels do). After the forward,
    `late` waits for them until a deadline (the forward's end plus half its time, at most
    MASK_WAIT_S): a row whose mask is not ready by then is not sampled this step (the engine feeds
    its last token again next step, when its mask is ready), so a costly grammar delays its own
    request and never its batch. Each mask is timed against its request's budget (grammar_limits.py)."""

    def __init__(self) -> None:
        self._thread: ThreadPoolExecutor | None = None

    def start(self, constraints: list[Constraint]) -> None:
        """Begin the masks of `constraints` (their current states) beside the step's forward."""
        for c in constraints:
            if c.failure is None and c.job is None and c.masked_at != c.consumed:
                if self._thread is None:
                    self._thread = ThreadPoolExecutor(1, thread_name_prefix="nanoserve-masks",
                                                      initializer=lower_thread_priority)
                c.job = self._thread.submit(c.compute_mask, (c.n_vocab + 31) // 32)

    @staticmethod
    def late(constraints: list[Constraint], deadline: float | None) -> list[bool]:
        """Wait for the masks `start` began until `deadline` (perf_counter; None: until done);
        returns, for each constraint, whether its mask is still being computed. The engine thread
        touches the matcher of a late one again only after its job is done."""
        jobs = [c.job for c in constraints if c.job is not None]
        if jobs:
            timeout = None if deadline is None else max(0.0, deadline - time.perf_counter())
            futures.wait(jobs, timeout=timeout)
        out = []
        for c in constraints:
            if c.job is not None and c.job.done():
                if c.job.exception() is not None:  # computed again, on this thread, by apply
                    log.error("a grammar mask failed beside the forward: %r", c.job.exception())
                c.job = None
            out.append(c.job is not None)
        return out

    def apply(self, rows: list[tuple[int, Constraint]], logits: torch.Tensor) -> None:
        """rows: (row of logits, its constraint). Disallowed tokens become -inf in place. A row
        whose grammar failed (Constraint.failure) is left alone: its request ends with the error
        when its token comes back (Request.accept_token), and no token of it is kept."""
        self.late([c for _, c in rows], None)
        width = (rows[0][1].n_vocab + 31) // 32
        live = []
        for j, c in rows:
            words = c.words if c.masked_at == c.consumed and c.words is not None else c.compute_mask(width)
            if c.failure is None:
                live.append((j, words))
        if not live:
            return
        cols = min(rows[0][1].n_vocab, logits.shape[1])
        banned = _disallowed(np.stack([w for _, w in live]), cols)
        every_row = [j for j, _ in live] == list(range(logits.shape[0]))
        if logits.device.type == "cpu" and logits.dtype in _NUMPY_DTYPES and logits.is_contiguous():
            arr = logits.numpy()
            if every_row:
                np.copyto(arr[:, :cols], -np.inf, where=banned)
            for k, (j, _) in enumerate(live if not every_row else ()):
                np.copyto(arr[j, :cols], -np.inf, where=banned[k])
            return
        mask = torch.from_numpy(banned).to(logits.device)
        if every_row:  # one in-place fill
            logits[:, :cols].masked_fill_(mask, float("-inf"))
            return
        for k, (j, _) in enumerate(live):  # views of single rows: in place, no gather/scatter copy
            logits[j, :cols].masked_fill_(mask[k], float("-inf"))
