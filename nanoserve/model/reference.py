"""The slow, obviously-correct generator: recompute the whole cropped context for every token.

This is nanoGPT's `generate`, kept as an oracle: the engine's fast path must match it token for
token. It also writes the sample at the end of training.
"""

from __future__ import annotations

import torch

from nanoserve.model.gpt import GPT


@torch.no_grad()
def reference_generate(
    model: GPT,
    ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    policy: str = "sliding",
    keep: int | None = None,
) -> list[int]:
    """Continue `ids`; temperature 0 is greedy.

    policy "sliding" conditions every token on the last block_size tokens (nanoGPT). Policy
    "shift" mirrors context shifting: the context grows until it fills the window; when one more
    token would overflow it, it is cut to its last `keep` tokens (the newest included) and grows
    again.
    """
    block = model.config.block_size
    keep = keep if keep is not None else block // 2
    device = model.wte.weight.device
    out = list(ids)
    ctx = list(ids[-block:])
    for _ in range(max_new_tokens):
        if policy == "sliding":
            ctx = out[-block:]
        elif len(ctx) > block:
            ctx = ctx[-keep:]
        x = torch.tensor([ctx], dtype=torch.long, device=device)
        logits = model(x)[0, -1].float()  # (V,)
        if temperature == 0.0:
            nxt = int(torch.argmax(logits))
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=generator))
        out.append(nxt)
        ctx.append(nxt)
    return out[len(ids) :]
