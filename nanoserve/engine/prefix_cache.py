"""Prompt prefix reuse: a KV slot keeps what its last sequence computed, and a prompt that starts
with those tokens prefills only the rest.

A chat turn re-sends the whole conversation, whose keys and values the previous turn's slot still
holds. As llama.cpp's server does (`cache_prompt`: a slot remembers its tokens and a request goes to
the slot sharing the longest prefix with its prompt), a sequence that ends leaves its slot free but
*warm*: the tokens at positions 0..n-1 of its cache are remembered. A new request is placed by
`PrefixCache.place`:
- the longest common prefix with any warm free slot or running sequence is found;
- when a free slot's whole content is a prefix of the prompt (a follow-up turn), the request takes
  that slot and nothing is lost;
- otherwise the matched keys and values are copied (`SpanKVCache.copy_prefix`) into the slot that
  costs least to take, so a partly matching slot stays warm for whoever matches it better;
- a slot is taken cold first (the lowest: batches stay dense), else the warm one used longest ago
  (released, or copied from): the cache itself is the bound, and eviction is least recently used.
The request then starts with those positions cached; its last prompt token is always fed again,
since its logits give the first draw.

Reuse is isolated by tenant. A hit is faster than a miss (and counted in /metrics), so a cache
shared by every client would tell one client, probe by probe, whether another sent a prompt
starting with given tokens: a secret in it could be read a token at a time. A cached prefix is
therefore reused only by requests of the same tenant (`tenant_of`): the same client (an API key,
else an address or a trusted header's value) or, when a request names one, the same `cache_salt`
(vLLM's field: clients that share a salt share their prefixes, and nobody else does). `shared`
(the operator's `prefix_cache_shared`) puts every request in one tenant.

The reused numbers are the ones a recompute would store: positions are absolute within a slot (a
prefix keeps its positions), and a step computes every row on its own on a batch-invariant backend
(the native one), so greedy output and logprobs are bit for bit those without reuse. On the torch
backend a row's numbers may differ in the last bits with the forward's shape, as they already do
with batching; deterministic mode there turns reuse off (see `reuse_allowed`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from nanoserve.engine.request import Request

_BLOCK = 32  # tokens compared at once while looking for a mismatch

Tenant = tuple[str, str | None]  # ("salt", a cache_salt) or ("client", a client id; None: no client)


def tenant_of(req: Request) -> Tenant:
    """Whose cached prefixes `req` may reuse: those of its `cache_salt`, if it names one, else its
    client's."""
    salt = req.params.cache_salt
    return ("salt", salt) if salt is not None else ("client", req.client)


@dataclass(frozen=True)
class Placement:
    """Where a request goes: `slot`, whose positions 0..reuse-1 hold its context's first `reuse`
    tokens once `source` (another slot; None: `slot` itself) has been copied into it."""

    slot: int
    reuse: int = 0
    source: int | None = None


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens `a` and `b` share, at most `limit`. Slice compares run in C: a full
    match (the common case) is one compare, a mismatch is found a block at a time, then a token at
    a time within the block (a bisection would copy the prefix again at every halving)."""
    n = min(len(a), len(b), limit)
    if n <= 0 or a[0] != b[0]:
        return 0
    if a[:n] == b[:n]:
        return n
    i = 0  # a mismatch lies before n: the first unequal block holds it
    while a[i : i + _BLOCK] == b[i : i + _BLOCK]:
        i += _BLOCK
    while a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Which free slots are warm, with which tokens; owned by the scheduler (engine thread)."""

    def __init__(self, enabled: bool, shared: bool = False) -> None:
        """`shared`: every request may reuse every other's prefixes (one tenant for all)."""
        self.enabled = enabled
        self.shared = shared
        self._tokens: dict[int, list[int]] = {}  # warm free slot -> tokens at its positions 0..
        self._owner: dict[int, Tenant] = {}  # warm free slot -> the tenant whose tokens it holds
        self._released: dict[int, int] = {}  # warm free slot -> when last released or copied from
        self._clock = 0
        self.lookups = 0  # placements that looked for a prefix
        self.hits = 0  # of those, placements that reused at least one token
        self.reused_tokens = 0  # prompt tokens not prefilled

    @property
    def warm_slots(self) -> int:
        return len(self._tokens)

    def held(self, slot: int) -> list[int] | None:
        """The tokens a warm free slot holds (None: cold or taken)."""
        return self._tokens.get(slot)

    def remember(self, slot: int, tokens: list[int], tenant: Tenant = ("client", None)) -> None:
        """`slot` is free again, holding the keys and values of `tenant`'s `tokens` at positions 0.."""
        if not self.enabled or not tokens:
            self.forget(slot)
            return
        self._clock += 1
        self._tokens[slot], self._released[slot], self._owner[slot] = tokens, self._clock, tenant

    def forget(self, slot: int) -> None:
        """`slot` is taken, or its contents are not to be trusted."""
        self._tokens.pop(slot, None)
        self._released.pop(slot, None)
        self._owner.pop(slot, None)

    def _mine(self, owner: Tenant | None, tenant: Tenant) -> bool:
        return self.shared or owner == tenant

    def cheapest(self, free: list[int]) -> int:
        """The free slot whose contents are worth least: a cold one (the lowest), else the warm one
        used longest ago."""
        cold = [s for s in free if s not in self._tokens]
        return min(cold) if cold else min(free, key=self._released.__getitem__)

    def place(self, ctx: list[int], free: list[int], running: Iterable[Request],
              tenant: Tenant = ("client", None)) -> Placement:
        """Where a request of `tenant` with context `ctx` goes, among the `free` slots (at least
        one), reusing the longest prefix a warm free slot or a `running` sequence of the same
        tenant holds."""
        if not self.enabled:
            return Placement(free[0])
        self.lookups += 1
        limit = len(ctx) - 1  # the last token is fed again: its logits are the first draw's
        best, best_n, whole = -1, 0, False
        for slot in free:
            tokens = self._tokens.get(slot)
            if tokens is None or not self._mine(self._owner.get(slot), tenant):
                continue
            n = common_prefix(tokens, ctx, len(tokens))
            if min(n, limit) > best_n or (n == len(tokens) and min(n, limit) == best_n > 0):
                best, best_n, whole = slot, min(n, limit), n == len(tokens)
        for req in running:  # copied from, never taken; ctx[:n_cached] is what its slot holds
            if not self._mine(tenant_of(req), tenant):
                continue
            n = common_prefix(req.ctx, ctx, min(req.n_cached, limit))
            if n > best_n:
                best, best_n, whole = req.slot, n, False
        if best_n == 0:
            return Placement(self.cheapest(free))
        self.hits += 1
        self.reused_tokens += best_n
        if whole:  # the slot's whole content leads the context: take it, nothing is lost
            return Placement(best, best_n)
        target = self.cheapest(free)
        if target == best:
            return Placement(best, best_n)
        if best in self._released:  # a warm slot that serves copies (a shared system prompt) is kept
            self._clock += 1
            self._released[best] = self._clock
        return Placement(target, best_n, source=best)
