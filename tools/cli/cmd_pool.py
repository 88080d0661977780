"""The shared KV pool as the fabric manager creates it: `cxlemu pool create`.

    cxlemu pool create pool0 --size 64M [--hosts 0,1] [--slot-bytes 256K] [--quota 16M] [--policy lru]

Vendor opcode C003h, sent in-band on port ``--via`` (default 0): the firmware offers one extent
of ``--size`` bytes at ``--offset`` into DC region ``--region``, tagged kv-index, to each host of
``--hosts`` (default all) and formats the index in it (emulator/kv_pool.py). Each host accepts it
when it opens the pool: ``KvPool.open(MemDev.open(name, host=h))`` (driver/pool.py).
"""
from __future__ import annotations

import argparse

from tools.cli._common import ArgumentError, memdev_session, parse_host, parse_int, parse_size, print_json


def _hosts(text: str) -> list[int]:
    try:
        return [parse_host(part) for part in text.split(",")]
    except ArgumentError:
        raise ArgumentError(f"--hosts takes host ports separated by commas (0,1,2), got {text!r}") from None


def _policy(spec: str) -> str:
    """An eviction policy the firmware can run, checked here (resolve_policy and the protocol)."""
    from firmware_model.kv_index import check_policy

    try:
        return check_policy(spec)
    except ValueError as exc:
        raise ArgumentError(f"--policy: {exc}") from None


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pool", help="create the shared KV pool: an index extent offered to hosts")
    psub = p.add_subparsers(dest="pool_command", metavar="ACTION", parser_class=type(p))
    psub.required = True
    q = psub.add_parser("create", help="offer a kv-index extent to hosts and format the index in it")
    q.add_argument("name")
    q.add_argument("--size", type=parse_size, required=True, help="the extent's size (2 MiB multiples)")
    q.add_argument("--hosts", type=_hosts, default=None, help="host ports it is offered to (default: all)")
    q.add_argument("--region", type=lambda t: parse_int(t, "region"), default=0, help="DC region (default 0)")
    q.add_argument("--offset", type=parse_size, default=0, help="offset into the region (default 0)")
    q.add_argument("--slot-bytes", type=parse_size, default=256 << 10,
                   help="the most a block may hold (default 256K; a multiple of 64)")
    q.add_argument("--quota", type=parse_size, default=0,
                   help="unshared bytes each host may hold (default: the data area / the hosts)")
    q.add_argument("--policy", type=_policy, default="lru",
                   help="the firmware's eviction policy: a firmware_model.policies name or module:Class "
                        "(default lru; kept with the pool)")
    q.add_argument("--via", type=parse_host, default=0, help="the port whose mailbox carries it (default 0)")
    q.add_argument("--json", action="store_true", help="print the extent as JSON")
    q.set_defaults(func=cmd_pool_create)


def cmd_pool_create(args: argparse.Namespace) -> int:
    with memdev_session(args.name, args.via) as md:
        dpa = md.fm_create_pool(args.size, hosts=args.hosts, region=args.region, offset=args.offset,
                                slot_bytes=args.slot_bytes, quota=args.quota, policy=args.policy)
    if args.json:
        print_json({"start_dpa": dpa, "length": args.size, "tag": "kv-index", "policy": args.policy})
    else:
        print(f"kv-index extent {dpa:#x}+{args.size >> 20} MiB offered to "
              f"{'every host' if args.hosts is None else 'hosts ' + ','.join(map(str, args.hosts))}")
    return 0
