"""`cxlemu bench ...`: probes and benchmarks.

Each benchmark lives in a module exposing ``register(bench_subparsers)``, which adds one
sub-subcommand whose parser sets ``func``.  To add ``cxlemu bench kv`` (or ``fwmodel``), append
its module to ``BENCH_MODULES``; a module that fails to import is skipped with a note in
``cxlemu bench --help`` rather than breaking every other command.
"""
from __future__ import annotations

import argparse
import importlib

BENCH_MODULES = [
    "tools.bench.latency",
    "tools.bench.bandwidth",
    "tools.bench.overhead",
    "tools.bench.fidelity",
    "tools.bench.kv",
    "tools.bench.mailbox",
    "tools.bench.liveness",
    "tools.bench.tier",
    "tools.trace.bench",
    "tools.bench.serve",
    "tools.bench.sim",
    "tools.monitor.bench",
]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure the device: latency, bandwidth, overhead, ...")
    bench = p.add_subparsers(dest="bench", metavar="BENCH", parser_class=type(p))
    bench.required = True
    missing = []
    for name in BENCH_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            missing.append(f"{name} ({exc})")
            continue
        module.register(bench)
    if missing:
        p.epilog = "unavailable: " + "; ".join(missing)
