"""Calling a compiled graph without dynamo's guard check, through one private torch API.

Every call of a `torch.compile`d function goes through dynamo's frame hook, which finds the cache
entry and checks its guards (shape, stride, dtype and device of every weight, buffer and input).
Within one generation nothing the guards check can change, so after a graph's guards have passed
once the compiled backend calls the code dynamo ran for it directly (docs/measurements.md has the
cost saved). The code comes from `torch._C._dynamo.eval_frame._debug_get_cache_entry_list`, which
torch does not promise to keep: if it changes, `code_past_guards` warns once and returns None, and
the backend goes through dynamo as usual (the same tokens, slower); tests/test_compiled.py fails
loudly so the change is seen.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from typing import Any

import torch

_WARNED: set[str] = set()


class GuardSkipWarning(RuntimeWarning):
    """torch's private cache-entry API changed: compiled steps go through dynamo's guards every call."""


def code_past_guards(compiled: Any) -> Callable[..., Any] | None:
    """The code dynamo ran on `compiled`'s last call, as a plain function that fetches the
    weights, buffers and inputs and calls the compiled graph, with no frame hook and no guards;
    None, with a warning, where torch no longer offers it. Dynamo keeps a code object's cache
    entries most recently used first, so the first entry is the one whose guards just passed."""
    try:
        original = compiled._torchdynamo_orig_callable  # the function torch.compile wrapped
        entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list(original.__code__)
        code = entries[0].code
        bypass = types.FunctionType(code, original.__globals__, code.co_name, original.__defaults__)
        bypass.__kwdefaults__ = original.__kwdefaults__  # the defaults the graph was traced with
        return bypass
    except (AttributeError, IndexError, TypeError) as err:
        reason = f"{type(err).__name__}: {err}"
        if reason not in _WARNED:
            _WARNED.add(reason)
            warnings.warn(
                f"torch {torch.__version__} no longer offers the cache entries of a compiled function ({reason}); "
                "compiled steps go through dynamo's guard check on every call: the same tokens, a little slower. "
                "Pin torch to the version pyproject.toml names, or report it",
                GuardSkipWarning,
                stacklevel=2,
            )
        return None
