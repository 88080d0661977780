"""``cxlemu trace``: replay block-access traces through the firmware's policies, generate and record them.

    cxlemu trace replay FILE --policy NAME|module:Class --capacity BLOCKS [--prefetch
                        [--prefetch-window N|auto|module:function]] [--json]
    cxlemu trace gen KIND [--out FILE] [--<param> N ...]
    cxlemu trace convert FILE --out FILE.npz|FILE.jsonl
    cxlemu trace record [--out FILE] [--steps N] [--block-tokens N] [--threshold X] ...
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from tools.cli._common import ArgumentError, CliError, need_extra, print_json

_COST_FLAGS = ("block_bytes", "latency_ns", "bandwidth_gbps", "time_scale", "compute_ns")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("trace", help="replay, generate and record KV block-access traces")
    sub = p.add_subparsers(dest="trace_command", metavar="ACTION", parser_class=type(p))
    sub.required = True
    _register_replay(sub)
    _register_gen(sub)
    _register_convert(sub)
    _register_record(sub)


def _register_replay(sub: Any) -> None:
    from firmware_model.policies import POLICY_NAMES

    def policy_spec(spec: str) -> str:  # a built-in name, or module:Class checked against the protocol
        from firmware_model.policies import resolve_policy

        try:
            resolve_policy(spec)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return spec

    def window_spec(spec: str) -> int | str:  # points ahead, auto, or module:function checked
        from firmware_model.prefetch import resolve_window

        try:
            n = int(spec)
        except ValueError:
            try:
                resolve_window(spec)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None
            return spec
        if n < 0:
            raise argparse.ArgumentTypeError(f"a window of {n} points: expected an int >= 0, 'auto' "
                                             "or module:function")
        return n

    r = sub.add_parser("replay", help="replay a trace (JSON lines or binary .npz) through an eviction policy")
    r.add_argument("file", metavar="FILE", help='JSON lines, each with "t" and "block", or a binary .npz trace')
    r.add_argument("--policy", default="lru", type=policy_spec, metavar="NAME",
                   help=f"one of {', '.join(POLICY_NAMES)} (default lru), or your own class as "
                        "module:Class (importable: its directory on PYTHONPATH)")
    r.add_argument("--capacity", type=int, required=True, metavar="BLOCKS", help="resident blocks")
    r.add_argument("--prefetch", action="store_true",
                   help="prefetch from the trace's own (step, seq, layer) hints; needs a cost model")
    r.add_argument("--prefetch-window", type=window_spec, default=None, metavar="N|auto|module:function",
                   help="with --prefetch: points issued ahead, or what sizes them (default auto: "
                        "firmware_model.prefetch.window_points; your own function as module:function, "
                        "f(link, bytes_per_point, compute_ns_per_point, max_window) -> int)")
    r.add_argument("--json", action="store_true", help="print the result as JSON")
    g = r.add_argument_group("cost model (stall time; any of these enables it)")
    g.add_argument("--block-bytes", type=int, default=0, help="bytes per block (default 256 KiB with a cost model)")
    g.add_argument("--latency-ns", type=float, default=0.0, help="per-transfer latency, ns")
    g.add_argument("--bandwidth-gbps", type=float, default=0.0, help="link bandwidth, GB/s (0 = unthrottled)")
    g.add_argument("--time-scale", type=float, default=1.0, help="multiplies every device time")
    g.add_argument("--compute-ns", type=non_negative_ns, default=0, help="compute time per access, ns (>= 0)")
    r.set_defaults(func=_cmd_replay)


def non_negative_ns(text: str) -> int:
    """A whole number of ns >= 0 (an argparse ``type=``): compute time cannot run backwards."""
    try:
        ns = int(text, 10)
    except ValueError:
        raise ArgumentError(f"malformed time {text!r}: use a whole number of ns >= 0, e.g. 2000") from None
    if ns < 0:
        raise ArgumentError(f"must be a whole number of ns >= 0, got {ns}")
    return ns


def _cost_from(args: argparse.Namespace):  # -> TransferCost | None
    from firmware_model.dma import TransferCost

    given = args.block_bytes or args.latency_ns or args.bandwidth_gbps or args.compute_ns
    if not given:
        if args.prefetch:
            raise CliError("--prefetch needs a cost model: give --bandwidth-gbps and/or --latency-ns "
                           "(and --compute-ns for the compute it overlaps)")
        return None
    try:
        return TransferCost(read_latency_ns=args.latency_ns, write_latency_ns=args.latency_ns,
                            read_bandwidth_gbps=args.bandwidth_gbps, write_bandwidth_gbps=args.bandwidth_gbps,
                            time_scale=args.time_scale, block_bytes=args.block_bytes or 256 << 10)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def replay_file(path: str, policy: str, capacity: int, cost: Any = None, compute_ns: int = 0,
                prefetch: bool = False, window: Any = None) -> dict[str, Any]:
    """Load and replay one trace; returns the JSON document (with events_per_s, wall-clock).

    Demand fill replays the block column as it is loaded (a binary trace's ids, without an
    ``Access`` per record; ``lru``, ``lfu``, ``arc``, ``s3fifo`` and ``opt`` in C when built); ``--prefetch``
    needs the records' (step, sequence, layer) and builds them; ``window`` (an int, ``"auto"``,
    ``"module:function"`` or a callable) sizes its prefetch window (None: auto)."""
    from firmware_model.replay import opt_hit_count, replay, replay_keys
    from tools.trace.io import load_columns

    cols = load_columns(path)
    if not len(cols):
        raise CliError(f"trace {path} holds no accesses")
    trace = cols.accesses() if prefetch else None
    start = time.perf_counter()
    if trace is not None and window is not None:
        from firmware_model.policies import make_policy
        from firmware_model.prefetch_replay import replay_with_prefetch

        if policy == "opt":
            raise ValueError("policy 'opt' scores demand fill (it needs the exact access sequence): "
                             "replay it without prefetch")
        result = replay_with_prefetch(trace, make_policy(policy, capacity), capacity, cost=cost,
                                      compute_ns=compute_ns, window=window)
    elif trace is not None:
        result = replay(trace, policy, capacity, cost=cost, compute_ns=compute_ns, prefetch=True,
                        with_opt=False)
    else:
        result = replay_keys(cols.block, policy, capacity, cost=cost, compute_ns=compute_ns, with_opt=False)
    elapsed = time.perf_counter() - start
    result.opt_hits = opt_hit_count(cols.block, capacity)
    doc = result.to_dict()
    doc["opt_bound"] = "demand_fill"  # with --prefetch, hits can exceed it: blocks arrive before a miss
    doc["trace"] = str(path)
    doc["wall_s"] = round(elapsed, 6)
    doc["events_per_s"] = int(len(cols) / elapsed) if elapsed > 0 else 0
    return doc


def _cmd_replay(args: argparse.Namespace) -> int:
    from tools.trace.io import TraceFormatError

    if args.capacity < 1:
        raise CliError(f"--capacity must be a positive number of blocks, got {args.capacity}")
    if args.prefetch_window is not None and not args.prefetch:
        raise CliError("--prefetch-window sizes the prefetcher's window: give --prefetch too")
    cost = _cost_from(args)
    try:
        doc = replay_file(args.file, args.policy, args.capacity, cost, args.compute_ns, args.prefetch,
                          args.prefetch_window)
    except OSError as exc:
        raise CliError(f"cannot read trace {args.file}: {exc.strerror or exc}") from None
    except (TraceFormatError, ValueError) as exc:
        raise CliError(str(exc)) from None
    if args.json:
        print_json(doc)
        return 0
    print(f"{doc['policy']} capacity {doc['capacity']}: {doc['hits']}/{doc['accesses']} hits "
          f"({100 * doc['hit_ratio']:.1f} %), OPT {doc['opt_hits']} (ratio {doc['opt_ratio']:.3f}), "
          f"{doc['evictions']} evictions, {doc['events_per_s']:,} accesses/s")
    if args.prefetch:
        print("OPT is the demand-fill bound; prefetched blocks that land before their use can beat it")
    if cost is not None:
        print(f"stall {doc['stall_ns'] / 1e3:.1f} us of {doc['sim_ns'] / 1e3:.1f} us simulated")
    for k, v in doc["prefetch"].items():
        print(f"prefetch {k}: {v}")
    return 0


def _register_gen(sub: Any) -> None:
    from tools.trace.gen import KINDS, kind_parameters

    g = sub.add_parser("gen", help="write a synthetic trace (JSON lines; binary for an --out ending .npz)")
    kinds = g.add_subparsers(dest="kind", metavar="KIND", parser_class=type(g))
    kinds.required = True
    for kind, fn in KINDS.items():
        k = kinds.add_parser(kind, help=(fn.__doc__ or "").splitlines()[0])
        k.add_argument("--out", "-o", default="-",
                       help="output file (default stdout); a name ending .npz gets the binary format")
        for name, default in kind_parameters(kind).items():
            k.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=default,
                           help=f"(default {default})")
        k.set_defaults(func=_cmd_gen)
    _register_gen_sessions(kinds)


def _register_gen_sessions(kinds: Any) -> None:
    """`trace gen sessions`: not block accesses but the requests of multi-turn sessions, the
    input of `cxlemu sim serve --workload trace`."""
    k = kinds.add_parser("sessions", help="multi-turn chat sessions with shared system prompts: a request trace "
                                          "for `cxlemu sim serve --workload trace` (JSON lines)")
    k.add_argument("--out", "-o", default="-", help="output file (default stdout)")
    for name, default in (("sessions", 1000), ("concurrency", 32), ("turns", 4), ("system_tokens", 1024),
                          ("system_prompts", 4), ("user_tokens", 256), ("output_tokens", 128), ("seed", 0)):
        k.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=default, help=f"(default {default})")
    k.add_argument("--think-s", type=float, default=5.0, help="mean think time between turns, s (default 5)")
    k.set_defaults(func=_cmd_gen_sessions)


def _cmd_gen_sessions(args: argparse.Namespace) -> int:
    from tools.sim.workload import sessions, write_trace

    try:
        scripts = sessions(sessions=args.sessions, concurrency=args.concurrency, turns=args.turns,
                           system_tokens=args.system_tokens, system_prompts=args.system_prompts,
                           user_tokens=args.user_tokens, output_tokens=args.output_tokens, think_s=args.think_s,
                           seed=args.seed)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if args.out == "-":
        write_trace(scripts, sys.stdout)
        return 0
    try:
        with open(args.out, "w") as f:
            write_trace(scripts, f)
    except OSError as exc:
        raise CliError(f"cannot write {args.out}: {exc.strerror or exc}") from None
    return 0


def _cmd_gen(args: argparse.Namespace) -> int:
    from tools.trace.gen import KINDS, kind_parameters

    params = {name: getattr(args, name) for name in kind_parameters(args.kind)}
    try:
        trace = KINDS[args.kind](**params)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    _write(trace, args.out)
    return 0


def _write(trace: Any, out: str) -> None:
    """Write ``trace`` (a list of accesses, or ``TraceColumns``: a binary file takes them as they
    are, JSON lines one access at a time) to ``out`` ("-": stdout)."""
    from tools.trace.io import TraceColumns, save_binary, write_trace

    def accesses() -> Any:
        return trace.accesses() if isinstance(trace, TraceColumns) else trace

    if out == "-":
        write_trace(accesses(), sys.stdout)
        return
    try:
        if out.endswith(".npz"):
            n = save_binary(trace, out)
        else:
            with open(out, "w", encoding="utf-8") as f:
                n = write_trace(accesses(), f)
    except OSError as exc:
        raise CliError(f"cannot write {out}: {exc.strerror or exc}") from None
    print(f"wrote {n} accesses to {out}", file=sys.stderr)


def _register_convert(sub: Any) -> None:
    c = sub.add_parser("convert", help="convert a trace between JSON lines and binary .npz (the same accesses)")
    c.add_argument("file", metavar="FILE", help="a trace: JSON lines or binary .npz/.npy")
    c.add_argument("--out", "-o", required=True,
                   help="output file: a name ending .npz gets the binary format, any other JSON lines, - stdout")
    c.set_defaults(func=_cmd_convert)


def _cmd_convert(args: argparse.Namespace) -> int:
    from tools.trace.io import TraceFormatError, load_columns

    try:
        cols = load_columns(args.file)
    except OSError as exc:
        raise CliError(f"cannot read trace {args.file}: {exc.strerror or exc}") from None
    except TraceFormatError as exc:
        raise CliError(str(exc)) from None
    _write(cols, args.out)
    return 0


def _register_record(sub: Any) -> None:
    from tools.trace.record import RecordSpec

    r = sub.add_parser("record", help="record a block-access trace from a seeded tiny Llama's attention")
    r.add_argument("--out", "-o", default="-", help="output file (default stdout)")
    for name, default in RecordSpec.defaults().items():
        r.add_argument(f"--{name.replace('_', '-')}", dest=name, type=type(default), default=default,
                       help=f"(default {default})")
    r.set_defaults(func=_cmd_record)


def _cmd_record(args: argparse.Namespace) -> int:
    from tools.trace.record import RecordSpec, record

    try:
        spec = RecordSpec(**{k: getattr(args, k) for k in RecordSpec.defaults()})
    except ValueError as exc:
        raise CliError(str(exc)) from None
    for module in ("torch", "transformers"):
        need_extra(module, "kv", "trace record")
    trace = record(spec)
    _write(trace, args.out)
    return 0
