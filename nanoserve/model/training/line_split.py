"""Corpora of one item a line (names, words): a held-out split by line and the loss on it.

Every 10th line (index % 10 == 9, counting from 0) is held out, so the split does not depend on the
file's order. The loss on a held-out line counts each of its characters and its closing newline,
each predicted from the newline that starts the line and the line's characters before it: what a
model sampling new items from a fresh line is asked to do.
"""

from __future__ import annotations

import argparse
import random
import sys

import torch
import torch.nn.functional as F

from nanoserve.model.gpt import GPT
from nanoserve.model.tokenizer import Tokenizer


def split_lines(text: str) -> tuple[list[str], list[str]]:
    """(training lines, held-out lines) of `text` (a trailing newline adds no line)."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return ([line for i, line in enumerate(lines) if i % 10 != 9],
            [line for i, line in enumerate(lines) if i % 10 == 9])


@torch.no_grad()
def line_loss(model: GPT, tokenizer: Tokenizer, lines: list[str], batch: int = 512) -> float:
    """Mean cross-entropy (nats a token) of `lines`, each read as "\\n" + line -> line + "\\n"."""
    model.eval()
    device = model.wte.weight.device
    total, count = 0.0, 0
    rows = [tokenizer.encode("\n" + line + "\n") for line in lines]
    for start in range(0, len(rows), batch):
        chunk = rows[start : start + batch]
        width = max(len(r) for r in chunk) - 1
        if width > model.config.block_size:
            raise ValueError(f"a line of {width} tokens is longer than the model's window")
        idx = torch.zeros(len(chunk), width, dtype=torch.long)
        targets = torch.full((len(chunk), width), -100, dtype=torch.long)  # -100: padding, not counted
        for j, r in enumerate(chunk):
            idx[j, : len(r) - 1] = torch.tensor(r[:-1])
            targets[j, : len(r) - 1] = torch.tensor(r[1:])
        logits = model(idx.to(device)).float()
        total += F.cross_entropy(logits.view(-1, logits.size(-1)), targets.to(device).view(-1),
                                 ignore_index=-100, reduction="sum").item()
        count += int((targets != -100).sum())
    return total / count


@torch.no_grad()
def sample_lines(model: GPT, tokenizer: Tokenizer, n: int, seed: int, max_len: int = 32) -> list[str]:
    """`n` lines sampled (temperature 1) from a fresh line: "\n", then tokens until the next "\n"."""
    model.eval()
    newline = tokenizer.encode("\n")
    if len(newline) != 1:
        raise ValueError("sampling lines needs a newline that is one token")
    gen = torch.Generator().manual_seed(seed)
    rows = torch.full((n, 1), newline[0], dtype=torch.long)
    done = torch.zeros(n, dtype=torch.bool)
    for _ in range(min(max_len, model.config.block_size - 1)):
        probs = model(rows)[:, -1, :].float().softmax(dim=-1)
        nxt = torch.multinomial(probs, 1, generator=gen).view(-1)
        nxt[done] = newline[0]
        rows = torch.cat([rows, nxt.view(-1, 1)], dim=1)
        done |= nxt == newline[0]
        if bool(done.all()):
            break
    return [tokenizer.decode(r.tolist()[1:]).split("\n", 1)[0] for r in rows]


def main(argv: list[str] | None = None) -> int:
    """Write a corpus's training lines, shuffled with a seed, one a line: the file `nanoserve train`
    reads. Shuffled, because a file in some order (names by popularity) would let a model learn
    where in the file it is from the lines before, which a fresh line never has."""
    p = argparse.ArgumentParser(
        prog="python -m nanoserve.model.training.line_split", description=main.__doc__
    )
    p.add_argument("corpus", help="UTF-8 text, one item a line")
    p.add_argument("--out", required=True, help="where to write the training lines")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    with open(args.corpus, encoding="utf-8") as f:
        train, held_out = split_lines(f.read())
    random.Random(args.seed).shuffle(train)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write("\n".join(train) + "\n")
    print(f"{len(train)} training lines to {args.out}; {len(held_out)} held out")
    return 0


if __name__ == "__main__":
    sys.exit(main())
