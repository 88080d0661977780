"""`cxlemu bench pool --races`: hosts racing on the shared KV pool, every load checked
(``tools.bench.pool``); without ``--races``, vLLM engines sharing the pool against private tiers
(``tools.cli.bench.pool_serve``); with ``--sim``, the fleet simulator on that
workload (``tools.cli.bench.pool_sim``)."""
from __future__ import annotations

import signal
from typing import Any

from tools.cli._common import CliError, parse_size
from tools.cli.bench import show


def register_pool(bench: Any) -> None:
    p = bench.add_parser("pool", help="the shared KV pool: --races (publish / lookup / load from several hosts)")
    p.add_argument("--races", action="store_true", help="the race bench: stale, torn and leaked counted")
    p.add_argument("--processes", type=int, default=3, help="host processes (default 3, at most 7)")
    p.add_argument("--ops", type=int, default=1_000_000, help="operations in all (default 1,000,000)")
    p.add_argument("--pool-size", default="16M", help="the index extent (default 16M: ~3,900 slots of 4 KiB)")
    p.add_argument("--no-release", action="store_true", help="no extent release mid-run")
    p.add_argument("--seed", type=int, default=0, help="seeds every host's choices (default 0)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    serve = p.add_argument_group("without --races: vLLM engines on one device, a shared pool against private tiers "
                                 "(prefixes from the Mooncake trace)")
    serve.add_argument("--engines", type=int, default=2, help="vLLM-CPU engines, one host port each (2-3; default 2)")
    serve.add_argument("--requests", type=int, default=40, help="requests kept from the trace (default 40)")
    serve.add_argument("--window", type=int, default=3000, help="trace lines scanned for prefix reuse (default 3000)")
    serve.add_argument("--max-blocks", type=int, default=8, help="trace blocks kept per request (default 8)")
    serve.add_argument("--tier-blocks", type=int, default=512,
                       help="the tiers' total in vLLM blocks: the pool, or split over private tiers (default 512)")
    serve.add_argument("--staging-blocks", type=int, default=32,
                       help="shared mode: each engine's own tier (default 32)")
    serve.add_argument("--trace", help="the Mooncake conversation trace (default: ../shared/traces/ beside the checkout)")
    serve.add_argument("--plot", default="pool.png", help="PNG path (default pool.png); '' for none")
    serve.add_argument("--save", metavar="PATH", help="also write the whole report (every request) to PATH")
    sim = p.add_argument_group("--sim: no engines; the fleet simulator (cxlemu sim fleet) on the same workload, its hit "
                               "rates against the bench's measured ones (goal: within 10 %)")
    sim.add_argument("--sim", action="store_true", help="the check (the engine flags above set the workload)")
    sim.add_argument("--measured", metavar="PATH", help="a --save report to compare with (default: the figures in "
                     "BENCHMARKS.md)")
    sim.add_argument("--export", metavar="PATH", help="also write the workload as a Mooncake trace (cxlemu sim fleet "
                     "--trace)")
    p.set_defaults(func=cmd_pool)


def cmd_pool(args: Any) -> int:
    if args.sim and not args.races:
        from tools.cli.bench.pool_sim import cmd_pool_sim

        return cmd_pool_sim(args)
    if not args.races:
        from tools.cli.bench.pool_serve import cmd_pool_serve

        return cmd_pool_serve(args)
    from tools.bench import pool
    from tools.bench.mailbox import SoakError

    kw = dict(processes=args.processes, ops=args.ops, pool_size=parse_size(args.pool_size))
    try:
        pool.validate(**kw)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    from rich.console import Console

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM as Ctrl-C: stop the hosts and the server, destroy the device

    console = Console(stderr=True)
    previous = signal.signal(signal.SIGTERM, interrupted)
    try:
        with console.status("bench pool --races") as status:
            result = pool.run_races(**kw, seed=args.seed, release=not args.no_release,
                                    progress=lambda m: status.update(f"bench pool: {m}"))
    except SoakError as exc:
        raise CliError(str(exc), exit_code=1) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    show(args.json, result.to_dict(), lambda: render_races(result))
    return 0 if result.ok else 1


def render_races(r: Any) -> Any:
    from rich.table import Table

    t = Table(title=f"shared KV pool races: {r.processes} host processes, firmware in its own process",
              show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value", justify="right")
    for label, value in (("operations", f"{r.ops:,}"), ("stale reads", r.stale), ("torn reads", r.torn),
                         ("leaked allocations", r.leaked_allocations), ("loads checked", f"{r.loads_checked:,}"),
                         ("published", f"{r.published:,}"), ("evictions", f"{r.evictions:,}"),
                         ("extent revocations seen", r.revocations), ("wall", f"{r.wall_s:.1f} s")):
        t.add_row(label, str(value))
    for e in r.errors:
        t.add_row("error", e)
    return t
