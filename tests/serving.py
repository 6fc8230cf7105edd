"""The official `openai` client pointed at a staticrt server on loopback (`running`)."""

from __future__ import annotations

from typing import Any

from staticrt.serve import serving_on_loopback as running  # noqa: F401  (the tests' name for it)


def client(url: str, **kw: Any) -> Any:
    """An `openai.OpenAI` for the server at `url`, which never retries (a retry would hide a refusal)."""
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)
