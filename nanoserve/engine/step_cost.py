"""What the prompt rows a step carries cost the streams that decode in it, measured as they run.

A decoding row's next token waits for its whole step, prompt chunks included. On a GPU a decode
step's time is mostly reading the weights, and a chunk of prefill_budget prompt rows hides in it;
on a CPU thread each prompt row costs its own multiply-adds: at GPT-2 124M a 96-row chunk takes
about three times a one-row decode step, so a stream beside other clients' long prompts ran 5-18x
slower than alone. `StepCost` keeps moving averages of a step with no prompt rows and of what each
prompt row adds to a step, so the scheduler gives prompts, while rows decode, the rows that
DECODE_SHARE of a decode-only step's time buys (Sarathi-Serve's stall-free budget, in time
instead of a fixed token count): a stream's steps then take at most 1 + DECODE_SHARE times their
time alone on average, and prompts still advance at every step or every few. `StepBudget` is one
step's room for prompt chunks, which Scheduler.plan fills.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.engine.config import EngineConfig

SMOOTHING = 0.2  # weight of the newest step in each average
# Prompt rows may add this share of a decode-only step's time to each step while rows decode. Not
# all of it: what a stream waits for is more than the forward the averages see (its sampling, the
# server's threads on the same cores, the caches a chunk evicts), and at 1.0 a stream beside two
# clients' long prompts measured 1.5-2.6x its time alone through HTTP (7 runs).
DECODE_SHARE = 0.5


@dataclass
class StepCost:
    decode_s: float | None = None  # a step that decodes and carries no prompt row
    row_s: float | None = None  # what one prompt row (in plain rows' charge) adds to a step

    def observe(self, seconds: float, prompt_rows: int, decoding: bool) -> None:
        """One step's forward took `seconds`, carrying `prompt_rows` (charged) and decoding or not.
        Steps that only prefill teach nothing: nobody decodes in them."""
        if seconds <= 0 or not decoding:  # a clock that went backwards, or a test's made-up times
            return
        if prompt_rows == 0:
            self.decode_s = _average(self.decode_s, seconds)
        elif self.decode_s is not None:
            self.row_s = _average(self.row_s, max(0.0, seconds - self.decode_s) / prompt_rows)

    def prompt_rows_per_step(self) -> float | None:
        """Prompt rows that cost DECODE_SHARE of a decode-only step; None until both are measured."""
        if self.decode_s is None or self.row_s is None:
            return None
        return DECODE_SHARE * self.decode_s / self.row_s if self.row_s > 0 else float("inf")


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


class StepBudget:
    """One step's room for prompt chunks (Scheduler.plan): rows, and the decoding rows' credit."""

    def __init__(self, config: EngineConfig, decoding: int, wave: bool, credit: float,
                 per_step: float | None) -> None:
        """`per_step`: StepCost.prompt_rows_per_step() (None: not measured yet)."""
        idle = max(config.prefill_budget, config.idle_prefill_budget)
        self.decoding = decoding > 0
        self.wave = wave
        self.total = idle if wave or not self.decoding else config.prefill_budget
        # Chunks that do not complete their prompt: prefill_budget while rows decode. While none
        # does, a request that arrives waits for the step in flight: long prompts' chunks take
        # at most what a share of a decode step's time buys, or prefill_budget (on a GPU, more).
        self.middle = config.prefill_budget
        if not self.decoding:
            self.middle = idle if per_step is None else max(config.prefill_budget, int(min(per_step, idle)))
        self.cap = config.prefill_budget
        self.credit = credit
        self.spent = 0  # charged rows taken
        self.blocked = False  # a chunk the credit could not pay waits: none behind it passes it

    def take(self, cost: int, *, completes: bool, first: bool) -> bool:
        """Whether a chunk charged `cost` rows runs this step (then it is paid for)."""
        if not self.decoding or (self.wave and completes):  # nobody's token waits on it / a wave
            if not first and cost > (self.total if completes else min(self.total, self.middle)):
                return False
            self._pay(cost, credit=False)
            self.middle -= 0 if completes else cost
            return True
        if self.blocked or self.credit < min(cost, self.cap):
            self.blocked = True
            return False
        if not first and cost > min(self.total, self.middle):
            return False
        self._pay(cost, credit=True)
        self.middle -= 0 if completes else cost
        return True

    def _pay(self, cost: int, *, credit: bool) -> None:
        self.total -= cost
        self.spent += cost
        if credit:
            self.credit -= cost
