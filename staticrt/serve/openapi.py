"""The request bodies and answers of the OpenAI routes as JSON Schema, for the server's
`/openapi.json` (and its `/docs`): the routes read their bodies themselves (protocol.py checks
every field, counting bytes as they arrive), so FastAPI cannot infer them. The schemas say what
protocol.py accepts, and the answers list every status it can give, so a client generator, or
schemathesis fuzzing from the schema (tests/test_openapi.py), sees the server as it is.

The model's own limits (its name, its vocabulary, its context) are in the schema; what depends on
the request as a whole (the context left after this prompt, text a tokenizer reads) is left to the
400 answer that names it.
"""

from __future__ import annotations

from typing import Any

from .http_limits import BODY_S
from .job import MAX_STOP_CHARS, MAX_STOPS
from .logit_fields import bias_schema
from .logprob_fields import logprobs_schema
from .protocol import UNSUPPORTED, Limits

TEXT_PART = {"type": "object", "required": ["type"], "properties": {"type": {"const": "text"}, "text": {}}}
CALL = {  # a tool call an assistant's message gave back: its arguments as a JSON object's text
    "type": "object",
    "required": ["function"],
    "properties": {
        "function": {"type": "object", "required": ["name", "arguments"], "properties": {"name": {"type": "string"}}}
    },
}
MESSAGE = {  # content may be null in an assistant's message that only called tools
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"type": "string"},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART}, {"type": "null"}]},
        "tool_calls": {"type": "array", "items": CALL},
        "tool_call_id": {"type": "string"},
    },
}
TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                "description": {"type": "string"},
                "parameters": {"type": "object"},
            },
        },
    },
}
# "required" and a named function force a call: a grammar keeps its form (tools.py, `Tools.forcing`)
NAMED = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {"function": {"type": "object", "required": ["name"]}},
}
CHOICE = {"anyOf": [{"enum": ["none", "auto", "required"]}, NAMED]}
TOOLS = {"tools": {"type": "array", "items": TOOL}, "tool_choice": CHOICE}
STOP = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}


def _distinct(values: tuple) -> list:
    """`values` without those equal in JSON to one before them (0.0 after 0): an enum's items are unique."""
    return [v for i, v in enumerate(values) if v not in values[:i]]


def _bodies(limits: Limits, text: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The completions and chat request bodies protocol.py accepts for the model `limits` names:
    its name, ids in its vocabulary, at most the context's positions; text (a prompt, stop strings)
    where it has a tokenizer (`text`; without one, a chat is a 400 that names the tokenizer)."""
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": limits.vocab_size - 1}}
    tokens = {"type": "integer", "minimum": 1}
    if limits.max_sequence_len is not None:
        tokens["maximum"] = limits.max_sequence_len - 1  # the prompt holds a position at least
    common: dict[str, Any] = {
        "model": {"enum": [limits.model]},
        "n": {"type": "integer", "minimum": 1, "maximum": limits.rows},  # a row a choice
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0},
        "seed": {"type": "integer", "minimum": 0},
        "stop": {"anyOf": [STOP, {"type": "array", "items": STOP, "maxItems": MAX_STOPS}, {"type": "null"}]}
        if text
        else {"type": "null"},
        "stop_token_ids": ids,
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
        "max_tokens": tokens,
        **bias_schema(limits.vocab_size),
        # not implemented: refused unless it asks for nothing
        **{name: {"enum": _distinct(harmless)} for name, harmless in UNSUPPORTED.items()},
    }
    prompt = [{"type": "string", "minLength": 1}, ids | {"minItems": 1}][0 if text else 1 :]
    completion = {
        "type": "object",
        "required": ["model", "prompt"],
        "properties": {
            **common,
            **{name: {"enum": [None, neutral]} for name, neutral in (("tools", []), ("tool_choice", "none"))},
            **logprobs_schema(chat=False),
            "prompt": {"anyOf": [*prompt, {"type": "array", "items": {"anyOf": prompt}, "minItems": 1, "maxItems": 1}]},
        },
    }
    chat = {
        "type": "object",
        "required": ["model", "messages"],
        "properties": {
            **common,
            "messages": {"type": "array", "items": MESSAGE, "minItems": 1},
            "max_completion_tokens": tokens,
            "chat_template_kwargs": {"type": "object"},
            **TOOLS,
            "parallel_tool_calls": {"type": "boolean"},
            **logprobs_schema(chat=True),
        },
        # top_logprobs needs logprobs: true beside it
        "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
        "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
    }
    return completion, chat


ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"}},
        }
    },
}
REFUSALS = {
    "400": "a field out of its limits, named in error.param",
    "401": "an API key is set and the request's is missing or wrong",
    "408": f"the body took over {BODY_S:g} s to arrive",
    "413": "the body is over the size limit",
    "429": "every row and the queue are full (Retry-After: 1)",
    "503": "the server is shutting down, or the model failed",
}


# what a keyed route without the key answers (`create_app`'s `api_key`)
KEY_REFUSAL: dict[int | str, dict[str, Any]] = {
    401: {"description": REFUSALS["401"], "content": {"application/json": {"schema": ERROR}}}
}


def completion_route(limits: Limits, chat: bool, text: bool) -> dict[str, Any]:
    """`openapi_extra` for /v1/completions (`chat` False) or /v1/chat/completions; `text`: the
    model has a tokenizer."""
    errors = {
        code: {"description": why, "content": {"application/json": {"schema": ERROR}}} for code, why in REFUSALS.items()
    }
    answer = {"type": "object", "required": ["id", "object", "choices"]}
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": _bodies(limits, text)[chat]}}},
        "responses": {
            "200": {
                "description": "the answer, whole (JSON) or as server-sent events (`stream`)",
                "content": {"application/json": {"schema": answer}, "text/event-stream": {"schema": {}}},
            },
            **errors,
        },
    }
