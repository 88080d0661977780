"""The command lines of `cxlemu bench ...`: one module per bench, each with ``register(bench)``
(its parser, on the subparsers ``tools/cli/cmd_bench.py`` hands it) and its handler (the flags
checked, the library's measurement called with plain values, its result printed). What they
measure is in ``tools.bench``, ``tools.trace.bench`` and ``tools.monitor.bench``."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tools.cli._common import print_json


def show(as_json: bool, data: Any, render: Callable[[], Any]) -> None:
    """A bench's result on stdout: ``data`` as JSON (``--json``), else the rich renderable that
    ``render()`` builds (only then: rich is imported for a table alone)."""
    if as_json:
        print_json(data)
    else:
        from rich.console import Console

        Console().print(render())
