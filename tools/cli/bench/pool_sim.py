"""`cxlemu bench pool --sim`: the fleet simulator on the bench's own workload, its hit rates
against the bench's measured ones (``tools.bench.pool_sim``); the parser is ``tools.cli.bench.pool``'s."""
from __future__ import annotations

import json
from typing import Any

from tools.cli._common import CliError
from tools.cli.bench import show


def cmd_pool_sim(args: Any) -> int:
    from tools.bench import pool_sim
    from tools.cli.bench.pool_serve import bench_config

    cfg = bench_config(args)
    measured = None
    if args.measured:
        try:
            measured = pool_sim.measured_from(args.measured)
        except OSError as exc:
            raise CliError(f"--measured: cannot read {args.measured}: {exc.strerror or exc}") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise CliError(f"--measured: {args.measured} is not a `cxlemu bench pool --save` report ({exc})") from None
    elif (cfg.requests, cfg.window, cfg.max_blocks, cfg.tier_blocks) != (40, 3000, 8, 512):
        raise CliError("--sim: the recorded figures are the default bench's (40 requests, window 3000, 8 blocks, "
                       "512 tier blocks; 2 or 3 engines); for another one give its saved report: --measured PATH")
    try:
        out = pool_sim.run(cfg, measured)
    except RuntimeError as exc:  # requests overlapped: the check would not be the bench's
        raise CliError(f"bench pool --sim: {exc}", exit_code=1) from None
    if args.export:
        with open(args.export, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(line) + "\n" for line in out["trace"])
    doc = {k: v for k, v in out.items() if k != "trace"}
    show(args.json, doc, lambda: _table(doc))
    return 0 if all(r["within_goal"] for r in out["rows"]) else 1


def _table(doc: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title=f"bench pool --sim: the fleet simulator on the bench's {doc['requests']} requests "
                    f"({doc['blocks']} blocks, {doc['distinct']} distinct), rr, one at a time; goal within 10 %")
    for col in ("mode", "sim --kv", "simulated hit rate", "HBM", "home", "measured", "ratio", "within 10 %"):
        t.add_column(col, justify="left" if col in ("mode", "sim --kv") else "right")
    for r in doc["rows"]:
        m = doc["modes"][r["mode"]]
        t.add_row(r["mode"], r["kv"], f"{r['simulated']:.3f}", f"{m['hbm_hit_rate']:.3f}", f"{m['home_hit_rate']:.3f}",
                  "-" if r["measured"] is None else f"{r['measured']:.3f}",
                  "-" if r["ratio"] is None else f"{r['ratio']:.3f}", "yes" if r["within_goal"] else "NO")
    return t
