"""Long prompts, scored or not, against a real server (issue 47's third class): a victim streams beside them.

`echo` with `logprobs` (TGI's `decoder_input_details`) scores every prompt token: each of its rows
goes through the output layer over the whole vocabulary, which a plain prompt row skips. The first
model here has GPT-2's vocabulary width on two blocks of width 32, so a scored row costs what 66
plain rows cost: uncharged, two clients scoring long prompts made every step of the victim's stream
carry 2 x 96 such rows. Charged by their cost (prompt_scores.ScoringCost), the victim's stream stays
within 2x of its time alone and every scoring request is answered in full.

The second model is the other way round: six blocks of width 384 under 512 words, so a plain
prompt row costs what it costs on a CPU at any size, a 96-row chunk several one-row decode steps.
Two clients' long prompts outnumber the one decoding stream, and under the wave rule
(waiting_served_ratio) every step of the victim carried a chunk of each: 10x its time alone and
more. Held to what half a decode step's time buys (scheduler.py, step_cost.py), it stays within 2x.
"""
from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.reliability.test_attacks import Victim, baseline, post, serve
from tests.reliability.test_grammar_attacks import assert_victim_within_2x
from tests.server.server import ServerProcess

pytestmark = pytest.mark.slow

VOCAB = 50257  # GPT-2's
DEEP_VOCAB = 512
PROMPT_TOKENS = 600
TOP = 5


def make_checkpoint(path: Path, vocab: int, n_layer: int, n_embd: int) -> Path:
    """Random weights under a word vocabulary of `vocab` words (the victim's included)."""
    import torch

    from nanoserve.model.checkpoint import save_checkpoint
    from nanoserve.model.config import GPTConfig
    from nanoserve.model.gpt import GPT
    from nanoserve.model.tokenizer import WordTokenizer

    tok = WordTokenizer(["It", "was", *(f"w{i}" for i in range(vocab - 3))])
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=tok.vocab_size, block_size=1024, n_layer=n_layer, n_head=2, n_embd=n_embd)
    return save_checkpoint(path, GPT(config), tok, name=path.name, provenance={"note": "random weights"})


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from serve(make_checkpoint(tmp_path_factory.mktemp("ckpt") / "wide-vocab", VOCAB, 2, 32))


@pytest.fixture(scope="module")
def deep_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from serve(make_checkpoint(tmp_path_factory.mktemp("ckpt") / "deep", DEEP_VOCAB, 6, 384))


def test_scoring_long_prompts_leaves_a_victim_within_2x(server: ServerProcess) -> None:
    answers = long_prompts_beside_a_victim(server, VOCAB, scored=True)
    for r in answers:
        logprobs = r.json()["choices"][0]["logprobs"]
        assert len(logprobs["token_logprobs"]) == PROMPT_TOKENS + 1  # the prompt's and the new token's
        # OpenAI's shape: the top N and the token itself when it is not among them
        assert all(TOP <= len(top) <= TOP + 1 for top in logprobs["top_logprobs"][1:])


def test_plain_long_prompts_leave_a_victim_within_2x(deep_server: ServerProcess) -> None:
    answers = long_prompts_beside_a_victim(deep_server, DEEP_VOCAB, scored=False)
    assert all(r.json()["usage"]["prompt_tokens"] == PROMPT_TOKENS for r in answers)


def long_prompts_beside_a_victim(server: ServerProcess, vocab: int, *, scored: bool) -> list[httpx.Response]:
    """Two clients send PROMPT_TOKENS-token prompts (scored: with `echo` and `logprobs`), one after
    another, while the victim streams; every answer is a 200, and the victim within 2x."""
    base = server.base_url
    alone = baseline(base)
    answers: list[httpx.Response] = []
    stop = threading.Event()

    def score(client: str) -> None:
        rnd = random.Random(client)
        while not stop.is_set():
            prompt = [rnd.randrange(vocab - 1) for _ in range(PROMPT_TOKENS)]
            body = {"prompt": prompt, "max_tokens": 1, **({"echo": True, "logprobs": TOP} if scored else {})}
            answers.append(post(base, "/v1/completions", body, client=client))

    scorers = [threading.Thread(target=score, args=(f"scorer-{k}",)) for k in range(2)]
    for s in scorers:
        s.start()
    try:
        with Victim(base) as victim:
            while len(victim.durations) < 8 and not victim.errors:
                stop.wait(0.1)
    finally:
        stop.set()
        for s in scorers:
            s.join(timeout=120)
    assert not any(s.is_alive() for s in scorers), "a scoring request got no answer in 120 s"
    what = "scoring" if scored else "sending"
    assert_victim_within_2x(victim, alone, f"two clients {what} {PROMPT_TOKENS}-token prompts")
    assert answers and all(r.status_code == 200 for r in answers), [r.text[:200] for r in answers]
    return answers
