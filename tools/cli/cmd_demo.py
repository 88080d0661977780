"""`cxlemu demo`: walk a new user through a device (see tools/demo.py)."""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="serve a device in-process and walk through it")
    p.add_argument("--no-kv", action="store_true", help="skip the KV-cache generation")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from tools.demo import run_demo

    return run_demo(kv=not args.no_kv)
