"""The refusal of a request's field (HTTP 400 in OpenAI's error shape), shared by the modules that check fields."""

from __future__ import annotations

from typing import Any

from ..errors import StaticrtError


class BadRequest(StaticrtError):
    """A request field out of its limits; `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def shown(value: Any) -> str:
    """A client's value for an error message, cut short: a message never echoes a megabyte back."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
