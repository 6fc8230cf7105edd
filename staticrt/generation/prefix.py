"""Which part of a new prompt a cache row can keep: llama.cpp's slot design, in fixed rows.

A row remembers the token ids its cache holds, in the order they were fed (generated ids as
generated, never re-tokenised text). A prompt that starts with some of them prefills only the
rest, from the position where the two part: a chat's next turn prefills the turn, a server's
request that shares a system prompt prefills what follows it. Whether continuing from position P
is exact depends on the row's layers (masks.py computes every mask from positions):

- a linear layer (slot j holds position j) continues from any P: entries at P and beyond are
  hidden by position until the continuation overwrites them;
- a rotating layer of L slots reads slot s as the newest position below P that falls in it. A
  slot whose newest entry t lies in [P, H] (H: positions the row holds; position H counts too,
  since a server's idle step scribbles there) is read as t - L, which a query at P sees when
  P - (t - L) < window. So the layer continues from P when H < L (it never wrapped), or when
  H - P <= L - window. Worked, L = window = 4, H = 6: slots 0..3 hold 4, 5, 6 (scribbled), 3.
  From P = 6, slot 2 reads as 2, and 6 - 2 = 4 is not < 4: hidden, exact. From P = 5 it is
  seen (5 - 2 = 3 < 4): not exact. A buffer of window + k slots may back off k positions; a
  layer that attends to every slot it holds (a sink layer) only while it has not wrapped;
- a recurrent state (a Mamba2 or DeltaNet layer's, caches/recurrent.py) holds the row after every position it
  fed and cannot go back: it continues from H alone. It is the layout (0, 0), for which the rule
  above reads H - P <= 0.

Imports no torch: the loop and the scheduler use it with every backend.
"""

from __future__ import annotations

from collections.abc import Sequence

Layouts = tuple[tuple[int, int | None], ...]  # each rotating layer: (slots, window; None: sees every slot)
RECURRENT = (0, 0)  # a recurrent state: continues only from where it stopped


def rotating_layouts(
    layers: Sequence[str],
    layer_lengths: Sequence[int],
    layer_types: Sequence[str],
    sliding_window: int | None,
    conv_kernel: int = 0,
) -> Layouts:
    """The distinct rotating layers of a cache, from the layouts it reports (`KVCache.layer_layout`:
    "static", "offloaded", "sliding", "sink", "conv", "mamba", "deltanet", as an artifact's
    manifest records them), its layers' slots and the model's attention kinds. A conv layer reads
    its last `conv_kernel` inputs: a window of that many (caches/conv_state.py); a Mamba2 or
    DeltaNet layer too, and it keeps a recurrent state."""
    found = set()
    for layout, slots, attention in zip(layers, layer_lengths, layer_types, strict=True):
        if layout in ("conv", "mamba", "deltanet"):
            found.add((int(slots), conv_kernel))
            if layout != "conv":
                found.add(RECURRENT)
        elif layout in ("sliding", "sink"):
            found.add(
                (int(slots), sliding_window if layout == "sliding" and attention == "sliding_attention" else None)
            )
    return tuple(sorted(found, key=lambda pair: (pair[0], pair[1] or 0)))


def common_prefix(held: Sequence[int], prompt: Sequence[int]) -> int:
    """How many leading ids `held` and `prompt` share."""
    n = 0
    for a, b in zip(held, prompt):
        if a != b:
            break
        n += 1
    return n


def kept_prefix(held: Sequence[int], prompt: Sequence[int], rotating: Layouts) -> int:
    """Prompt tokens a row holding `held` keeps: the longest common prefix, backed off to leave
    one prompt token to prefill (its logits choose the first new token), or 0 where a rotating
    layer cannot continue from there exactly (the module docstring)."""
    kept = min(common_prefix(held, prompt), len(prompt) - 1)
    return kept if kept > 0 and continues(len(held), kept, rotating) else 0


def continues(over: int, position: int, rotating: Layouts) -> bool:
    """Whether a row whose rotating layers were written up to position `over` continues exactly
    from `position` <= `over` (the module docstring's rule)."""
    return all(over < slots or (window is not None and over - position <= slots - window) for slots, window in rotating)


def draft_room(position: int, k: int, rotating: Layouts) -> int:
    """Drafted tokens (at most `k`) a row may feed after its next token at `position` in one
    verify step (speculative.py), so that it continues exactly after any rejection: writing
    `position + d`, the row may resume from `position + 1`. Linear layers allow any d; a buffer
    of `window` slots, once wrapped, allows 1 (its first draft only), one of `window + j`, j + 1;
    a recurrent state none (it would hold every draft, the rejected ones too)."""
    if RECURRENT in rotating:
        return 0
    return next((d for d in range(k, 0, -1) if continues(position + d, position + 1, rotating)), 0)


def mark_cut_tails(held: list[list[int]], cut: Sequence[int], kept: Sequence[int], rotating: Layouts) -> None:
    """A row continued from a kept prefix may still hold, in a rotating layer's slots, what it held
    past that prefix: mark those positions -1 (never a token id; `kept_prefix` then keeps no
    more than it may), unless the row has since written every slot."""
    span = max((slots for slots, _ in rotating), default=0)
    for r, k in enumerate(kept):
        if len(held[r]) - k < span:
            held[r].extend([-1] * (cut[r] - len(held[r])))
