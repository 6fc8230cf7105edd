"""What a request adds to its logits before each token is chosen: OpenAI's `logit_bias` and its
presence and frequency penalties, as one additive bias a row `[V]` that the step graph adds to the
logits before greedy or sampled choice (`run_step`; the artifacts' host choice alike). The host
keeps each row's bias up to date between steps; the graph's shapes never change. Imports no torch.

The penalties follow vLLM's definition (`vllm/model_executor/layers/utils.py`, `apply_penalties`),
which OpenAI's API reference describes in words: over the tokens the row generated so far (not its
prompt), logits[t] -= frequency_penalty * count(t) + presence_penalty * (count(t) > 0). All three
are added before the temperature divides the logits, as there.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import GenerationError, as_int, as_real
from .grammar import Grammar

# OpenAI's bounds: a bias of -100 bans a token, 100 all but forces it; penalties in [-2, 2]
MAX_BIAS, MAX_PENALTY = 100.0, 2.0


@dataclass(frozen=True)
class BiasRule:
    """A request's additive bias: `logit_bias` as (token id, bias) pairs, and its penalties."""

    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    grammar: Grammar | None = field(default=None, compare=False)  # a JSON schema's tokens (grammar.py)

    @property
    def penalizes(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)

    @property
    def follows_tokens(self) -> bool:
        """Whether the bias changes with each token the row takes (penalties, a grammar): a verify
        step, which adds one bias at every position, cannot follow it."""
        return self.penalizes or self.grammar is not None

    def checked(self, vocab_size: int) -> BiasRule | None:
        """This rule with plain Python numbers in range, None where it adds nothing, or a
        GenerationError naming the field, the limit and the way out."""
        pairs = []
        for token, bias in self.logit_bias:
            token = as_int(token, "logit_bias token id", 0)
            if token >= vocab_size:
                raise GenerationError(
                    f"logit_bias names token id {token}, outside the vocabulary of {vocab_size} tokens (0 to "
                    f"{vocab_size - 1}); drop it"
                )
            bias = as_real(bias, f"logit_bias[{token}]")
            if not -MAX_BIAS <= bias <= MAX_BIAS:
                raise GenerationError(f"logit_bias[{token}] is {bias}; it must be in [-100, 100]")
            pairs.append((token, bias))
        penalties = []
        for name in ("presence_penalty", "frequency_penalty"):
            given = getattr(self, name)
            value = as_real(given, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise GenerationError(f"{name} is {given}; it must be in [-2, 2]")  # as the caller wrote it
            penalties.append(value)
        rule = BiasRule(tuple(dict(pairs).items()), *penalties, self.grammar)  # a token named twice: its last bias
        return rule if rule.logit_bias or rule.follows_tokens else None


def bias_rule(
    logit_bias: Any = None, presence_penalty: Any = 0.0, frequency_penalty: Any = 0.0, grammar: Grammar | None = None
) -> BiasRule | None:
    """The rule of the Python API's arguments (`logit_bias`: {token id: bias}), unchecked
    (`BiasRule.checked`); None where it adds nothing."""
    if logit_bias is not None and not isinstance(logit_bias, dict):
        raise GenerationError(f"logit_bias is a {type(logit_bias).__name__}; pass a dict of token id -> bias")
    if grammar is not None and not isinstance(grammar, Grammar):
        raise GenerationError(f"grammar is a {type(grammar).__name__}; pass a staticrt.Grammar")
    rule = BiasRule(tuple((logit_bias or {}).items()), presence_penalty, frequency_penalty, grammar)
    return rule if rule.logit_bias or rule.follows_tokens else None


class RowBias:
    """One row's bias as it generates: the rule's constant part, and the penalties of the tokens
    it has emitted so far (`emitted`)."""

    def __init__(self, rule: BiasRule) -> None:
        self.rule = rule
        self.counts: Counter[int] = Counter()
        self.matcher = None if rule.grammar is None else rule.grammar.matcher()

    def emitted(self, token: int) -> None:
        if self.rule.penalizes:
            self.counts[token] += 1
        if self.matcher is not None:
            self.matcher.consume(token)

    def write(self, out: np.ndarray) -> None:
        """Set `out [V]` float32 to this row's bias for its next token."""
        out[:] = 0.0
        for token, bias in self.rule.logit_bias:
            out[token] += bias
        if self.counts:
            tokens = np.fromiter(self.counts.keys(), dtype=np.int64, count=len(self.counts))
            counts = np.fromiter(self.counts.values(), dtype=np.float32, count=len(self.counts))
            out[tokens] -= self.rule.frequency_penalty * counts + self.rule.presence_penalty
        if self.matcher is not None:
            self.matcher.forbid(out)


def step_bias(rows: dict[int, RowBias], batch: int, vocab_size: int) -> np.ndarray | None:
    """The step's bias `[B, V]` float32: each of `rows` (slot -> its bias) written at its slot,
    zeros elsewhere; None where no row has one (the step then adds nothing)."""
    if not rows:
        return None
    bias = np.zeros((batch, vocab_size), dtype=np.float32)
    for slot, row in rows.items():
        row.write(bias[slot])
    return bias


def row_biases(rule: BiasRule | None, n_rows: int, speculating: bool) -> dict[int, RowBias]:
    """Each of a generation's rows' bias as it generates, none without a rule. Penalties change
    with every token a draft holds, which a verify step's one bias a row cannot follow."""
    if rule is None:
        return {}
    if rule.follows_tokens and speculating:
        raise GenerationError(
            "a grammar and presence_penalty and frequency_penalty change with every token a draft holds, which a "
            "verify step cannot follow; drop speculative, or the grammar and the penalties"
        )
    return {r: RowBias(rule) for r in range(n_rows)}


def counting(biased: dict[int, RowBias], stream: Callable[[int, int], None] | None) -> Callable[[int, int], None]:
    """`stream` (row, token id), after each token counts towards its row's penalties, before the
    next step is biased."""

    def emit(r: int, token: int) -> None:
        biased[r].emitted(token)
        if stream is not None:
            stream(r, token)

    return emit
