"""The benches of the device's own machinery, their arguments and output: `cxlemu bench mailbox`
(the cross-process mailbox soak: ``tools.bench.mailbox``), `bench liveness` (a killed server to
DeviceGone: ``tools.bench.liveness``) and `bench telemetry` (the telemetry page's cost:
``tools.monitor.bench``)."""
from __future__ import annotations

import signal
from typing import Any

from tools.bench import liveness, mailbox
from tools.bench.liveness import TARGET_MS
from tools.bench.mailbox import KINDS, MAX_HOSTS, SoakError, SoakResult
from tools.cli._common import CliError, parse_size, print_json
from tools.cli.bench import show


def register_mailbox(bench: Any) -> None:
    p = bench.add_parser("mailbox", help="cross-process mailbox soak: every answer checked, with data-path load")
    p.add_argument("--commands", type=int, default=1_000_000, help="commands in all (default 1,000,000)")
    p.add_argument("--hosts", type=int, default=2, help=f"host processes sending them (default 2, at most {MAX_HOSTS})")
    p.add_argument("--load-procs", type=int, default=1, help="data-path load processes (default 1; 0: none)")
    p.add_argument("--load-bytes", default="64K", help="bytes per data-path write and read back (default 64K)")
    p.add_argument("--capacity", default="256M", help="the private device's size (default 256M)")
    p.add_argument("--seed", type=int, default=0, help="seeds every process's choices (default 0)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    p.set_defaults(func=cmd_mailbox)


def cmd_mailbox(args: Any) -> int:
    kw = dict(commands=args.commands, hosts=args.hosts, load_procs=args.load_procs,
              load_bytes=parse_size(args.load_bytes), capacity=parse_size(args.capacity))
    try:
        mailbox.validate(**kw)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    from rich.console import Console

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM as Ctrl-C: stop the processes, the server, destroy the device

    console = Console(stderr=True)
    previous = signal.signal(signal.SIGTERM, interrupted)
    try:
        with console.status("bench mailbox") as status:
            result = mailbox.run(**kw, seed=args.seed, progress=lambda m: status.update(f"bench mailbox: {m}"))
    except SoakError as exc:
        raise CliError(str(exc), exit_code=1) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    show(args.json, result.to_dict(), lambda: render_mailbox(result))
    return 0 if result.ok else 1


def render_mailbox(r: SoakResult) -> Any:
    from rich.console import Group
    from rich.table import Table

    t = Table(title=f"mailbox soak: {r.hosts} host processes, firmware in its own process, "
                    f"{r.load_procs} data-path load process(es)", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value", justify="right")
    t.add_row("commands", f"{r.commands:,}" + ("" if r.commands == r.requested else f" of {r.requested:,}"))
    t.add_row("wrong answers", f"{r.wrong:,}")
    for k in KINDS:
        t.add_row(f"  {k}", f"{r.wrong_by_kind[k]:,} of {r.commands_by_kind[k]:,}")
    t.add_row("data-path ops (write + read back)", f"{r.data_ops:,} ({r.data_bytes / 2**20:,.0f} MiB each way)")
    t.add_row("data mismatches", f"{r.data_mismatches:,}")
    t.add_row("wall", f"{r.wall_s:.2f} s")
    t.add_row("commands/s", f"{r.commands_per_s:,.0f}")
    t.add_row("result", "ok" if r.ok else "FAIL")
    parts: list[Any] = [t]
    if r.samples or r.data_samples:
        s = Table(title="first wrong answers")
        for col in ("who", "kind", "opcode", "expected", "got"):
            s.add_column(col)
        for x in r.samples:
            s.add_row(f"host {x['host']} #{x['command']}", x["kind"], x["opcode"], x["expected"], x["got"])
        for x in r.data_samples:
            s.add_row(f"load {x['load']}", "data", x["dpa"], x["expected"], f"{x['got']} at byte {x['first_bad_byte']}")
        parts.append(s)
    if r.errors:
        e = Table(title="process errors")
        e.add_column("error")
        for err in r.errors:
            e.add_row(err)
        parts.append(e)
    return Group(*parts)


def register_liveness(bench: Any) -> None:
    p = bench.add_parser("liveness", help="time from kill -9 of a server to DeviceGone in read / send / open")
    p.add_argument("--kills", type=int, default=5, help="kills per call (default 5)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_liveness)


def cmd_liveness(args: Any) -> int:
    if args.kills < 1:
        raise CliError(f"--kills must be >= 1, got {args.kills}")
    result = liveness.run(args.kills)
    show(args.json, result, lambda: render_liveness(result))
    return 0 if result["ok"] else 1


def render_liveness(result: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title="cxlemu bench liveness: SIGKILL of the server to DeviceGone")
    for col in ("call", "kills", "min ms", "median ms", "max ms", "target", ""):
        t.add_column(col)
    for r in result["rows"]:
        t.add_row(r["call"], str(r["kills"]), f"{r['min_ms']:g}", f"{r['median_ms']:g}", f"{r['max_ms']:g}",
                  f"< {TARGET_MS:g} ms", "[green]pass[/green]" if r["pass"] else "[red]FAIL[/red]")
    return t


def register_telemetry(bench: Any) -> None:
    p = bench.add_parser("telemetry", help="the telemetry page's cost: publishes, a snapshot, the KV sharing gauges")
    p.add_argument("--rounds", type=int, default=2000, help="rounds each call is averaged over (default 2000)")
    p.add_argument("--json", action="store_true", help="{call: microseconds} instead of lines")
    p.set_defaults(func=cmd_telemetry)


def cmd_telemetry(args: Any) -> int:
    if args.rounds < 1:
        raise CliError(f"--rounds must be >= 1, got {args.rounds}")
    from tools.monitor import bench as telemetry  # here: importing the monitor costs every bench ~0.13 s

    result = telemetry.run(args.rounds)
    if args.json:
        print_json(result)
    else:
        for name, us in result.items():
            print(f"{us:9.1f} us  {name}")
    return 0
