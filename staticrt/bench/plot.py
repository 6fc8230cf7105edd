"""`staticrt bench --plot FILE.png`: ms/token per backend, each bar beside the time its decode step
would take at the weight-streaming rate measured beside it (the bound the table's "% bound" is
against). Backends sort by name, so a variant (`compiled-int8`) sits beside its float original.
Needs matplotlib (the `plot` extra); drawn off-screen."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import GenerationError
from .machine import describe


def plot_report(report: dict[str, Any], path: Path) -> None:
    """Draw `report` (run_bench's) into `path`, atomically; the format is the file's suffix."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise GenerationError("--plot draws with matplotlib: pip install 'staticrt[plot]'") from None
    path = Path(path)
    suffix = path.suffix.lstrip(".").lower() or "png"
    results = dict(sorted(report["backends"].items()))
    names = list(results)
    step = [r["decode_ms_per_token"] for r in results.values()]
    bound = [r["decode_ms_per_token"] * r["streaming_fraction"] for r in results.values()]
    with_kv = [r["decode_ms_per_token"] * r["streaming_fraction_with_kv"] for r in results.values()]
    figure, axes = plt.subplots(figsize=(8, 1.8 + 0.5 * len(names)))
    rows = range(len(names))
    axes.barh(rows, step, color="#4c72b0", label="decode ms/token (measured)")
    axes.scatter(with_kv, rows, marker="|", s=600, color="#c44e52", zorder=3, label="weights + K/V at that rate")
    axes.scatter(bound, rows, marker="|", s=400, color="black", zorder=4, label="weights at the streaming rate")
    for row, ms in zip(rows, step):
        axes.annotate(f"{ms:.2f}", (ms, row), xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
    axes.set_yticks(list(rows), names)
    axes.invert_yaxis()
    axes.set_xlim(0, 1.12 * max(step + with_kv))
    axes.set_xlabel("ms per decode step (lower is better)")
    machine = report["machine"]
    axes.set_title(
        f"{report['model']}, batch {report['batch_size']}, {report['device']}, {describe(machine)}",
        fontsize=10,
    )
    axes.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.5 / (1 + 0.3 * len(names))), ncol=3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    figure.savefig(tmp, format=suffix, dpi=120)
    plt.close(figure)
    tmp.replace(path)
