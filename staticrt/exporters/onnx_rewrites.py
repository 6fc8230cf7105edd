"""onnxscript's rewrite rules as torch.onnx.export applies them, its one multi-output rule tried
only where it can match.

The exporter optimizes every graph with onnxscript's default rewrite rules (`optimize=True`). One
of them, SlicesSplit (two Slices of one input become a Split), has two output nodes, and
onnxscript's matcher (0.7) tries such a pattern at every node of the graph by first listing all
the graph's nodes by op type: N^2 lookups a pass. SmolLM2's graph (30 layers) made 18 million of
them, and its export took 29.1 s against 22.2 s with the rule tried at Slice nodes alone; a tiny
model's graph, a few hundred nodes, gains nothing (docs/measurements.md). The pattern's first
output node is a Slice, so no other node can start a match: the graph comes out byte for byte the
same.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from ..cpp_builds.shared_patch import SharedPatch


def _first_output_at_its_op(rule: Any) -> Any:
    """`rule` (a multi-output RewriteRule) as one that declines, before matching, a node whose
    op is not its pattern's first output node's."""
    from onnxscript.rewriter import _rewrite_rule

    if not isinstance(rule, _rewrite_rule.RewriteRule):  # a rule of another kind keeps its own matching
        return rule
    wanted = rule._target_pattern.output_nodes[0].op_identifier()  # (domain, op_type, overload)
    if wanted is None:  # a pattern node of any op: every node can start it
        return rule

    class FirstOutputFirst(type(rule)):  # type: ignore[misc]
        def try_rewrite(self, model: Any, graph: Any, node: Any, **options: Any) -> Any:
            if node.op_identifier() != wanted:
                return None
            return super().try_rewrite(model, graph, node, **options)

    guarded = object.__new__(FirstOutputFirst)
    guarded.__dict__.update(rule.__dict__)
    return guarded


def _install() -> Callable[[], None]:
    from onnxscript import rewriter

    rules = rewriter._DEFAULT_REWRITE_RULES
    rewriter._DEFAULT_REWRITE_RULES = tuple(
        rule if rule._target_pattern.has_single_output_node else _first_output_at_its_op(rule) for rule in rules
    )

    def undo() -> None:
        rewriter._DEFAULT_REWRITE_RULES = rules

    return undo


_PATCH = SharedPatch(_install, "onnxscript's rewrite rules applied as they are")


def multi_output_rules_at_their_op() -> AbstractContextManager[None]:
    """While inside, torch.onnx.export's optimizer tries a multi-output rule only at nodes of its
    first output node's op (SharedPatch: on another onnxscript, the rules as they are)."""
    return _PATCH.active()
