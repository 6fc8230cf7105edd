"""Tool calls in a model's text: read out of what it wrote, whole or as it streams.

Models trained for tools write a call in one of a few forms, and the form is the checkpoint's, not
the server's choice:

- Hermes' (Qwen2.5, Qwen3, SmolLM3, Hermes, and SmolLM2's function-calling data):
  `<tool_call>{"name": "f", "arguments": {...}}</tool_call>`, one block a call, or one block
  holding a JSON list of calls (SmolLM2's);
- Llama 3.x's JSON tool calling: the whole answer is `{"name": "f", "parameters": {...}}`.

A call counts only when its JSON parses and names a tool the request gave; anything else stays
text, as vLLM's parsers leave it. Imports no torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (OpenAI's `arguments`)."""

    name: str
    arguments: str


def _calls_in(value: Any, names: frozenset[str]) -> list[ToolCall] | None:
    """The calls a parsed JSON value holds (an object or a list of them), or None where any is not one."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as JSON text already
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append(ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls or None


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse_tool_calls(text: str, names: frozenset[str]) -> tuple[str | None, list[ToolCall]]:
    """(the text left as content, None when nothing is; the calls) from a whole answer. With
    no call found, the text is returned as it was."""
    if OPEN in text:
        calls: list[ToolCall] = []
        for block in _BLOCK.finditer(text):
            found = _calls_in(_json(block.group(1).strip()), names)
            if found is None:
                return text, []
            calls += found
        content = _BLOCK.sub("", text)
        return (content if content.strip() else None), calls
    stripped = text.strip()
    if stripped.startswith("{"):
        found = _calls_in(_json(stripped), names)
        if found is not None:
            return None, found
    return text, []


class ToolCallStream:
    """Text pieces in, content safe to send out: everything before a call can begin streams as
    it comes; from a possible call on (`<tool_call>`, or a `{` opening the answer) the text is
    held, and `finish` reads it whole. A held piece that proves not to be a call is sent then."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.sent: list[str] = []
        self.held = ""
        self.holding = False  # a call may have begun: hold everything to the end

    def push(self, piece: str) -> str:
        """The part of `piece` (with what was held before it) that is content for certain."""
        if self.holding:
            self.held += piece
            return ""
        text = self.held + piece
        at_start = not any(s.strip() for s in self.sent)
        if at_start and not text.strip():  # the answer has not begun: it may begin with `{`
            self.held = text
            return ""
        start = 0 if at_start and text.lstrip().startswith("{") else text.find(OPEN)
        if start >= 0:
            self.holding, self.held = True, text[start:]
            return self._send(text[:start])
        keep = _partial_marker(text)  # the tail that may be the start of `<tool_call>`
        self.held = text[len(text) - keep :]
        return self._send(text[: len(text) - keep])

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the content still to send, the calls) at the end of the answer."""
        held, self.held = self.held, ""
        if not held:
            return "", []
        content, calls = parse_tool_calls(held, self.names)
        if not calls:
            return self._send(held), []
        return self._send(content or ""), calls

    def _send(self, text: str) -> str:
        if text:
            self.sent.append(text)
        return text


def _partial_marker(text: str) -> int:
    """How many characters at the end of `text` are a proper prefix of `<tool_call>`: a worked
    example: "see <tool_" ends with "<tool_", 6 characters, held until the next piece says."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0
