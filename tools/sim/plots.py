"""The serving benchmarks' figure: panels side by side, each a metric against concurrency, one
line per mode (``cxlemu bench serve --plot``, ``cxlemu sim serve --plot``, ``cxlemu sim sweep
--plot``). matplotlib is imported on use, with the Agg backend (no display needed)."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["plot_against_concurrency"]


def _y(value: Any) -> float:
    """A plotted value: None, NaN and infinities as NaN (a gap in the line)."""
    if value is None:
        return math.nan
    y = float(value)
    return y if math.isfinite(y) else math.nan


def plot_against_concurrency(lines: Mapping[str, Sequence[tuple[float, Mapping[str, Any]]]],
                             panels: Sequence[tuple[str, str, str | None]], path: Any, *, title: str,
                             xlabel: str = "concurrency", xticks: Sequence[float] | None = None,
                             panel_width: float = 5.5, dpi: int = 110, legend_size: float | None = 8) -> None:
    """Write one PNG to ``path``: per panel ``(key, y label, panel title or None)``, ``row[key]``
    against x for every ``mode -> [(x, row), ...]`` of ``lines``, the modes in their order, the
    legend on the first panel. An OSError from writing the file propagates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(panel_width * len(panels), 4.2), squeeze=False)
    try:
        for ax, (key, ylabel, panel_title) in zip(axes[0], panels, strict=True):
            for mode, points in lines.items():
                ax.plot([x for x, _ in points], [_y(row.get(key)) for _, row in points], marker="o", label=mode)
            ax.set(xlabel=xlabel, ylabel=ylabel)
            if panel_title:
                ax.set_title(panel_title)
            if xticks is not None:
                ax.set_xticks(list(xticks))
            ax.grid(True, alpha=0.3)
        axes[0][0].legend(fontsize=legend_size)
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
