"""Dynamic Capacity as the fabric manager drives it: `cxlemu dcd add | release | list`.

    cxlemu dcd add mem0 --host 1 --region 0 [--tag kv-index] --extent 0x10000000:64M ...
    cxlemu dcd release mem0 --host 1 --region 0 --extent 0x10000000:64M [--forced]
    cxlemu dcd list mem0 [--json]

The requests are cxlemu's vendor opcodes C000h-C002h, sent in-band on the mailbox of port
``--via`` (default 0); a separate fabric-manager mailbox is left for later. ``--host`` names the
host port the capacity goes to. The host then accepts (Add DC Response) or releases (Release DC)
through its own port: ``MemDev.accept`` / ``MemDev.release``.
"""
from __future__ import annotations

import argparse

from tools.cli._common import ArgumentError, memdev_session, parse_host, parse_int, parse_size, print_json


def parse_extent(text: str) -> tuple[int, int]:
    """``DPA:LEN`` (``0x10000000:64M``) -> (dpa, length); usable as an argparse ``type=``."""
    dpa, sep, length = text.partition(":")
    if not sep or not dpa or not length:
        raise ArgumentError(f"malformed extent {text!r}: use DPA:LEN, e.g. 0x10000000:64M")
    return parse_int(dpa, "extent DPA"), parse_size(length)


def _region(text: str) -> int:
    region = parse_int(text, "region")
    if not 0 <= region < 8:
        raise ArgumentError(f"region must be 0..7, got {region}")
    return region


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dcd", help="offer, release or list Dynamic Capacity (the fabric manager's side)")
    dsub = p.add_subparsers(dest="dcd_command", metavar="ACTION", parser_class=type(p))
    dsub.required = True
    for action, help_text in (("add", "offer extents of a DC region to a host (Add Capacity events)"),
                              ("release", "ask a host to release extents (--forced: revoke them now)")):
        q = dsub.add_parser(action, help=help_text)
        q.add_argument("name")
        q.add_argument("--host", type=parse_host, required=True, help="the host port the capacity is for")
        q.add_argument("--region", type=_region, required=True, help="DC region 0..7")
        q.add_argument("--tag", default=None, help="tag of a shared extent, up to 16 bytes of text")
        q.add_argument("--extent", type=parse_extent, action="append", required=True, metavar="DPA:LEN",
                       help="an extent (block-aligned, 2 MiB blocks); repeat for several")
        q.add_argument("--via", type=parse_host, default=0, help="the port whose mailbox carries it (default 0)")
        if action == "release":
            q.add_argument("--forced", action="store_true", help="revoke at once (Forced Capacity Release)")
        q.set_defaults(func=cmd_dcd_change)
    q = dsub.add_parser("list", help="every host port's extents and pending offers")
    q.add_argument("name")
    q.add_argument("--json", action="store_true", help="JSON instead of one line per extent")
    q.add_argument("--via", type=parse_host, default=0, help="the port whose mailbox carries it (default 0)")
    q.set_defaults(func=cmd_dcd_list)


def cmd_dcd_change(args: argparse.Namespace) -> int:
    with memdev_session(args.name, args.via) as md:
        if args.dcd_command == "add":
            md.fm_add(args.host, args.region, args.extent, args.tag)
        else:
            md.fm_release(args.host, args.region, args.extent, args.tag, forced=args.forced)
    return 0


def cmd_dcd_list(args: argparse.Namespace) -> int:
    with memdev_session(args.name, args.via) as md:
        extents = md.fm_list()
    if args.json:
        print_json([e.to_json() for e in extents])
        return 0
    for e in extents:
        state = "offered" if e.pending else "accepted"
        tag = e.tag.rstrip(b"\0").decode("utf-8", "replace")
        print(f"host {e.host} {state} {e.start_dpa:#x}+{e.length >> 20} MiB" + (f" tag {tag!r} seq {e.shared_seq}" if tag else ""))
    return 0
