"""Chat templates from the checkpoint, rendered as transformers renders them, in a jinja2 sandbox.

A template is code shipped with a checkpoint, so it runs in jinja2's `ImmutableSandboxedEnvironment`
(no attribute access to internals, no mutation of what it is given) with only the helpers chat
templates are written against: `raise_exception`, `strftime_now` and a `tojson` filter that keeps
non-ASCII text as it is. Whitespace settings (trim_blocks, lstrip_blocks) and the loop-control
extension are transformers' own, so the rendered text, and therefore the token ids, are the same.
Imports no torch.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, GenerationError, read_json_object

Message = dict[str, Any]  # {"role": "system" | "user" | "assistant" | ..., "content": str}


def read_chat_template(folder: Path) -> str | None:
    """The checkpoint's template: `chat_template.jinja`, else tokenizer_config.json's `chat_template`
    (a string, or a list of named templates of which "default" is taken); None when it has none."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise CheckpointError(
                f"{jinja} is not UTF-8 text (byte {err.start} is {jinja.read_bytes()[err.start]:#04x}); "
                "restore the checkpoint's chat_template.jinja"
            ) from None
    template = read_tokenizer_config(folder).get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def read_tokenizer_config(folder: Path) -> dict[str, Any]:
    """tokenizer_config.json as a dict ({} when absent), or a CheckpointError naming the file."""
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return {}
    return read_json_object(path, CheckpointError, "restore the checkpoint's tokenizer_config.json")


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        from jinja2.exceptions import TemplateError

        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **options: Any) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **options)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(template)


def check_template_kwargs(kwargs: Any, what: str = "chat_template_kwargs") -> dict[str, Any]:
    """Extra variables for the template (Qwen3's `enable_thinking`, ...), as vLLM's
    `chat_template_kwargs` passes them: a JSON object whose keys are names the template reads,
    never the conversation's own (`messages`, `add_generation_prompt`)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise GenerationError(
            f'{what} is {kwargs!r}; pass an object of names to values, e.g. {{"enable_thinking": false}}'
        )
    taken = sorted({"messages", "add_generation_prompt"} & set(kwargs))
    if taken:
        raise GenerationError(f"{what} sets {', '.join(taken)}, which the conversation itself gives; leave it out")
    return dict(kwargs)


def render_chat(
    template: str | None,
    messages: list[Message],
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str] | None = None,
    source: str = "the checkpoint",
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The conversation as the text the model was trained on; errors name the message or template.
    `template_kwargs`: extra variables the template reads (`check_template_kwargs`)."""
    from jinja2.exceptions import TemplateError

    if template is None:
        raise CheckpointError(
            f"{source} has no chat template (neither chat_template.jinja nor tokenizer_config.json's "
            "chat_template); chat needs one: use a chat/instruct checkpoint, or pass the prompt as text"
        )
    if not isinstance(messages, list) or not messages:
        raise GenerationError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise GenerationError(f"message {i} is {message!r}; each message is a dict with a 'role' and 'content'")
    try:
        variables = {**(special_tokens or {}), **check_template_kwargs(template_kwargs)}
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
    except TemplateError as err:
        raise GenerationError(f"the chat template of {source} refused the conversation: {err}") from None
    except Exception as err:  # the template's own code failed (a None added to a string, say): still its refusal
        raise GenerationError(
            f"the chat template of {source} failed on the conversation ({type(err).__name__}: {err}); check the "
            "messages' roles and order against what the template expects"
        ) from None
