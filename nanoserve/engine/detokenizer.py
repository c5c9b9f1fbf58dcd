"""Incremental detokenisation and stop-string matching for one request.

Text is streamed as deltas that concatenate to exactly the request's final text. Two things are
held back until they resolve: a partial UTF-8 character (byte-level BPE decodes a token sequence
that ends inside a character to U+FFFD) and any tail that could be the start of a stop string
(so a stop string is never streamed, not even partially).
"""

from __future__ import annotations

from nanoserve.model.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas (TGI's prefix/read offsets).

    Only a short window is decoded per token, so the cost stays O(1) per token: `ids[prefix:read]`
    are the tokens of the last emitted delta (left context for tokenizers whose rendering of a
    token depends on its neighbour, e.g. word-level spacing), and the delta is what
    `decode(ids[prefix:])` adds to `decode(ids[prefix:read])`. A trailing U+FFFD means a
    byte-level BPE character is not finished yet: wait for more tokens.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.pieces = tokenizer.pieces
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0
        self.text = ""  # everything emitted so far

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self.pieces is not None:  # each token's text stands alone: emitted whole, nothing held
            return self.pieces[token_id]
        prefix_text = self.tokenizer.decode(self.ids[self.prefix : self.read])
        new_text = self.tokenizer.decode(self.ids[self.prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
            return ""
        if not new_text.startswith(prefix_text):
            # A decoder that rewrote earlier text (should not happen): fall back to a full decode.
            return self._resync()
        delta = new_text[len(prefix_text) :]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += delta
        return delta

    def _resync(self) -> str:
        full = self.tokenizer.decode(self.ids)
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += delta
        self.prefix, self.read = max(0, len(self.ids) - 1), len(self.ids)
        return delta

    def flush(self) -> str:
        """At the end: whatever the full decode has beyond what was emitted (e.g. a final
        incomplete character, which then stays U+FFFD)."""
        if self.pieces is not None:  # add() emitted every token's text already
            return ""
        full = self.tokenizer.decode(self.ids)
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += delta
        return delta


class StopMatcher:
    """Finds stop strings in the text as it grows; reports when one completes.

    By default (OpenAI's rule) it holds back text that may begin a stop string, and a stop string
    is never emitted. With `keep` (TGI's rule) every token's text is emitted as it comes, the stop
    string included, and only a tail as long as the longest stop is remembered to find one that
    spans tokens.
    """

    def __init__(self, stops: tuple[str, ...], keep: bool = False) -> None:
        self.stops = tuple(s for s in stops if s)
        self.keep = keep
        self.held = ""  # held-back text (default) or the remembered tail (keep)
        self.tail_len = max((len(s) for s in self.stops), default=1) - 1

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string completed).

        On a stop the emitted text ends right before the earliest stop string; the stop string
        itself and anything after it are dropped (with `keep`: the text is emitted whole).
        """
        if not self.stops:
            return text, False
        buf = self.held + text
        if self.keep:
            self.held = buf[len(buf) - self.tail_len :] if self.tail_len else ""
            return text, any(s in buf for s in self.stops)
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.held = ""
            return buf[:cut], True
        keep = self._longest_stop_prefix_suffix(buf)
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def _longest_stop_prefix_suffix(self, buf: str) -> int:
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        held, self.held = self.held, ""
        return "" if self.keep else held
