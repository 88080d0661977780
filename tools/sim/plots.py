"""The serving benchmarks' figure: panels side by side, each a metric against concurrency, one
line per mode (``cxlemu bench serve --plot``, ``cxlemu sim serve --plot``, ``cxlemu sim sweep
--plot``: :func:`write_plots`, one figure per group of a sweep's rows). matplotlib is imported on
use, with the Agg backend (no display needed)."""
from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tools.sim.grid import NA
from tools.sim.modes import SIM_MODES

__all__ = ["plot_against_concurrency", "plot_groups", "write_plots"]


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


def _slug(v: Any) -> str:
    text = f"{v:g}" if isinstance(v, float) else str(v)
    return re.sub(r"[^A-Za-z0-9.=_-]+", "_", text).strip("_") or "x"


def plot_groups(rows: Sequence[Mapping[str, Any]]) -> dict[tuple[Any, ...], dict[str, list[Mapping[str, Any]]]]:
    """(model, accelerator, tp, workload, cost model, pool, policy) -> mode -> rows. ``none`` and ``host-lru``
    (no pool, no policy) are drawn in every group of their (model, accelerator, tp, workload),
    ``cxl-lru`` (no policy) in every policy group of its pool."""
    ok = [r for r in rows if "error" not in r]
    out: dict[tuple[Any, ...], dict[str, list[Mapping[str, Any]]]] = {}

    def base_of(r: Mapping[str, Any]) -> tuple[Any, ...]:
        return r["model"], r["accelerator"], r.get("tp", 1), r["workload"], r.get("cost_model", "roofline")

    for base in sorted({base_of(r) for r in ok}):
        mine = [r for r in ok if base_of(r) == base]
        pools = sorted({r["pool_gb"] for r in mine if r["pool_gb"] != NA}) or [NA]
        policies = sorted({r["policy"] for r in mine if r["policy"] != NA}) or [NA]
        for pool, policy in itertools.product(pools, policies):
            lines: dict[str, list[Mapping[str, Any]]] = {}
            for r in mine:
                if r["pool_gb"] not in (NA, pool) or r["policy"] not in (NA, policy):
                    continue
                lines.setdefault(r["mode"], []).append(r)
            if lines:
                out[(*base, pool, policy)] = {m: sorted(v, key=lambda r: r["concurrency"])
                                              for m, v in sorted(lines.items(), key=lambda kv: SIM_MODES.index(kv[0])
                                                                 if kv[0] in SIM_MODES else len(SIM_MODES))}
    return out


def write_plots(rows: Sequence[Mapping[str, Any]], prefix: str | Path) -> list[Path]:
    """One PNG per (model, accelerator, tp, workload, cost model, pool, policy): output tokens/s and
    TTFT p99 against concurrency, one line per mode, and $/Mtok when priced. Returns the paths
    written, ``<prefix>-<model>-<accelerator>[-tp<N>][-profile]-<workload>-pool<GB>-<policy>.png``
    (``-tp<N>`` when N > 1, ``-profile`` for the profile cost model)."""
    prefix = Path(prefix)
    if prefix.parent != Path(""):
        prefix.parent.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    for (model, acc, tp, wl, cost, pool, policy), lines in plot_groups(rows).items():
        priced = any(r.get("usd_per_million_tokens") is not None for rs in lines.values() for r in rs)
        panels: list[tuple[str, str, str | None]] = [("output_tokens_per_s", "output tokens/s", None),
                                                     ("ttft_p99_ms", "TTFT p99 (ms)", None)]
        if priced:
            panels.append(("usd_per_million_tokens", "$ / M output tokens", None))
        pool_txt = NA if pool == NA else f"{pool:,.0f} GB"
        inst, tp_txt = (acc, "") if tp == 1 else (f"{tp} x {acc}", f"-tp{tp}")
        if cost != "roofline":  # the default cost model keeps the names of before
            inst, tp_txt = f"{inst} ({cost})", f"{tp_txt}-{cost}"
        path = prefix.with_name(f"{prefix.name}-{_slug(model)}-{_slug(acc)}{tp_txt}-{_slug(wl)}-pool{_slug(pool)}"
                                f"-{_slug(policy)}.png")
        plot_against_concurrency({mode: [(r["concurrency"], r) for r in rs] for mode, rs in lines.items()}, panels,
                                 path, title=f"{model} on {inst}, {wl}, pool {pool_txt}, policy {policy}",
                                 panel_width=5.2, dpi=100, legend_size=None)
        paths.append(path)
    return paths
