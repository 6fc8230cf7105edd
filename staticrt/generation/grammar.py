"""Structured output: a JSON schema (OpenAI's `response_format`), or a grammar a user writes in GBNF
(llama.cpp's) or Lark (llguidance's), as the set of tokens each row may choose next, which
llguidance computes on the host from the row's tokens so far (tens of µs a token) and the row's
logit bias carries to the step graph as -inf everywhere else (logit_bias.py). The graph keeps its
shapes; a finished document leaves only the end-of-sequence tokens. llguidance is the library
vLLM, SGLang and llama.cpp use for this; it reads the model's tokenizer.json itself. Imports no
torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from ..errors import GenerationError


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401 - its bitmask helpers
    except ImportError:
        raise GenerationError(
            "a JSON schema needs llguidance, which computes the tokens it allows: pip install 'staticrt[serve]'"
        ) from None
    return llguidance


# Documents laid out as json.dumps writes them, whitespace nowhere else: with llguidance's default
# (any whitespace between tokens) SmolLM2 filled 200 tokens with newlines inside an array on one of
# tests/test_structured_output.py's schemas and never closed it. A schema's "x-guidance" overrides it.
LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _lark(text: str) -> str:
    """A grammar in GBNF as Lark, by llguidance's converter; one in Lark as it is."""
    from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

    try:
        return any_to_lark(text)
    except GbnfToLarkError as err:
        raise ValueError(str(err)) from None


@lru_cache(maxsize=4)
def _ll_tokenizer(tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> Any:
    """llguidance's view of a tokenizer (~1 s to build for a 49k vocabulary): built once a model."""
    return _llguidance().LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))


class Grammar:
    """A compiled JSON schema or grammar for one tokenizer: each row that follows it takes its own `matcher`."""

    def __init__(
        self,
        tokenizer: Any,
        schema: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        frame: tuple[str, str] = ("", ""),
        text: str | None = None,
    ) -> None:
        """`tokenizer`: staticrt's (tokenizer.json in `tokenizer.backend`); `schema`: a JSON schema
        (a dict; {"type": "object"} for any JSON object), its document written between `frame`'s
        two texts (a tool call's tags); or, with `schema` None, `text`: a grammar in GBNF
        (`root ::= ...`) or Lark (`start: ...`). One llguidance cannot compile is a
        GenerationError that quotes its reason."""
        what = "a JSON schema" if text is None else "a grammar"
        if tokenizer is None:
            raise GenerationError(f"{what} needs the model's tokenizer.json, which this model has none of")
        if not eos_token_ids:
            raise GenerationError(f"{what} needs an end-of-sequence token to end its document; the model has none")
        self._build(tokenizer.json, schema, vocab_size, tuple(eos_token_ids), tuple(frame), text)

    def _build(
        self,
        tokenizer_json: str,
        schema: Any,
        vocab: int,
        eos_token_ids: tuple[int, ...],
        frame: tuple[str, str],
        text: str | None = None,
    ) -> None:
        ll = _llguidance()
        self.vocab_size, self._source = vocab, (tokenizer_json, schema, vocab, eos_token_ids, frame, text)
        try:
            self.tokenizer = _ll_tokenizer(tokenizer_json, vocab, eos_token_ids)
        except ValueError as err:  # a tokenizer it cannot take apart into bytes (WordPiece's)
            raise GenerationError(f"llguidance cannot read this model's tokenizer.json ({err})") from None
        try:
            if text is not None:
                self.grammar = ll.LLMatcher.grammar_from_lark(_lark(text))
            elif frame == ("", ""):
                self.grammar = ll.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=LAYOUT)
            else:  # Lark, the JSON document a rule of it (llguidance's %json), laid out as LAYOUT says
                framed = {**schema, "x-guidance": LAYOUT} if isinstance(schema, dict) else schema
                before, after = (json.dumps(text) for text in frame)
                self.grammar = ll.LLMatcher.grammar_from_lark(
                    f"start: {before} doc {after}\ndoc: %json {json.dumps(framed)}"
                )
            error = ll.LLMatcher.validate_grammar(self.grammar, self.tokenizer)
        except (ValueError, TypeError, RuntimeError) as err:  # GbnfToLarkError is a ValueError
            error = str(err)
        if error and not error.startswith("WARNING"):
            what = "JSON schema" if text is None else "grammar"
            raise GenerationError(f"the {what} does not compile: {' '.join(error.split())[:300]}")

    def matcher(self) -> RowMatcher:
        return RowMatcher(self)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled as its sources (a request on its way to a Ray replica): the tokenizer's JSON,
        a few MB, and the schema; the replica builds its llguidance tokenizer once."""
        return _rebuilt, self._source


def _rebuilt(*source: Any) -> Grammar:
    grammar = Grammar.__new__(Grammar)
    grammar._build(*source)
    return grammar


class RowMatcher:
    """One row's place in the grammar: the tokens it may take next (`forbid`), advanced by each
    token it takes (`consume`)."""

    def __init__(self, grammar: Grammar) -> None:
        ll = _llguidance()
        self._fill = ll.numpy.fill_next_token_bitmask
        self.matcher = ll.LLMatcher(grammar.tokenizer, grammar.grammar)
        self.vocab_size = grammar.vocab_size
        self.bitmask = ll.numpy.allocate_token_bitmask(1, grammar.vocab_size)  # [1, ceil(V / 32)] int32

    def consume(self, token: int) -> None:
        """Take `token`. Past a whole document (stopped: only end-of-sequence tokens allowed) the
        row's further tokens are those ends, which a generation without them as stop ids repeats."""
        if self.matcher.is_stopped():
            return
        if not self.matcher.consume_token(token):
            raise GenerationError(f"token {token} does not continue the grammar: {self.matcher.get_error()}")

    def forbid(self, out: np.ndarray) -> None:
        """Set `out [V]` to -inf at every token the grammar does not allow next. Bit j of word i
        allows token 32 i + j (little-endian words: token 33 is bit 1 of word 1's lowest byte)."""
        self._fill(self.matcher, self.bitmask, 0)
        allowed = np.unpackbits(self.bitmask.view(np.uint8), bitorder="little")[: self.vocab_size]
        out[allowed == 0] = -np.inf


def json_schema_grammar(model: Any, schema: Any) -> Grammar:
    """The `Grammar` of a JSON schema for a loaded model (its tokenizer, vocabulary and
    end-of-sequence ids): `gen.generate(prompts, grammar=staticrt.json_schema_grammar(model, schema))`."""
    config = model.config
    return Grammar(getattr(model, "tokenizer", None), schema, config.vocab_size, config.eos_token_ids)


def text_grammar(model: Any, text: str) -> Grammar:
    """The `Grammar` of a GBNF or Lark grammar for a loaded model, as `json_schema_grammar`:
    `staticrt.text_grammar(model, 'root ::= "yes" | "no"')`."""
    config = model.config
    return Grammar(getattr(model, "tokenizer", None), None, config.vocab_size, config.eos_token_ids, text=text)
