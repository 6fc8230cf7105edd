"""The checkpoint's tokenizer (tokenizer.json, by the tokenizers library alone: an ONNX deploy reads
it without torch), its chat template, and text streamed as it is generated.

Streaming decodes each new token in the context of the tokens before it, as text-generation-
inference does: a byte-level BPE token can end in the middle of a UTF-8 character ("日" is three
bytes, an emoji four) and a SentencePiece token's leading space depends on what precedes it, so a
token decoded alone prints `�` or loses a space. `TextStream` holds a piece back until it decodes
to whole characters; joined, the pieces are the final decoded text.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, GenerationError, first_line
from ..host import return_freed_memory
from .chat_template import Message, read_chat_template, read_tokenizer_config, render_chat

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def check_text(text: str, name: str = "the text") -> str:
    """`text`, or a GenerationError where it holds a lone surrogate: bytes that were not UTF-8 (a
    command line or a pipe read with surrogateescape, JSON's unpaired "\\ud800"), which no tokenizer encodes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise GenerationError(
            f"{name} is not valid UTF-8 (character {err.start} is a lone surrogate, {text[err.start]!r}); "
            "send UTF-8 text"
        ) from None
    return text


class Tokenizer:
    """tokenizer.json with the chat template and special tokens of tokenizer_config.json. A template
    that cannot be read fails the chats that need it (`template_error`), not the plain prompts."""

    def __init__(
        self,
        backend: Any,
        chat_template: str | None,
        special_tokens: dict[str, str],
        source: str,
        template_error: CheckpointError | None = None,
    ) -> None:
        self.backend = backend  # a tokenizers.Tokenizer
        self.chat_template = chat_template
        self.special_tokens = special_tokens
        self.source = source
        self.template_error = template_error

    @cached_property
    def json(self) -> str:
        """tokenizer.json as the tokenizers library writes it (1.5 MB for SmolLM2's, ~15 ms): what
        llguidance reads, once a model rather than once a request."""
        return self.backend.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(check_text(text), add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int] | str:
        """The conversation rendered by the checkpoint's template: its token ids (the template holds
        the special tokens, so none are added, as in transformers), or with `tokenize=False` its text.
        `template_kwargs`: extra variables it reads (Qwen3's `enable_thinking`, ...)."""
        if self.template_error is not None:
            raise self.template_error
        text = render_chat(
            self.chat_template, messages, add_generation_prompt, self.special_tokens, self.source, template_kwargs
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def stream(self) -> TextStream:
        return TextStream(self)


class TextStream:
    """Feed token ids one or a few at a time; get text pieces that are whole UTF-8 characters."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] were already shown; they give the next piece its context
        self.read = 0

    def push(self, *tokens: int) -> str:
        """The text `tokens` complete ("" while a character is still incomplete)."""
        self.ids.extend(tokens)
        shown = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        if len(text) <= len(shown) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(shown) :]

    def flush(self) -> str:
        """What is still held back at the end (an incomplete character decodes as U+FFFD, as in the final text)."""
        shown = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(shown) :]


def load_tokenizer(folder: Path) -> Tokenizer | None:
    """The tokenizer of a checkpoint or artifact folder, or None where it has no tokenizer.json."""
    from tokenizers import Tokenizer as Backend

    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        backend = Backend.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for any parse error
        reason = first_line(err)
        raise CheckpointError(
            f"{path} cannot be read by the tokenizers library ({reason}); restore the checkpoint's tokenizer.json"
        ) from None
    return_freed_memory()  # what the parse let go (SmolLM2's: 17 MB)
    config = read_tokenizer_config(Path(folder))
    special = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value  # an AddedToken's dict form
        if isinstance(value, str):
            special[name] = value
    try:
        template, unreadable = read_chat_template(Path(folder)), None
    except CheckpointError as err:
        template, unreadable = None, err
    return Tokenizer(backend, template, special, str(folder), unreadable)
