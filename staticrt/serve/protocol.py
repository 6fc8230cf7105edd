"""OpenAI's request bodies: a request checked field by field into a `Completion` (a bad field is a
`BadRequest` naming it, its limit and the way out: HTTP 400 in OpenAI's error shape). The response
objects are reply.py's.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

from ..errors import StaticrtError
from ..generation.params import SamplingParams
from ..text.chat_template import check_template_kwargs
from ..text.generation_config import GenerationDefaults
from ..text.tokenizer import check_text
from .bad_request import BadRequest, shown
from .job import check_stops
from .logit_fields import bias_fields, response_grammar
from .logprob_fields import logprobs_asked
from .scheduler import Completion
from .tools import Tools, check_tools, template_messages

# OpenAI fields staticrt does not implement, with the values that ask for nothing: any other value
# is refused by name, since ignoring it would answer something other than what was asked.
UNSUPPORTED = {
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "repetition_penalty": (None, 1, 1.0),
    "min_p": (None, 0, 0.0),
    "functions": (None, []),  # the legacy form of tools: send `tools`
}


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: Any = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class Limits:
    """What the server can hold: its name, the cache's last position, the vocabulary, the eos ids."""

    model: str
    max_sequence_len: int | None
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    defaults: GenerationDefaults
    rows: int = 1  # the most choices (`n`) a request may ask for: each takes a row


def choices_asked(body: dict, limits: Limits) -> int:
    """`n`: each choice runs as a request of its own in its own row (the prompt's prefill shared
    only where a row's kept prefix allows), so no more than the server has rows."""
    n = _integer(body, "n", 1, 1)
    if n > limits.rows:
        raise BadRequest(
            f"n is {n}; this server has {limits.rows} rows, a choice each: ask for at most {limits.rows}", "n"
        )
    return n


def _number(body: dict, name: str, low: float, high: float, default: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise BadRequest(f"{name} is {shown(value)}; it must be a number", name)
    if not (low < value if low_open else low <= value) or value > high:
        bracket = "(" if low_open else "["
        raise BadRequest(f"{name} is {value}; it must be in {bracket}{low}, {high}]", name)
    return float(value)


def _integer(body: dict, name: str, low: int, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise BadRequest(f"{name} is {shown(value)}; it must be an integer >= {low}", name)
    return value


def _token_list(value: Any, name: str, vocab: int) -> list[int]:
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        raise BadRequest(f"{name} must be a non-empty list of token ids", name)
    bad = [t for t in value if not 0 <= t < vocab]
    if bad:
        raise BadRequest(f"{name} holds token id(s) {bad[:5]} outside the vocabulary [0, {vocab})", name)
    return list(value)


def _text(value: str, name: str) -> str:
    try:
        return check_text(value, name)
    except StaticrtError as err:
        raise BadRequest(str(err), name) from None


def check_fields(body: dict) -> tuple[bool, bool]:
    """The fields staticrt cannot honour refused by name; `stream` and `stream_options.include_usage`."""
    for name, harmless in UNSUPPORTED.items():
        if name in body and not any(body[name] == h and type(body[name]) is type(h) for h in harmless):
            raise BadRequest(
                f"{name} is {shown(body[name])}: staticrt serve does not implement it, and ignoring it would "
                "answer something else than asked; leave it out",
                name,
            )
    stream, options = body.get("stream"), body.get("stream_options")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest(f"stream is {shown(stream)}; it must be true or false", "stream")
    if options is not None and (
        not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool)
    ):
        raise BadRequest(
            f'stream_options is {options!r}; it must be an object like {{"include_usage": true}}', "stream_options"
        )
    return bool(stream), bool((options or {}).get("include_usage"))


def completion_prompt(body: dict, tokenizer: Any, vocab: int) -> list[int]:
    """`prompt`: a string, token ids, or a list of one of either (one choice a request)."""
    for name, neutral in (("tools", (None, [])), ("tool_choice", (None, "none"))):
        if body.get(name) not in neutral:
            raise BadRequest(f"{name} is a chat field: send the conversation to /v1/chat/completions", name)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise BadRequest(
                "a text prompt needs the model's tokenizer.json, which it has none of; send token ids", "prompt"
            )
        if not prompt:
            raise BadRequest("prompt is empty", "prompt")
        return tokenizer.encode(_text(prompt, "prompt"))
    if isinstance(prompt, list):
        return _token_list(prompt, "prompt", vocab)
    raise BadRequest("prompt must be a string, a list of token ids, or a list of one of those", "prompt")


def chat_prompt(body: dict, tokenizer: Any) -> tuple[list[int], Tools | None]:
    """`messages` rendered with the model's chat template, with the request's tools (tools.py)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content}", "messages")
    plain = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a role and a content", "messages")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(str(p.get("text", "")) for p in content)
        if content is None and message.get("tool_calls"):  # an assistant's turn that only called tools
            plain.append({**message, "role": _text(message["role"], "messages")})
            continue
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", "messages")
        plain.append({**message, "role": _text(message["role"], "messages"), "content": _text(content, "messages")})
    tools = check_tools(body)
    if tokenizer is None:
        raise BadRequest("chat needs the model's tokenizer.json and chat template, which it has none of", "messages")
    try:  # vLLM's chat_template_kwargs: variables the template reads (Qwen3's enable_thinking)
        extra = check_template_kwargs(body.get("chat_template_kwargs"))
    except StaticrtError as err:
        raise BadRequest(str(err), "chat_template_kwargs") from None
    if "tools" in extra:
        raise BadRequest("chat_template_kwargs sets tools; send them in the request's tools", "chat_template_kwargs")
    plain, variables = template_messages(plain, tools, tokenizer.chat_template)
    try:
        return tokenizer.apply_chat_template(plain, template_kwargs={**extra, **variables}), tools
    except StaticrtError as err:
        raise BadRequest(str(err), "messages") from None


def completion_request(body: dict, prompt: list[int], limits: Limits, chat: bool, tokenizer: Any = None) -> Completion:
    """The scheduler's request from an OpenAI body, every field checked against `limits` (a JSON
    schema's grammar built for `tokenizer`)."""
    if body.get("model") != limits.model:
        raise BadRequest(
            f"model {body.get('model')!r} is not served here; this server serves {limits.model!r}", "model"
        )
    room = None if limits.max_sequence_len is None else limits.max_sequence_len - len(prompt)
    if room is not None and room < 1:
        raise BadRequest(
            f"the prompt is {len(prompt)} tokens and the context holds {limits.max_sequence_len}; shorten it",
            "messages" if chat else "prompt",
        )
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    name = next((n for n in names if body.get(n) is not None), names[-1])
    max_tokens = _integer(body, name, 1, (room or 4096) if chat else min(16, room or 16))
    if room is not None and max_tokens > room:
        raise BadRequest(
            f"{name} is {max_tokens}, but the prompt's {len(prompt)} tokens leave {room} of the context's "
            f"{limits.max_sequence_len}; ask for at most {room}",
            name,
        )
    own = limits.defaults.sampling(None, None, None)
    temperature = _number(body, "temperature", 0.0, 2.0, own["temperature"])
    top_p = _number(body, "top_p", 0.0, 1.0, own["top_p"], low_open=True)
    top_k = _integer(body, "top_k", 0, own["top_k"])
    seed = _integer(body, "seed", 0, None)
    stop = body.get("stop")
    try:
        stop = check_stops([stop] if isinstance(stop, str) else [] if stop is None else stop)
    except StaticrtError as err:
        raise BadRequest(str(err), "stop") from None
    stop = tuple(_text(s, "stop") for s in stop)
    stop_ids = body.get("stop_token_ids")
    stop_ids = [] if stop_ids in (None, []) else _token_list(stop_ids, "stop_token_ids", limits.vocab_size)
    grammar = response_grammar(body, tokenizer, limits.vocab_size, limits.eos_token_ids)
    rule = bias_fields(body, limits.vocab_size, grammar)
    logprobs = logprobs_asked(body, chat)
    sampling = SamplingParams(
        temperature > 0, temperature if temperature > 0 else 1.0, top_k, top_p, seed, rule, logprobs=logprobs
    )
    return Completion(prompt, max_tokens, sampling, tuple(limits.eos_token_ids) + tuple(stop_ids), stop)
