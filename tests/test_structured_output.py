"""Structured output (issue 66): a JSON schema kept by masking, in the step's logit bias, every
token llguidance says cannot continue a document of it (generation/grammar.py). On the real
SmolLM2, and on the tiny families through a byte-level tokenizer of their 256 tokens: greedy tokens
equal transformers' `generate` with a logits processor over the same library's matcher; a GBNF or
Lark grammar likewise; through the official `openai` client, `response_format` json_schema on 20
schemas and json_object, greedy and sampled, every reply parses and validates (`jsonschema`);
a schema that does not compile is a 400 naming the field."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from conftest import FAMILIES
from hf_models import NEW_FAMILIES

import staticrt

llguidance = pytest.importorskip("llguidance", reason="structured output needs the serve extra (llguidance)")
jsonschema = pytest.importorskip("jsonschema", reason="the replies are validated with jsonschema: the test extra")

NAME = {"type": "string", "maxLength": 16}
INT = {"type": "integer", "minimum": -1000, "maximum": 1000}
DEGREES = {"type": "number", "minimum": -180, "maximum": 180, "multipleOf": 0.01}  # its digits bounded too
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
    {"type": "object", "properties": {"city": NAME, "country": NAME}, "required": ["city", "country"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}}, "required": ["answer"]},
    {
        "type": "object",
        "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.5}},
        "required": ["score"],
    },
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "maxItems": 3}}, "required": ["tags"]},
    {
        "type": "object",
        "properties": {
            "person": {"type": "object", "properties": {"first": NAME, "last": NAME}, "required": ["first"]}
        },
        "required": ["person"],
    },
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["n"]},
    {
        "type": "object",
        "properties": {
            "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}
        },
        "required": ["colors"],
    },  # fmt: skip
    {
        "type": "object",
        "properties": {
            "x": DEGREES,
            "y": DEGREES,
        },
        "required": ["x", "y"],
    },
    {
        "type": "object",
        "properties": {"title": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
        "required": ["title", "year"],
    },  # fmt: skip
    {
        "type": "object",
        "properties": {"unit": {"enum": ["C", "F"]}, "value": INT},
        "required": ["unit", "value"],
    },  # fmt: skip
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": {"type": "object", "properties": {"id": INT}, "required": ["id"]},
            }
        },  # fmt: skip
        "required": ["items"],
    },
    {"type": "object", "properties": {"capital": NAME}, "required": ["capital"], "additionalProperties": False},
    {
        "type": "object",
        "properties": {"a": INT, "b": INT, "sum": INT},
        "required": ["a", "b", "sum"],
    },  # fmt: skip
    {
        "type": "object",
        "properties": {
            "lang": {"enum": ["python", "rust", "c"]},
            "stars": {"type": "integer", "minimum": 0, "maximum": 5},
        },
        "required": ["lang"],
    },  # fmt: skip
    {
        "type": "object",
        "properties": {"price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000, "multipleOf": 0.01}},
        "required": ["price"],
    },  # fmt: skip
    {
        "type": "object",
        "properties": {"meta": {"type": "object", "properties": {"v": INT}}},
        "required": ["meta"],
    },  # fmt: skip
    {
        "type": "object",
        "properties": {"words": {"type": "array", "items": NAME, "minItems": 2, "maxItems": 2}},
        "required": ["words"],
    },  # fmt: skip
    {
        "type": "object",
        "properties": {"done": {"type": "boolean"}, "step": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["done", "step"],
    },  # fmt: skip
]
QUESTION = "Tell me about Paris as JSON."


def strict(schema):
    """`schema` with no properties beyond those named, at every level: what OpenAI's strict mode
    asks of a schema (a 135M model given room for any key goes on inventing them)."""
    if isinstance(schema, dict):
        schema = {key: strict(value) for key, value in schema.items()}
        return {"additionalProperties": False, **schema} if "properties" in schema else schema
    return [strict(value) for value in schema] if isinstance(schema, list) else schema


SCHEMAS = [strict(schema) for schema in SCHEMAS]


class LLGuidance:
    """transformers' logits processor over llguidance's own matcher: the reference's mask."""

    def __init__(self, grammar: staticrt.Grammar) -> None:
        import llguidance.numpy as lln

        self.matcher, self.lln = llguidance.LLMatcher(grammar.tokenizer, grammar.grammar), lln
        self.mask, self.started = lln.allocate_token_bitmask(1, grammar.vocab_size), False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.started:
            assert self.matcher.consume_token(int(input_ids[0, -1]))
        self.started = True
        self.lln.fill_next_token_bitmask(self.matcher, self.mask, 0)
        allowed = np.unpackbits(self.mask.view(np.uint8), bitorder="little")[: scores.shape[1]]
        return scores.masked_fill(torch.from_numpy(allowed == 0)[None], float("-inf"))


def test_greedy_tokens_equal_transformers_with_the_same_librarys_mask(smollm2, hf_smollm2):
    from transformers import LogitsProcessorList

    model = staticrt.load_model(smollm2)
    eos = list(model.config.eos_token_ids)
    prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    gen = staticrt.Generator(model, max_batch_size=3, max_cache_len=256)
    grammars = [staticrt.json_schema_grammar(model, schema) for schema in SCHEMAS[:3]]
    ours = [gen.generate([prompt], 60, grammar=g, stop_token_ids=eos)[0] for g in grammars]
    ids = torch.tensor([prompt])
    for grammar, tokens, schema in zip(grammars, ours, SCHEMAS, strict=False):
        processors = LogitsProcessorList([LLGuidance(grammar)])
        out = hf_smollm2[0].generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=60, do_sample=False,
            logits_processor=processors, eos_token_id=eos, pad_token_id=0,
        )  # fmt: skip
        assert tokens == out[0, len(prompt) :].tolist()
        assert tokens[-1] in eos
        jsonschema.validate(json.loads(model.tokenizer.decode(tokens)), schema)
    free = gen.generate([prompt], 20, stop_token_ids=eos)[0]
    with pytest.raises(json.JSONDecodeError):  # what the schema changed: unconstrained, it answers in prose
        json.loads(model.tokenizer.decode(free))


def byte_tokenizer():
    """A byte-level tokenizer of 256 tokens, one a byte (GPT-2's byte-to-character map, no merges):
    the tiny families' vocabulary, which llguidance reads as it reads SmolLM2's BPE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from staticrt.text.tokenizer import Tokenizer as Ours

    chars = bytes_to_unicode()
    backend = Tokenizer(models.BPE({chars[b]: b for b in range(256)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return Ours(backend, None, {}, "bytes")


BOUNDED = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}, "b": {"enum": ["x", "yz"]}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("family", [*FAMILIES, *NEW_FAMILIES, "lfm2", "qwen3_moe"])
def test_the_tiny_families_constrained_tokens_equal_transformers_with_the_same_mask(hf_checkpoints, family):
    """Random weights under a schema: every token is the argmax of what llguidance allows, here as
    in transformers' `generate` masked by the same matcher (token 0, the byte 0, ends the document)."""
    from transformers import LogitsProcessorList

    folder, hf = hf_checkpoints[family]
    grammar = staticrt.Grammar(byte_tokenizer(), BOUNDED, 256, [0])
    prompt = list(b'Answer in JSON: {"a": 7, "b": "x"} ')
    gen = staticrt.Generator(staticrt.load_model(folder), max_cache_len=128)
    tokens = gen.generate([prompt], 40, grammar=grammar, stop_token_ids=[0])[0]
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
        logits_processor=LogitsProcessorList([LLGuidance(grammar)]), eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    assert tokens == out[0, len(prompt) :].tolist() and tokens[-1] == 0
    jsonschema.validate(json.loads(bytes(tokens[:-1])), BOUNDED)


# The same grammar in llama.cpp's GBNF and in Lark: an answer, a reason in lower case, a full stop
GBNF = 'root ::= ("Yes" | "No") ", " [a-z ]{1,60} "."'
LARK = 'start: ("Yes" | "No") ", " /[a-z ]{1,60}/ "."'
YES_NO = r"(Yes|No), [a-z ]{1,60}\."


def test_a_gbnf_or_lark_grammar_gives_transformers_tokens_with_the_same_librarys_mask(smollm2, hf_smollm2):
    from transformers import LogitsProcessorList

    model = staticrt.load_model(smollm2)
    eos = list(model.config.eos_token_ids)
    prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": "Is Paris the capital of France?"}])
    gen = staticrt.Generator(model, max_cache_len=256)
    gbnf, lark = staticrt.text_grammar(model, GBNF), staticrt.text_grammar(model, LARK)
    tokens = gen.generate([prompt], 40, grammar=gbnf, stop_token_ids=eos)[0]
    assert gen.generate([prompt], 40, grammar=lark, stop_token_ids=eos)[0] == tokens
    ids = torch.tensor([prompt])
    out = hf_smollm2[0].generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
        logits_processor=LogitsProcessorList([LLGuidance(gbnf)]), eos_token_id=eos, pad_token_id=0,
    )  # fmt: skip
    assert tokens == out[0, len(prompt) :].tolist() and tokens[-1] in eos
    assert re.fullmatch(YES_NO, model.tokenizer.decode(tokens)), model.tokenizer.decode(tokens)
    with pytest.raises(staticrt.GenerationError, match="^the grammar does not compile: "):
        staticrt.text_grammar(model, "root ::= (")


@pytest.fixture(scope="module")
def served(smollm2):
    """SmolLM2 served on loopback (eager, 8 rows) as `staticrt serve` serves it: a prompt prefills in
    a batch-1 prefiller, and fewer busy rows than 8 decode in a narrower twin (without one, each
    request's prefill computed all 8 rows: its 253-token tool prompt 4x the time). Its URL."""
    pytest.importorskip("fastapi", reason="serving needs the serve extra: use the README's test command")
    from serving import running

    from staticrt.serve import serve_backend

    model = staticrt.load_model(smollm2)
    backend, prefiller = (staticrt.Generator(model, max_batch_size=n, max_cache_len=512).backend for n in (8, 1))
    app, _ = serve_backend(backend, model.tokenizer, name="smollm2", prefiller=prefiller)
    with running(app) as url:
        yield url


def test_response_format_through_the_openai_client_always_parses_and_validates(served):
    from serving import client

    url = served
    messages = [{"role": "user", "content": QUESTION}]
    api = client(url)

    def ask(i: int) -> tuple[dict, str, str | None]:
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i], "strict": True}}
        sampling = dict(temperature=0) if i % 2 == 0 else dict(temperature=1.0, seed=i)
        reply = api.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=200, response_format=fmt, **sampling
        )
        return SCHEMAS[i], reply.choices[0].message.content, reply.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:  # the server's 8 rows decode them side by side
        replies = list(pool.map(ask, range(len(SCHEMAS))))
    for schema, content, finish_reason in replies:
        assert finish_reason == "stop", (schema, content)
        jsonschema.validate(json.loads(content), schema)
    one_key = [{"role": "user", "content": "Give the capital of France as a JSON object with one key."}]
    fmt = {"type": "json_object"}
    streamed = api.chat.completions.create(
        model="smollm2", messages=one_key, max_tokens=200, response_format=fmt, temperature=0, stream=True
    )
    assert json.loads("".join(c.choices[0].delta.content or "" for c in streamed if c.choices)) == {"capital": "Paris"}
    for fmt, message in [
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
            "the JSON schema does not compile: ",
        ),  # fmt: skip
        ({"type": "xml"}, "response_format is {'type': 'xml'}; it is {\"type\": \"text\"}"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema is None"),
    ]:
        body = {"model": "smollm2", "messages": messages, "response_format": fmt}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body)
        assert (reply.status_code, reply.json()["error"]["param"]) == (400, "response_format")
        assert reply.json()["error"]["message"].startswith(message)


def test_the_grammar_field_takes_gbnf_or_lark_and_names_a_bad_one(served):
    """llama.cpp's server's `grammar` field, through the `openai` client's extra_body; sampled too."""
    from serving import client

    api = client(served)
    messages = [{"role": "user", "content": "Is Paris the capital of France?"}]
    for grammar, sampling in ((GBNF, dict(temperature=0)), (LARK, dict(temperature=1.0, seed=3))):
        reply = api.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=60, extra_body={"grammar": grammar}, **sampling
        )
        assert reply.choices[0].finish_reason == "stop"
        assert re.fullmatch(YES_NO, reply.choices[0].message.content), reply.choices[0].message.content
    fmt = {"type": "json_object"}
    for extra, message in [
        ({"grammar": "root ::= ("}, "the grammar does not compile: "),
        ({"grammar": 5}, 'grammar is 5; send a grammar in GBNF (root ::= "yes" | "no") or Lark'),
        ({"grammar": GBNF, "response_format": fmt}, "grammar and response_format both constrain the answer"),
    ]:
        reply = httpx.post(f"{served}/v1/chat/completions", json={"model": "smollm2", "messages": messages, **extra})
        assert (reply.status_code, reply.json()["error"]["param"]) == (400, "grammar")
        assert reply.json()["error"]["message"].startswith(message)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": strict({"type": "object", "properties": {"city": NAME}, "required": ["city"]}),
    },
}
ZONE = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": strict(ZONE)}}


def test_tool_choice_required_or_named_always_calls_a_given_tool(served):
    """SmolLM2's template takes no tools (tools.py writes them into the system message), and asked
    about the weather it answers in prose under "auto"; "required" and a named function make the
    reply one call in Hermes' tags whose arguments validate, whole and streamed."""
    from serving import client

    api = client(served)
    ask = dict(
        model="smollm2", messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=80, temperature=0
    )
    free = api.chat.completions.create(**ask, tools=[WEATHER, CLOCK], tool_choice="auto")
    assert free.choices[0].finish_reason == "stop" and not free.choices[0].message.tool_calls
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, names in [("required", {"get_weather", "get_time"}), (named, {"get_time"})]:
        reply = api.chat.completions.create(**ask, tools=[WEATHER, CLOCK], tool_choice=choice)
        assert reply.choices[0].finish_reason == "tool_calls", reply.choices[0].message
        (call,) = reply.choices[0].message.tool_calls
        assert call.function.name in names
        tool = WEATHER if call.function.name == "get_weather" else CLOCK
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        chunks = list(api.chat.completions.create(**ask, tools=[WEATHER, CLOCK], tool_choice=choice, stream=True))
        streamed = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
        assert streamed[0].function.name == call.function.name
        assert "".join(d.function.arguments or "" for d in streamed) == call.function.arguments
    body = {**ask, "tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}
    reply = httpx.post(f"{served}/v1/chat/completions", json=body)
    assert (reply.status_code, reply.json()["error"]["param"]) == (400, "tool_choice")


def test_the_serve_bench_times_the_mask_a_token_a_row(smollm2, tmp_path):
    """`bench-serve --structured`'s figure: llguidance's mask written into a bias row, then the
    token taken, over the tokens of JSON documents; a tokenizer llguidance cannot read is named."""
    from staticrt.bench.serve_bench import checkpoint_folder, mask_cost
    from staticrt.text.tokenizer import load_tokenizer

    model = staticrt.load_model(smollm2)
    cost = mask_cost(model.tokenizer, model.config.vocab_size, model.config.eos_token_ids, repeats=1)
    assert cost["mask_tokens_timed"] == 78 and 0 < cost["mask_us_per_token_per_row"] < 100_000
    wordpiece = load_tokenizer(checkpoint_folder("tiny-llama", tmp_path))  # the tiny presets' tokenizer
    with pytest.raises(staticrt.GenerationError, match="^llguidance cannot read this model's tokenizer.json"):
        staticrt.Grammar(wordpiece, {"type": "object"}, 512, [0])
