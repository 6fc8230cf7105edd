"""Tool calling through the server (issue 66): `tools` rendered by the model's own chat template (or
written into the system message where the template ignores them), calls read out of the answer
whole and streamed, through the official `openai` client, and `role: tool` results taken back.

The model that calls is a real checkpoint saved by transformers whose weights write one answer: a
one-layer Llama with its attention and MLP outputs zeroed, so each position's hidden state is its
own token's embedding, and a head that maps each token to the next of a chain. Its last prompt
token `assistant:` starts `<tool_call> {"name": "get_weather", ...} </tool_call>` and the end of
text, in word tokens; transformers' greedy generate gives the same tokens (checked below)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from staticrt.text.tool_calls import ToolCall, ToolCallStream, parse_tool_calls

NAMES = frozenset({"get_weather", "get_time"})
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.mark.parametrize(
    "text,content,calls",
    [
        (f"<tool_call>\n{WEATHER}\n</tool_call>", None, [("get_weather", '{"city": "Paris"}')]),
        (  # Qwen's several blocks, with text before them
            f'Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{{"name": "get_time", '
            '"arguments": "{\\"zone\\": \\"CET\\"}"}\n</tool_call>',
            "Let me look.\n\n",
            [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')],
        ),
        (f"<tool_call>[{WEATHER}, {WEATHER}]</tool_call>", None, [("get_weather", '{"city": "Paris"}')] * 2),
        ('  {"name": "get_time", "parameters": {}}', None, [("get_time", "{}")]),  # Llama 3.x's JSON form
        (f"<tool_call>{WEATHER}", None, [("get_weather", '{"city": "Paris"}')]),  # its end tag cut by the stop
        # not calls: an unknown function, JSON that does not parse, an object that is not a call
        ('<tool_call>{"name": "send_mail", "arguments": {}}</tool_call>', "same", []),
        ('<tool_call>{"name": "get_time", "arguments": {</tool_call>', "same", []),
        ('{"city": "Paris"}', "same", []),
        ("It is sunny in Paris.", "same", []),
    ],
)
def test_calls_are_read_in_each_form_and_anything_else_stays_text(text, content, calls):
    got_content, got_calls = parse_tool_calls(text, NAMES)
    assert got_content == (text if content == "same" else content)
    assert got_calls == [ToolCall(name, arguments) for name, arguments in calls]


ANSWERS = [
    f"Sure.\n<tool_call>\n{WEATHER}\n</tool_call>",
    f" <tool_call>{WEATHER}</tool_call> done",
    '\n{"name": "get_time", "parameters": {"zone": "UTC"}}',
    '{"name": "nope"} and text',
    "a < b, and <tool the rest <tool_call",
    "plain text only",
]


@given(st.sampled_from(ANSWERS), st.lists(st.integers(1, 12), max_size=40))
def test_a_stream_cut_anywhere_sends_the_whole_answers_content_and_calls(answer, cuts):
    """However the text arrives, what streams plus what `finish` gives is the whole answer's reading;
    and no piece of a call is ever sent as content."""
    stream, sent, at = ToolCallStream(NAMES), [], 0
    for size in cuts:
        sent.append(stream.push(answer[at : at + size]))
        at += size
    sent.append(stream.push(answer[at:]))
    rest, calls = stream.finish()
    content, whole_calls = parse_tool_calls(answer, NAMES)
    assert "".join(sent) + rest == (content or "") and calls == whole_calls
    assert not any("<tool_call>" in piece or '"name"' in piece for piece in sent) or not whole_calls


# --- a checkpoint whose answer is a call --------------------------------------------------------

CALL_WORDS = ["<tool_call>", '{"name":', '"get_weather",', '"arguments":', '{"city":', '"Paris"}}', "</tool_call>"]
WORDS = ["<unk>", "<eos>", "assistant:", "user:", "tool:", "system:", "tools:", "get_weather", "weather?", "sunny"]
VOCAB = {w: i for i, w in enumerate(WORDS + CALL_WORDS)}
# the tools as its template writes them, each call as it was made, and each message's words
TEMPLATE = (
    "{%- if tools %}tools: {% for t in tools %}{{ t.function.name }} {% endfor %}{% endif %}"
    "{%- for m in messages %}{{ m.role }}: {% if m.content %}{{ m.content }} {% endif %}"
    "{%- for c in m.tool_calls or [] %}<tool_call> {{ c.function | tojson }} </tool_call> {% endfor %}{% endfor %}"
    "{%- if add_generation_prompt %}assistant: {% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture(scope="module")
def caller(tmp_path_factory):
    """(folder, transformers' model): the checkpoint that answers `assistant:` with the call."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    size = len(VOCAB)
    config = transformers.LlamaConfig(
        vocab_size=size, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, eos_token_id=VOCAB["<eos>"], bos_token_id=None,
        tie_word_embeddings=False,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(config).eval()
    chain = ["assistant:", *CALL_WORDS, "<eos>"]
    following = {VOCAB[a]: VOCAB[b] for a, b in zip(chain, chain[1:], strict=False)}
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(torch.eye(size, 32))  # token i: the i-th unit vector
        hf.model.layers[0].self_attn.o_proj.weight.zero_()
        hf.model.layers[0].mlp.down_proj.weight.zero_()
        head = torch.zeros(size, 32)
        for token in range(size):
            head[following.get(token, VOCAB["<eos>"]), token] = 10.0  # a margin of 57: sampled, it still calls
        hf.lm_head.weight.copy_(head)
    folder = tmp_path_factory.mktemp("caller")
    hf.save_pretrained(folder)
    words = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.decoder = decoders.WordPiece()  # joins the words with spaces
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<eos>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)
    return folder, hf, fast


@pytest.fixture(scope="module")
def served(caller):
    pytest.importorskip("fastapi", reason="serving needs the serve extra: use the README's test command")
    from serving import client, running

    import staticrt
    from staticrt.serve import serve_backend

    model = staticrt.load_model(caller[0])
    gen = staticrt.Generator(model, max_batch_size=2, max_cache_len=128)
    app, _ = serve_backend(gen.backend, model.tokenizer, name="caller")
    with running(app) as url:
        yield client(url)


def transformers_ids(caller, messages: list[dict], tools: list | None) -> list[int]:
    _, _, fast = caller
    return fast.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)["input_ids"]


def test_the_call_comes_back_parsed_whole_and_streamed_with_transformers_tokens(caller, served):
    ask = [{"role": "user", "content": "weather?"}]
    reply = served.chat.completions.create(model="caller", messages=ask, tools=TOOLS, max_tokens=16, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
        "function",
        "get_weather",
        {"city": "Paris"},
    )
    assert call.id.startswith("call_")
    prompt = transformers_ids(caller, ask, TOOLS)  # the tools rendered by the template, as transformers does
    assert reply.usage.prompt_tokens == len(prompt)
    want = caller[1].generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt) :].tolist()
    assert choice.model_extra["token_ids"] == want  # the call's words and the end of text

    chunks = list(
        served.chat.completions.create(
            model="caller", messages=ask, tools=TOOLS, max_tokens=16, temperature=0, stream=True
        )
    )
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == ""  # no piece of the call streamed as text
    [streamed] = [t for d in deltas for t in d.tool_calls or []]
    assert (streamed.index, streamed.function.name, streamed.function.arguments) == (
        0,
        "get_weather",
        call.function.arguments,
    )
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == want


def test_a_tool_result_is_taken_back_and_rendered_as_transformers_renders_it(caller, served):
    from staticrt.serve.protocol import chat_prompt

    first = served.chat.completions.create(
        model="caller", messages=[{"role": "user", "content": "weather?"}], tools=TOOLS, max_tokens=16, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    turn = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    reply = served.chat.completions.create(model="caller", messages=turn, tools=TOOLS, max_tokens=4)
    assert reply.choices[0].finish_reason in ("tool_calls", "stop", "length")
    # transformers' templates read a call's arguments as an object, as vLLM passes them
    theirs = [turn[0], {**turn[1], "tool_calls": [{**call.model_dump(), "function": {"name": "get_weather",
              "arguments": {"city": "Paris"}}}]}, turn[2]]  # fmt: skip
    import staticrt

    tokenizer = staticrt.load_model(caller[0]).tokenizer
    ids, tools = chat_prompt({"messages": turn, "tools": TOOLS}, tokenizer)
    assert ids == transformers_ids(caller, theirs, TOOLS) and tools.names == {"get_weather"}
    assert reply.usage.prompt_tokens == len(ids)


def test_tool_choice_none_leaves_the_tools_out_and_the_answer_as_text(caller, served):
    ask = [{"role": "user", "content": "weather?"}]
    reply = served.chat.completions.create(
        model="caller", messages=ask, tools=TOOLS, tool_choice="none", max_tokens=16, temperature=0
    )
    assert reply.usage.prompt_tokens == len(transformers_ids(caller, ask, None))
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == " ".join(CALL_WORDS)


def test_a_template_without_tools_gets_them_in_the_system_message():
    from staticrt.serve.tools import Tools, takes_tools, template_messages

    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    assert takes_tools(TEMPLATE) and not takes_tools(plain)
    tools = Tools((TOOLS[0],), frozenset({"get_weather"}), True)
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turn = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    messages, variables = template_messages(turn, tools, plain)
    assert variables == {} and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools\n")
    assert f"<tools>\n{json.dumps(TOOLS[0])}\n</tools>" in messages[0]["content"]
    assert (
        messages[2]["content"]
        == f"<tool_call>\n{json.dumps(call['function'] | {'arguments': {'city': 'Paris'}})}\n</tool_call>"
    )
    assert messages[3]["content"] == "<tool_response>\nsunny\n</tool_response>"


@pytest.mark.parametrize(
    "fields,param,message",
    [
        (
            {"tool_choice": {"type": "function", "function": {"name": "mail"}}},
            "tool_choice",
            "names 'mail', which is not",
        ),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "tools[0].function.name is 'a b'"),
        ({"tools": TOOLS * 2}, "tools", "name a function twice"),
        ({"tools": [], "tool_choice": "auto"}, "tool_choice", "no tools were given"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "must be true or false"),
        ({"tool_choice": {"type": "function", "function": "get_weather"}}, "tool_choice", 'it is "none", "auto"'),
    ],
)
def test_tool_fields_it_cannot_honour_get_400_naming_them(served, fields, param, message):
    import openai

    body = {"model": "caller", "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS, **fields}
    with pytest.raises(openai.BadRequestError) as err:
        served.chat.completions.create(**body)
    assert err.value.body["param"] == param and message in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        served.completions.create(model="caller", prompt="weather?", extra_body={"tools": TOOLS})
    assert err.value.body["param"] == "tools"
