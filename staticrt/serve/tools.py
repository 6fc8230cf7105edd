"""OpenAI's `tools`, `tool_choice` and tool messages, checked and put where the chat template reads them.

The template renders the tools (Qwen2.5/Qwen3, Llama 3.x and SmolLM3's templates take a `tools`
variable, as transformers' `apply_chat_template(tools=...)` passes it). A template that ignores
them (SmolLM2's) gets them as Qwen2.5's template writes them, in the system message, with calls and
results in Hermes' tags, the form its function-calling data used. The model then calls as it
chooses under `tool_choice` "auto"; "required" and a named function make it call (`Tools.forcing`:
the call's form and arguments kept by a grammar).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from ..errors import GenerationError, StaticrtError
from ..generation.grammar import Grammar
from ..generation.logit_bias import BiasRule
from ..text.chat_template import render_chat
from ..text.tool_calls import CLOSE, OPEN, ToolCall, parse_tool_calls
from .bad_request import BadRequest, shown
from .job import Completion

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's limit on a function's name


@dataclass(frozen=True)
class Tools:
    """A request's tools: as sent (what the template reads) and their names (what a call may name)."""

    specs: tuple[dict, ...]
    names: frozenset[str]
    parallel: bool  # parallel_tool_calls: False keeps a reply's first call only
    forced: frozenset[str] = frozenset()  # tool_choice "required" (every name) or a named function

    def forcing(self, request: Completion, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> Completion:
        """`request`, made to call one of the `forced` tools: its reply is one call in Hermes' tags,
        the name one of them and the arguments a document of that tool's parameters (a grammar,
        generation/grammar.py, in the row's logit bias), whatever form the model would choose."""
        if not self.forced:
            return request
        rule = request.sampling.rule or BiasRule()
        if rule.grammar is not None:
            raise BadRequest(
                "tool_choice forces a call and response_format or grammar a document; send one of them", "tool_choice"
            )
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": spec["function"]["name"]},
                    "arguments": spec["function"].get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for spec in self.specs
            if spec["function"]["name"] in self.forced
        ]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        try:
            grammar = Grammar(tokenizer, schema, vocab_size, eos_token_ids, frame=(f"{OPEN}\n", f"\n{CLOSE}"))
        except GenerationError as err:  # a tool's parameters that are no schema llguidance compiles
            raise BadRequest(f"tool_choice: {err}", "tools") from None
        return replace(request, sampling=replace(request.sampling, rule=replace(rule, grammar=grammar)))

    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole answer's content and calls (`parse_tool_calls`)."""
        content, calls = parse_tool_calls(text, self.names)
        return content, self.kept(calls)

    def kept(self, calls: list[ToolCall]) -> list[ToolCall]:
        return calls if self.parallel else calls[:1]


def check_tools(body: dict) -> Tools | None:
    """The request's tools when the model may call them (None with none, or `tool_choice` "none")."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none"):
            raise BadRequest(f"tool_choice is {shown(choice)} but no tools were given; send tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise BadRequest('tools must be a list of {"type": "function", "function": {...}}', "tools")
    names = [_check_tool(i, tool) for i, tool in enumerate(tools)]
    if len(set(names)) < len(names):
        raise BadRequest(f"tools name a function twice ({sorted(names)}); give each once", "tools")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise BadRequest(f"parallel_tool_calls is {shown(parallel)}; it must be true or false", "parallel_tool_calls")
    if choice in (None, "auto"):
        return Tools(tuple(tools), frozenset(names), parallel)
    if choice == "none":
        return None
    function = choice.get("function") if isinstance(choice, dict) else None
    named = function.get("name") if isinstance(function, dict) else None
    if named is not None and named not in names:
        raise BadRequest(
            f"tool_choice names {shown(named)}, which is not among the tools {sorted(names)}", "tool_choice"
        )
    if choice != "required" and named is None:
        raise BadRequest(
            f'tool_choice is {shown(choice)}; it is "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    return Tools(tuple(tools), frozenset(names), parallel, frozenset(names) if named is None else frozenset([named]))


def _check_tool(i: int, tool: Any) -> str:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
        raise BadRequest(f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}', "tools")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise BadRequest(f"tools[{i}].function.name is {shown(name)}; use 1-64 of a-z, A-Z, 0-9, _ and -", "tools")
    if not isinstance(function.get("parameters", {}), dict):
        raise BadRequest(f"tools[{i}].function.parameters must be a JSON Schema object", "tools")
    return name


def template_messages(messages: list[dict], tools: Tools | None, template: str | None) -> tuple[list[dict], dict]:
    """The conversation and the variables the template is given: tool calls' arguments as objects
    (as transformers' templates read them, and vLLM gives them); for a template that does not take
    tools, the tools, calls and results written into the messages instead."""
    plain = [_template_message(i, m) for i, m in enumerate(messages)]
    if tools is None:
        return plain, {}
    if template is not None and takes_tools(template):
        return plain, {"tools": list(tools.specs)}
    return _written_in(plain, tools), {}


def _template_message(i: int, message: dict) -> dict:
    out = {k: v for k, v in message.items() if k in ("role", "content", "name", "tool_call_id")}
    calls = message.get("tool_calls")
    if calls is None:
        return out
    if message["role"] != "assistant" or not isinstance(calls, list):
        raise BadRequest(f"messages[{i}].tool_calls: only an assistant's message holds a list of them", "messages")
    out["tool_calls"] = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else None
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict) or not isinstance(function.get("name"), str):
            raise BadRequest(
                f"messages[{i}].tool_calls[{j}] must hold a function with a name and its arguments as a JSON "
                "object's text, as the reply gave them",
                "messages",
            )
        out["tool_calls"].append({**call, "function": {"name": function["name"], "arguments": arguments}})
    return out


@lru_cache(maxsize=16)
def takes_tools(template: str) -> bool:
    """Whether the template renders a `tools` variable: a probe tool's name shows in its text."""
    probe = {"type": "function", "function": {"name": "staticrt_probe_tool", "parameters": {}}}
    try:
        text = render_chat(template, [{"role": "user", "content": "x"}], template_kwargs={"tools": [probe]})
    except StaticrtError:
        return False
    return "staticrt_probe_tool" in text


def _written_in(messages: list[dict], tools: Tools) -> list[dict]:
    """Qwen2.5's tool prompt in the system message; calls and results in Hermes' tags."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools.specs)
    prompt = (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        f'{OPEN}{CLOSE} XML tags:\n{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}'
    )
    system = messages[0].get("content") if messages and messages[0]["role"] == "system" else None
    out = [{"role": "system", "content": f"{system}\n\n{prompt}" if system else prompt}]
    for message in messages[1:] if system is not None else messages:
        if message.get("tool_calls"):
            calls = [json.dumps(c["function"], ensure_ascii=False) for c in message["tool_calls"]]
            written = "\n".join([message.get("content") or "", *(f"{OPEN}\n{c}\n{CLOSE}" for c in calls)])
            message = {"role": "assistant", "content": written.strip()}
        elif message["role"] == "tool":
            message = {"role": "user", "content": f"<tool_response>\n{message.get('content', '')}\n</tool_response>"}
        out.append(message)
    return out
