"""OpenAI's `logit_bias`, `presence_penalty`, `frequency_penalty` and `response_format`, and
llama.cpp's `grammar` (GBNF, or Lark), read from a request body into the rule each step adds to the
row's logits (generation/logit_bias.py; a schema or grammar as generation/grammar.py's tokens), each
field refused by name where it is outside its bounds; and their OpenAPI schema."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

from ..errors import GenerationError
from ..generation.grammar import Grammar
from ..generation.logit_bias import MAX_BIAS, MAX_PENALTY, BiasRule
from .bad_request import BadRequest, shown

PENALTIES = ("presence_penalty", "frequency_penalty")
FORMAT = "response_format"


def response_grammar(body: dict, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> Grammar | None:
    """`response_format`'s grammar: none for text, any JSON object for "json_object", the given
    schema for "json_schema" (OpenAI's `{"json_schema": {"name": ..., "schema": {...}}}`); or the
    `grammar` field's, as llama.cpp's server takes it."""
    asked = body.get("response_format")
    kind = asked.get("type") if isinstance(asked, dict) else None
    if body.get("grammar") is not None:
        if asked is not None and kind != "text":
            raise BadRequest("grammar and response_format both constrain the answer; send one of them", "grammar")
        return _text_grammar(body["grammar"], tokenizer, vocab_size, eos_token_ids)
    if asked is None or kind == "text":
        return None
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema" and isinstance(asked.get("json_schema"), dict):
        schema = asked["json_schema"].get("schema")
        if not isinstance(schema, dict):
            raise BadRequest(
                f"response_format.json_schema.schema is {shown(schema)}; send a JSON schema object", FORMAT
            )
    else:
        raise BadRequest(
            f'response_format is {shown(asked)}; it is {{"type": "text"}}, {{"type": "json_object"}} or '
            '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
            FORMAT,
        )
    try:
        return Grammar(tokenizer, schema, vocab_size, eos_token_ids)
    except GenerationError as err:
        raise BadRequest(str(err), FORMAT) from None


def _text_grammar(text: Any, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> Grammar:
    if not isinstance(text, str) or not text.strip():
        raise BadRequest(
            f'grammar is {shown(text)}; send a grammar in GBNF (root ::= "yes" | "no") or Lark (start: "yes" | "no")',
            "grammar",
        )
    try:
        return Grammar(tokenizer, None, vocab_size, eos_token_ids, text=text)
    except GenerationError as err:
        raise BadRequest(str(err), "grammar") from None


def bias_fields(body: dict, vocab_size: int, grammar: Grammar | None = None) -> BiasRule | None:
    """The request's rule with `grammar` (`response_grammar`), or None where it adds nothing. JSON
    keys are strings, so `logit_bias`'s are token ids written in decimal ("50256"), as OpenAI's
    API takes them."""
    raw = body.get("logit_bias")
    if raw is not None and not isinstance(raw, dict):
        raise BadRequest(f"logit_bias is {shown(raw)}; it must be an object of token id -> bias", "logit_bias")
    pairs = []
    for key, value in (raw or {}).items():
        if not (isinstance(key, str) and key.isascii() and key.isdecimal()):
            raise BadRequest(f'logit_bias has the key {shown(key)}; its keys are token ids, as "50256"', "logit_bias")
        pairs.append((int(key), value))
    penalties = []
    for name in PENALTIES:
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise BadRequest(f"{name} is {shown(value)}; it must be a number in [-2, 2]", name)
        penalties.append(0.0 if value is None else value)
    try:
        return BiasRule(tuple(pairs), *penalties, grammar).checked(vocab_size)
    except GenerationError as err:
        # a penalty outside [-2, 2], an id outside the vocabulary, a bias outside [-100, 100]: named by its field
        param = next((name for name in PENALTIES if str(err).startswith(name)), "logit_bias")
        raise BadRequest(str(err), param) from None


def bias_schema(vocab_size: int) -> dict[str, Any]:
    """The three fields' OpenAPI schema for a model of `vocab_size` tokens."""
    digits = len(str(vocab_size - 1))
    return {
        "logit_bias": {
            "anyOf": [
                {
                    "type": "object",
                    "propertyNames": {"pattern": f"^[0-9]{{1,{digits}}}$"},
                    "additionalProperties": {"type": "number", "minimum": -MAX_BIAS, "maximum": MAX_BIAS},
                },
                {"type": "null"},
            ]
        },
        **{name: {"type": ["number", "null"], "minimum": -MAX_PENALTY, "maximum": MAX_PENALTY} for name in PENALTIES},
        "grammar": {"type": ["string", "null"], "pattern": "\\S"},  # GBNF or Lark
        FORMAT: {
            "anyOf": [
                {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
                {
                    "type": "object",
                    "required": ["type", "json_schema"],
                    "properties": {
                        "type": {"enum": ["json_schema"]},
                        "json_schema": {
                            "type": "object",
                            "required": ["name", "schema"],
                            "properties": {"name": {"type": "string"}, "schema": {"type": "object"}},
                        },
                    },
                },
                {"type": "null"},
            ]
        },
    }
