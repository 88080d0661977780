"""``cxlemu sim sweep``: many simulated points as tasks on a Dask cluster; a table, JSON, CSV, plots.

The points are the grid's (:mod:`tools.sim.grid`); each is one task (:func:`run_sweep`) on a
``distributed.LocalCluster`` of one single-threaded worker process per core, or on an existing
cluster (``--address tcp://host:port``; its workers must import this checkout). A point that
fails becomes a row with an ``error`` key; the sweep goes on. Prices: :mod:`tools.sim.pricing`;
JSON and CSV: :mod:`tools.sim.export`; plots: :mod:`tools.sim.plots`; the table: the CLI's.

Why Dask and not Ray: ``distributed`` is a pure-Python wheel that installs in seconds on CI, its
LocalCluster starts in about two seconds on a two-core host, and the same ``Client`` API talks to
a remote scheduler. Ray's wheel is 60 MB and more, and its local cluster needs gigabytes of RAM and
several seconds to start: too heavy for tasks of 0.05-2 s each.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from tools.sim.grid import point_fields, sort_key
from tools.sim.run import Point, simulate

__all__ = ["run_sweep"]


def _run_point(p: Point) -> dict[str, Any]:
    """One task: ``simulate(p)``'s metrics and the point's fields, or the fields and ``error``."""
    ident = point_fields(p)
    try:
        metrics = simulate(p)
    except Exception as e:  # noqa: BLE001 - a failed point is a row, not a crashed sweep
        return {**ident, "error": f"{type(e).__name__}: {e}"}
    return {**metrics, **ident}


def run_sweep(points: Sequence[Any], *, address: str | None = None, workers: int | None = None,
              progress: Callable[[int, int, dict[str, Any]], None] | None = None,
              task: Callable[[Any], dict[str, Any]] = _run_point, fields: Callable[[Any], dict[str, Any]] = point_fields,
              order: Callable[[Any], Any] = sort_key) -> list[dict[str, Any]]:
    """Run every point as a task on a LocalCluster (``workers`` processes, default one per
    core) or on the scheduler at ``address``; the rows sorted by :func:`sort_key`. A task that
    fails (a lost worker, an exception) is a row with ``error``. ``progress(done, total, row)``
    is called as each row arrives. Other kinds of points (the fleet's) bring their ``task``,
    the identifying ``fields`` of a failed one's row and the rows' ``order``."""
    import logging
    from contextlib import ExitStack

    from distributed import Client, LocalCluster, as_completed

    points = list(points)
    if not points:
        return []
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        if address is None:
            cluster = stack.enter_context(LocalCluster(
                n_workers=workers or os.cpu_count() or 1, threads_per_worker=1, processes=True,
                dashboard_address=None, silence_logs=logging.ERROR))
            client = stack.enter_context(Client(cluster))
        else:
            client = stack.enter_context(Client(address))
        futures = client.map(task, points, pure=False)
        index = {f.key: i for i, f in enumerate(futures)}
        for fut in as_completed(futures):
            if fut.status == "finished":
                row = fut.result()
            else:
                exc = fut.exception()
                row = {**fields(points[index[fut.key]]), "error": f"{type(exc).__name__}: {exc}"}
            fut.release()
            rows.append(row)
            if progress is not None:
                progress(len(rows), len(points), row)
    rows.sort(key=order)
    return rows
