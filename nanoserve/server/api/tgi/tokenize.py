"""/tokenize's answer: each token's id, text and character span in the input, as JSON bytes.

It runs on the encoder's thread (nanoserve/server/streaming/encoding.py), but in Python, so it
holds the GIL while it runs: every millisecond of it is a millisecond the event loop and the
engine thread may wait for the GIL. For ~29k tokens, one `id_to_piece` (a decode) per token, a
dict per token and `json.dumps` held it ~100 ms a request, and a flood of 120 such requests kept
/health waiting up to 1.5 s. So each token's text and the start of its JSON object are made once per
tokenizer and kept, the JSON is joined from those strings, and a piece missing from the rest of
the text is remembered as missing instead of searched for again to the end of the text (the cursor
only moves forward, so what is not after it now never will be): the walk stays linear in the text.
"""

from __future__ import annotations

import json
import threading
import weakref

from nanoserve.model.tokenizer import Tokenizer

# tokenizer -> {token id: (its text, its JSON object up to the start's value)}, filled as tokens
# are seen (a vocabulary of 50k would take ~50 ms to decode whole, paid by the first request).
_PIECES: weakref.WeakKeyDictionary[Tokenizer, dict[int, tuple[str, str]]] = weakref.WeakKeyDictionary()
_PIECES_LOCK = threading.Lock()


def _pieces(tokenizer: Tokenizer) -> dict[int, tuple[str, str]]:
    with _PIECES_LOCK:
        pieces = _PIECES.get(tokenizer)
        if pieces is None:
            pieces = _PIECES[tokenizer] = {}
        return pieces


def spans_json(tokenizer: Tokenizer, text: str, ids: list[int], truncate: int | None = None) -> bytes:
    """TGI's /tokenize body for `ids` (the tokens of `text`): a JSON list of {id, text, start, stop};
    `truncate` keeps the last N. A token's text appears verbatim in the input for char, word and
    byte-level BPE vocabularies; one that does not (part of a multi-byte character) gets an empty
    span at the cursor."""
    pieces = _pieces(tokenizer)
    keep_from = 0 if truncate is None else max(0, len(ids) - truncate)
    missing: set[str] = set()
    parts: list[str] = []
    cursor = 0
    for i, token_id in enumerate(ids):
        entry = pieces.get(token_id)
        if entry is None:
            piece = tokenizer.id_to_piece(token_id)
            head = f'{{"id":{token_id},"text":{json.dumps(piece, ensure_ascii=False)},"start":'
            entry = pieces[token_id] = (piece, head)
        piece, head = entry
        start = -1
        if piece and piece not in missing:
            start = text.find(piece, cursor)
            if start < 0:
                missing.add(piece)
        if start < 0:
            start = stop = cursor
        else:
            stop = cursor = start + len(piece)
        if i >= keep_from:
            parts.append(f'{head}{start},"stop":{stop}}}')
    return ("[" + ",".join(parts) + "]").encode()
