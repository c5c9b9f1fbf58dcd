"""/tokenize's spans (nanoserve/server/api/tgi/tokenize.py) against the plain walk they replace."""

from __future__ import annotations

import json
from typing import Any

import pytest

from nanoserve.model.tokenizer import BPETokenizer, CharTokenizer, Tokenizer, WordTokenizer
from nanoserve.server.api.tgi.tokenize import spans_json

CORPUS = "It was the best of times, it was the worst of times; naïve café, déjà vu. " * 8


def plain_spans(tokenizer: Tokenizer, text: str, ids: list[int]) -> list[dict[str, Any]]:
    """The oracle: one decode and one search from the cursor per token."""
    out, cursor = [], 0
    for token_id in ids:
        piece = tokenizer.id_to_piece(token_id)
        start = text.find(piece, cursor) if piece else -1
        if start < 0:
            start = stop = cursor
        else:
            stop = cursor = start + len(piece)
        out.append({"id": token_id, "text": piece, "start": start, "stop": stop})
    return out


TOKENIZERS = {
    "char": lambda: CharTokenizer.train(CORPUS + "中\"\\\n"),
    "word": lambda: WordTokenizer.train(CORPUS),
    "bpe": lambda: BPETokenizer.train(CORPUS, vocab_size=300),
}
TEXTS = [
    "It was the best of times",
    "naïve café, déjà vu.\n\"quoted\" \\ back",
    "it was   the worst\n\nof times",
    "中" + "é" * 40 + " was",  # multi-byte characters the small BPE vocabulary splits into bytes
]


@pytest.mark.parametrize("kind", TOKENIZERS)
def test_spans_match_the_plain_walk(kind: str) -> None:
    tokenizer = TOKENIZERS[kind]()
    for text in TEXTS:
        try:
            ids = tokenizer.encode(text)
        except ValueError:
            continue  # a character the vocabulary lacks (char/word): /tokenize answers 422 there
        expected = plain_spans(tokenizer, text, ids)
        assert json.loads(spans_json(tokenizer, text, ids)) == expected, text
        for truncate in (1, 3, len(ids) + 2):
            assert json.loads(spans_json(tokenizer, text, ids, truncate)) == expected[-truncate:], text


class CountingText(str):
    """A str that counts the searches made in it."""

    finds = 0

    def find(self, *args: Any) -> int:  # type: ignore[override]
        type(self).finds += 1
        return super().find(*args)


def test_a_piece_missing_from_the_rest_of_the_text_is_not_searched_again() -> None:
    # Each "é" is two byte tokens whose pieces are U+FFFD, found nowhere in the text: searching
    # for them again to the end of the text at every token made a long text quadratic.
    tokenizer = BPETokenizer.train(CORPUS.replace("é", "e"), vocab_size=260)
    text = CountingText("中" + "é" * 2000)
    ids = tokenizer.encode(text)
    assert len(ids) > 4000
    out = json.loads(spans_json(tokenizer, text, ids))
    assert out == plain_spans(tokenizer, str(text), ids)
    CountingText.finds = 0
    spans_json(tokenizer, text, ids)
    assert CountingText.finds < 10  # a search per distinct piece, not per token
