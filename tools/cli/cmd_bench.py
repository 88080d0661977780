"""`cxlemu bench ...`: probes and benchmarks.

``BENCHES`` names each bench and the module of ``tools/cli/bench`` holding its command line: a
``register_<name>(bench_subparsers)`` adding one sub-subcommand whose parser sets ``func``, and
the handler (flags checked, the measuring library called with plain values, its result printed).
What a bench measures lives in ``tools.bench`` (or ``tools.trace.bench``, ``tools.monitor.bench``).
To add ``cxlemu bench NAME``, give its module a ``register_NAME`` and append it here (the order
``cxlemu bench --help`` lists them in); a module that fails to import is skipped with a note in
``cxlemu bench --help`` rather than breaking every other command.
"""
from __future__ import annotations

import argparse
import importlib

_TIMING, _KV, _DEVICE, _SERVING = ("tools.cli.bench.timing", "tools.cli.bench.kv", "tools.cli.bench.device",
                                   "tools.cli.bench.serving")
_QUALITY = "tools.cli.bench.quality"
BENCHES: dict[str, str] = {  # name -> module, in the order `cxlemu bench --help` lists them
    "latency": _TIMING,
    "bandwidth": _TIMING,
    "overhead": _TIMING,
    "fidelity": _TIMING,
    "kv": _KV,
    "quality": _QUALITY,
    "mailbox": _DEVICE,
    "liveness": _DEVICE,
    "tier": _KV,
    "fwmodel": _KV,
    "serve": _SERVING,
    "sim": _SERVING,
    "telemetry": _DEVICE,
    "pool": "tools.cli.bench.pool",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure the device: latency, bandwidth, overhead, ...")
    bench = p.add_subparsers(dest="bench", metavar="BENCH", parser_class=type(p))
    bench.required = True
    missing: dict[str, str] = {}
    for name, module_name in BENCHES.items():
        if module_name in missing:
            continue
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            missing[module_name] = f"{module_name} ({exc})"
            continue
        getattr(module, f"register_{name}")(bench)
    if missing:
        p.epilog = "unavailable: " + "; ".join(missing.values())
