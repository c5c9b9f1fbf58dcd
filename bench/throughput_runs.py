"""What a throughput run records: each peer's run at a concurrency, and a shape's runs with the
bound its measured limits set. No torch here: the llama.cpp peer's own process has none."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Run:
    peer: str
    concurrency: int
    tokens: int
    seconds: float
    step_ms: float  # median decode step (engine: measured per step; peers: total / new tokens)
    note: str = ""

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds


@dataclass
class ShapeResult:
    shape: str
    dtype: str
    params: int
    prompt_tokens: int = 0  # per sequence
    new_tokens: int = 0  # generated per sequence
    runs: list[Run] = field(default_factory=list)
    limits: dict[str, float] = field(default_factory=dict)

    def run_bound_s(self, conc: int) -> float:
        """The shortest time `conc` sequences could take on this machine's measured limits.

        Prompts count: a run of 16-token prompts and 32 new tokens feeds 1.5x the tokens it
        generates (2x at 124M, 16 new), and every peer's time includes its prefill; leaving them
        out reads 30-50% low at batch 32-64. Prefill here is one forward of every prompt token
        (the engine runs it so within its prefill budget), with the output layer for each
        sequence's last token only (the engine, HF's generate and llama.cpp all compute only
        those logits: counting the output layer for every prompt token put this bound below the
        engine's measured 124M batch-64 run); its first generated token comes out of that forward."""
        lim = self.limits
        rate = lim["matmul_GFLOPs"] * 1e9
        read_s = lim["weight_bytes"] / (lim["bandwidth_GBps"] * 1e9)
        token_s, head_s = lim["flops_per_token"] / rate, lim["head_flops_per_token"] / rate
        prefill = max(read_s, conc * (self.prompt_tokens * (token_s - head_s) + head_s))
        return prefill + (self.new_tokens - 1) * max(read_s, conc * token_s)

    def bound_tps(self, conc: int) -> float:
        return conc * self.new_tokens / self.run_bound_s(conc)
