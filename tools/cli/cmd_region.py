"""Regions: `cxlemu region create | list | destroy`, like ndctl's `cxl create-region` / `cxl list -R`.

    cxlemu region create --memdev mem0 --memdev mem1 --size 512M --granularity 4096
    cxlemu region list
    cxlemu region destroy region0

The memdevs must be served: their firmware acknowledges each decoder commit. Listing reads the
decoders back from the devices' BARs and needs no firmware.
"""
from __future__ import annotations

import argparse
import contextlib
from typing import Any

from tools.cli._common import (
    CliError,
    device_error,
    open_memdev,
    parse_int,
    parse_size,
    print_json,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("region", help="create, list and destroy HPA regions over memdevs")
    rsub = p.add_subparsers(dest="region_command", metavar="ACTION")
    rsub.required = True

    c = rsub.add_parser("create", help="program HDM decoders: an HPA window over one or more memdevs")
    c.add_argument("--memdev", action="append", required=True, metavar="NAME",
                   help="a target; repeat for an interleaved region (1, 2, 3, 4, 6, 8, 12 or 16 of them), "
                        "in interleave order")
    c.add_argument("--size", required=True, help="window size, a multiple of (memdevs x 256M)")
    c.add_argument("--granularity", default="256", help="interleave granularity 256..16384 bytes (default 256)")
    c.add_argument("--base", default=None, help="HPA base (default: the lowest free one in the root window)")
    c.add_argument("--lock", action="store_true", help="lock the decoders on commit (until device reset)")
    c.set_defaults(func=cmd_create)

    ls = rsub.add_parser("list", help="regions the devices decode, as JSON (like `cxl list -R`)")
    ls.add_argument("--human", action="store_true", help="a rich table instead of JSON")
    ls.set_defaults(func=cmd_list)

    d = rsub.add_parser("destroy", help="reset a region's decoders (its devices' top decoders)")
    d.add_argument("name", help="e.g. region0")
    d.set_defaults(func=cmd_destroy)


def region_record(info: Any) -> dict[str, Any]:
    """A `cxl list -R`-style record of a driver.region.RegionInfo."""
    return {
        "region": info.name, "resource": info.base, "size": info.size,
        "interleave_ways": info.interleave_ways, "interleave_granularity": info.interleave_granularity,
        "decode_state": "commit", "order_known": info.order_known,
        "mappings": [{"position": pos if info.order_known else None, "memdev": memdev, "decoder": decoder}
                     for pos, (memdev, decoder) in enumerate(zip(info.targets, info.decoders))],
    }


def cmd_create(args: argparse.Namespace) -> int:
    from driver.hdm import DecoderError
    from driver.region import create_region, list_regions
    from emulator.spec.errors import ConfigError

    size = parse_size(args.size)
    granularity = parse_size(args.granularity)
    base = parse_int(args.base, "--base") if args.base is not None else None
    if len(set(args.memdev)) != len(args.memdev):
        raise CliError(f"--memdev {' '.join(args.memdev)} repeats a device: each may appear once")
    with contextlib.ExitStack() as stack:
        memdevs = [stack.enter_context(open_memdev(name)) for name in args.memdev]
        try:
            region = create_region(memdevs, size=size, granularity=granularity, base=base, lock=args.lock)
        except ConfigError as exc:
            raise CliError(str(exc)) from None
        except DecoderError as exc:
            raise device_error(exc) from None
    [info] = [r for r in list_regions() if r.name == region.name]
    print_json(region_record(info))
    return 0


def region_table(records: list[dict[str, Any]]) -> Any:
    """The `--human` rendering of `region list` records (a rich Table; pure, for tests)."""
    from rich.table import Table

    table = Table(title="cxlemu regions")
    for col in ("region", "resource", "size", "ways", "granularity", "memdevs (by position)"):
        table.add_column(col)
    for r in records:
        memdevs = ", ".join(f"{m['memdev']}.decoder{m['decoder']}" for m in r["mappings"])
        table.add_row(str(r["region"]), f"{r['resource']:#x}", f"{r['size'] >> 20} MiB", str(r["interleave_ways"]),
                      str(r["interleave_granularity"]), memdevs if r["order_known"] else f"{memdevs} (order unknown)")
    return table


def cmd_list(args: argparse.Namespace) -> int:
    from driver.region import list_regions

    records = [region_record(info) for info in list_regions()]
    if args.human:
        from rich.console import Console

        Console().print(region_table(records))
    else:
        print_json(records)
    return 0


def cmd_destroy(args: argparse.Namespace) -> int:
    from driver import DeviceGone, DeviceNotFound
    from driver.hdm import DecoderError
    from driver.region import remove_region
    from emulator.spec.errors import ConfigError

    try:
        remove_region(args.name)
    except (ConfigError, DeviceNotFound) as exc:
        raise CliError(str(exc)) from None
    except (DecoderError, DeviceGone) as exc:
        raise device_error(exc) from None
    return 0
