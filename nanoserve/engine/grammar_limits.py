"""The bounds on one request's grammar: its size, its compile, its lexer and its masks.

A grammar is the client's program: a 15-character regex `(x{1000}){1000}` asks llguidance for a
million-state lexer (seconds of CPU and ~100 MB), and a schema `pattern: "^x{10000}$"` costs ~10 ms
of mask on every step. llguidance bounds its own work (`LLParserLimits`: the lexer's fuel and
states, the grammar's symbols, the parser's items); a grammar past one of them puts the matcher in
error, which the engine reports naming the limit. What llguidance does not bound, the time a mask
takes, is measured here: a request's masks get a time budget (a burst for the lexer states its
first tokens build, then a share per token); one past it ends with an error naming the budget.
"""

from __future__ import annotations

import llguidance as llg

MAX_GRAMMAR_CHARS = 64 * 1024  # a schema or regex longer than this is refused

# llguidance's defaults are sized for a GPU server's many cores; these let every realistic schema
# and pattern through (a 46-property schema with formats, nested arrays and enums needs under 10%
# of each) and refuse the bombs in ~0.1-0.3 s of one core instead of seconds.
MAX_GRAMMAR_SYMBOLS = 50_000  # max_grammar_size (llguidance's default 500,000)
INITIAL_LEXER_FUEL = 100_000  # initial_lexer_fuel: the work of building a lexeme's regex (1,000,000)
MAX_LEXER_STATES = 20_000  # max_lexer_states: ~1-2 kB each, so ~40 MB at most (250,000)
MAX_ITEMS_IN_ROW = 2_000  # max_items_in_row, the parser's branching (llguidance's default)

# Tokens a compile walks down one path of the grammar, so that bounds passed just after its start
# are found then (Grammars._probe).
PROBE_TOKENS = 4
# Wall time of the compile, first mask included (it builds the lexer states the start needs).
MAX_COMPILE_S = 1.0
# Mask time on the engine's side: one mask may take MAX_MASK_S; all of a request's masks together
# MASK_BURST_S plus MASK_PER_TOKEN_S per mask. A JSON schema's mask costs ~0.02-0.2 ms a token.
MAX_MASK_S = 0.1
# A step's masks run beside its forward and may take half the forward's time longer, at most this
# much; a row whose mask takes longer is not sampled that step, and waits for the next
# (GrammarMask.late).
MASK_WAIT_S = 0.002
MASK_BURST_S = 0.2
MASK_PER_TOKEN_S = 0.002


def parser_limits() -> llg.LLParserLimits:
    # verbose_errors off: an error is one line, without the parser's state or the grammar.
    return llg.LLParserLimits(
        max_grammar_size=MAX_GRAMMAR_SYMBOLS, initial_lexer_fuel=INITIAL_LEXER_FUEL,
        max_lexer_states=MAX_LEXER_STATES, max_items_in_row=MAX_ITEMS_IN_ROW, verbose_errors=False,
    )


# llguidance's message (a substring of it) -> the limit it reports, as the docs name it.
_LIMITS = (
    ("too many expressions", f"the lexer's initial_lexer_fuel ({INITIAL_LEXER_FUEL:,})"),
    ("grammar size", f"max_grammar_size ({MAX_GRAMMAR_SYMBOLS:,} symbols)"),
    ("lexer states", f"max_lexer_states ({MAX_LEXER_STATES:,})"),
    ("too many states", f"max_lexer_states ({MAX_LEXER_STATES:,})"),
    ("items; max is", f"the parser's max_items_in_row ({MAX_ITEMS_IN_ROW:,})"),
    ("too complex", f"the parser's max_items_in_row ({MAX_ITEMS_IN_ROW:,})"),
)


def limit_hit(error: str) -> str | None:
    """The limit an llguidance error message reports, or None when it reports something else."""
    for marker, limit in _LIMITS:
        if marker.lower() in error.lower():
            return limit
    return None


def first_line(error: str) -> str:
    return error.strip().splitlines()[0] if error.strip() else "unknown error"


def matcher_failure(error: str) -> str:
    """The request's error for a matcher that went into error while it generated."""
    limit = limit_hit(error)
    if limit is not None:
        return f"the grammar exceeded {limit} while generating: {first_line(error)}"
    return f"the grammar failed while generating: {first_line(error)}"


def mask_budget_s(masks: int) -> float:
    """What `masks` masks of one request may take together."""
    return MASK_BURST_S + MASK_PER_TOKEN_S * masks


def mask_failure(took_s: float, total_s: float, masks: int) -> str | None:
    """The error for a request whose last mask took `took_s` and its `masks` masks `total_s`."""
    if took_s > MAX_MASK_S:
        return (f"the grammar's mask took {took_s * 1000:.0f} ms for one token, more than the limit "
                f"of {MAX_MASK_S * 1000:.0f} ms (max_mask_ms)")
    if total_s > mask_budget_s(masks):
        return (f"the grammar's masks took {total_s:.2f} s for {masks} tokens, more than the budget of "
                f"{MASK_BURST_S:.1f} s + {MASK_PER_TOKEN_S * 1000:.0f} ms a token (mask_budget)")
    return None
