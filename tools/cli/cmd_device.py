"""Device lifecycle and raw access: `cxlemu serve | list | raw | destroy`."""
from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from typing import Any

from tools.cli._common import (
    ArgumentError,
    CliError,
    add_host_flag,
    open_memdev,
    parse_hex,
    parse_int,
    parse_port,
    parse_size,
    print_json,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a device (created if new, as it was if stopped) until SIGINT/SIGTERM",
                       description="Run a device's firmware in the foreground. A new device is created; a "
                                   "stopped one is served as it was: media, LSA, poison list, firmware slots "
                                   "and configuration persist, as hardware keeps them across a power cycle. "
                                   "Settings given that differ from a stopped device's are refused unless "
                                   "--reconfigure; --fresh starts it empty.")
    p.add_argument("--name", required=True, help="device name, e.g. mem0")
    p.add_argument("--capacity", default=None,
                   help="DPA space, a multiple of 256M (new device: default 1G; stopped one: as it was)")
    p.add_argument("--lsa-size", default=None, help="label storage area size (new device: default 128K)")
    p.add_argument("--fresh", action="store_true", help="start the device empty, discarding what it held")
    p.add_argument("--reconfigure", action="store_true",
                   help="change a stopped device's settings (media kept where it fits)")
    p.add_argument("--numa-node", type=int, default=None, help="bind the media to this NUMA node")
    p.add_argument("--hosts", type=_parse_hosts, default=None, metavar="N",
                   help="host ports, 1..8, each its own BAR and mailbox (new device: default 1; stopped one: as it was)")
    p.add_argument("--dc-region", action="append", default=None, metavar="SIZE",
                   help="a Dynamic Capacity region of SIZE (a multiple of 256M) after the static capacity; "
                        "repeat for up to 8 (new device: none; stopped one: as it was)")
    p.add_argument("--preset", default=None, help="timing preset (see `cxlemu presets`)")
    p.add_argument("--read-latency-ns", type=float, default=None)
    p.add_argument("--write-latency-ns", type=float, default=None)
    p.add_argument("--bandwidth-gbps", type=float, default=None, help="per direction, GB/s")
    p.add_argument("--transaction-bytes", type=int, default=None, help="64..4096, a power of two")
    p.add_argument("--time-scale", type=float, default=None, help="multiply all device times by K")
    p.add_argument("--metrics-port", type=parse_port, default=None,
                   help="serve Prometheus metrics on 127.0.0.1:PORT (1..65535)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("list", help="list devices as JSON (like `cxl list -M`)")
    p.add_argument("names", nargs="*", help="only these devices")
    p.add_argument("--human", action="store_true", help="a rich table instead of JSON")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("raw", help="send one mailbox command and print the answer as JSON")
    p.add_argument("name")
    p.add_argument("opcode", help="e.g. 0x4000")
    p.add_argument("--payload", default="", help="input payload as hex")
    add_host_flag(p)
    p.add_argument("--wait", action="store_true", help="follow a background command to completion")
    p.set_defaults(func=cmd_raw)

    p = sub.add_parser("destroy", help="remove a stopped device's files")
    p.add_argument("name")
    p.set_defaults(func=cmd_destroy)


def _parse_hosts(text: str) -> int:
    """``serve --hosts N``: 1..MAX_HOSTS host ports."""
    from emulator.device_dir import MAX_HOSTS

    try:
        hosts = int(text.strip(), 10)
    except ValueError:
        raise ArgumentError(f"malformed host count {text!r}: use a number 1..{MAX_HOSTS}") from None
    if not 1 <= hosts <= MAX_HOSTS:
        raise ArgumentError(f"host count must be 1..{MAX_HOSTS}, got {hosts}")
    return hosts


def build_config(args: argparse.Namespace) -> Any:
    """DeviceConfig from serve's flags. The base is the stopped device's stored configuration (a
    new device, or --fresh: the defaults); a preset replaces the base's timing; explicit flags
    override single fields. What then differs from the stored configuration is for
    ``emulator.device.provision`` to refuse or, with --reconfigure, apply."""
    from emulator.device import DeviceConfig, device_path, load_config
    from emulator.spec.errors import ConfigError
    from emulator.timing.config import TimingConfig

    try:
        base = DeviceConfig(name=args.name, capacity=1 << 30)
        if not args.fresh and (device_path(args.name) / "config.json").is_file():
            try:
                base = load_config(args.name)
            except ConfigError as exc:
                raise ConfigError(f"{exc}; or serve it with --fresh to start it empty") from None
        timing = base.timing
        preset = base.preset
        if args.preset:
            from emulator import presets

            timing, preset = presets.load(args.preset).timing, args.preset
        overrides = {k: v for k, v in {
            "read_latency_ns": args.read_latency_ns, "write_latency_ns": args.write_latency_ns,
            "read_bandwidth_gbps": args.bandwidth_gbps, "write_bandwidth_gbps": args.bandwidth_gbps,
            "transaction_bytes": args.transaction_bytes, "time_scale": args.time_scale,
        }.items() if v is not None}
        timing = TimingConfig(**{**timing.to_dict(), **overrides})
        fields: dict[str, Any] = {"timing": timing, "preset": preset}
        if args.capacity is not None:
            fields["capacity"] = parse_size(args.capacity)
        if args.lsa_size is not None:
            fields["lsa_size"] = parse_size(args.lsa_size)
        if args.numa_node is not None:
            fields["numa_node"] = args.numa_node
        if args.hosts is not None:
            fields["hosts"] = args.hosts
        if args.dc_region is not None:
            fields["dc_regions"] = tuple(parse_size(text) for text in args.dc_region)
        return base.with_(**fields)
    except ConfigError as exc:
        raise CliError(str(exc)) from None


def cmd_serve(args: argparse.Namespace) -> int:
    from emulator.device import Served
    from emulator.spec.errors import ConfigError, DeviceFileError

    if args.fresh and args.reconfigure:
        raise CliError("--fresh and --reconfigure exclude each other: --fresh starts empty with the settings given")
    config = build_config(args)
    from emulator.device import device_path

    existed = (device_path(config.name) / "config.json").is_file() and not args.fresh
    exporter = None
    if args.metrics_port is not None:
        from tools.exporter import start_exporter

        try:
            exporter = start_exporter([config.name], "127.0.0.1", args.metrics_port)
        except OSError as exc:
            raise CliError(f"cannot serve metrics on 127.0.0.1:{args.metrics_port}: {exc.strerror or exc}") from None
    try:
        served = Served(config, keep=True, fresh=args.fresh, reconfigure=args.reconfigure)
    except (ConfigError, DeviceFileError) as exc:
        if exporter is not None:
            exporter.shutdown()
        raise CliError(str(exc)) from None
    if served.numa_notice:
        print(f"cxlemu: {served.numa_notice}", file=sys.stderr)

    def stop(signum: int, frame: object) -> None:
        served.runner.stop()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    t = config.timing
    link = "unthrottled" if t.read_bandwidth_gbps is None else f"{t.read_bandwidth_gbps:g} GB/s"
    kept = (" (reconfigured, media kept)" if args.reconfigure else " (as it was: media, LSA, poison, slots kept)") \
        if existed else " (new)"
    ports = f", {config.hosts} host ports" if config.hosts > 1 else ""
    dc = f", DC regions {'+'.join(str(n >> 20) for n in config.dc_regions)} MiB" if config.dc_regions else ""
    print(f"cxlemu: serving {config.name}{kept}: {config.capacity >> 20} MiB{ports}{dc}, read {t.read_latency_ns:g} ns / "
          f"write {t.write_latency_ns:g} ns, {link}, "
          f"pid {__import__('os').getpid()} (SIGINT/SIGTERM to stop)", file=sys.stderr, flush=True)
    try:
        served.run_foreground()
    finally:
        if exporter is not None:
            exporter.shutdown()
    return 0


def describe(name: str) -> dict[str, Any]:
    """One `cxl list -M`-style record."""
    from emulator.device import (
        device_path,
        device_state,
        firmware_pid,
        host_claims,
        load_config,
        numa_node,
    )

    cfg = load_config(name)
    record: dict[str, Any] = {
        "memdev": name, "ram_size": cfg.capacity, "pmem_size": 0, "serial": cfg.serial,
        "firmware_version": cfg.fw_revision, "numa_node": numa_node(name), "state": device_state(name),
        "host": firmware_pid(name), "preset": cfg.preset, "lsa_size": cfg.lsa_size,
        "timing": cfg.timing.to_dict(), "path": str(device_path(name)),
        # each host port, the live process that claimed it (None: free), its DC extents and its pool state
        "hosts": host_claims(name),
    }
    _add_port_state(record["hosts"], name if record["state"] == "served" else None)
    if record["state"] == "served":
        record["firmware_version"] = _running_revision(name) or cfg.fw_revision
    return record


def _add_port_state(claims: list[dict[str, Any]], served: str | None) -> None:
    """Add to each port of ``claims`` what the firmware's telemetry page of device ``served``
    says of it (layout 1.3): its accepted DC extents (count, bytes, tagged bytes) and its state
    in the KV pool ("member", "joining", "out"; None without a pool). None where the page says
    nothing: a device not served, or a firmware that has not published yet."""
    from emulator.device import open_bar
    from emulator.spec.errors import CxlemuError
    from emulator.telemetry import POOL_PHASES, TelemetryReader

    pool = None
    if served is not None:
        with contextlib.suppress(CxlemuError, OSError, ValueError):  # a device going away: say nothing
            bar = open_bar(served)
            reader = TelemetryReader(bar)
            try:
                pool = reader.snapshot().pool
            finally:
                reader.close()
                bar.close()
    for rec in claims:
        h = rec["host"]
        row = pool.host_rows[h] if pool is not None and h < len(pool.host_rows) else None
        phase = None
        if row is not None and pool is not None and h < pool.pool_hosts and row.pool_phase < len(POOL_PHASES):
            phase = POOL_PHASES[row.pool_phase]
        rec.update(extents=row.extents if row else None, extent_bytes=row.extent_bytes if row else None,
                   shared_extent_bytes=row.shared_extent_bytes if row else None, pool=phase)


def _running_revision(name: str) -> str | None:
    """The active firmware revision as Identify Memory Device reports it (bytes 0x00-0x0f)."""
    from driver import CxlemuError, MemDev

    try:
        with MemDev.open(name, ready_timeout_s=0.5) as md:
            rc, out = md.send(0x4000)
    except CxlemuError:
        return None
    return out[:16].rstrip(b"\0").decode(errors="replace") if rc == 0 and len(out) >= 16 else None


def _describe_or_report(name: str) -> dict[str, Any]:
    """``describe(name)``, or for a device whose files cannot be read, a record saying so (and a
    warning on stderr): one broken device does not hide the others."""
    from emulator.device import device_path
    from emulator.spec.errors import ConfigError

    try:
        return describe(name)
    except ConfigError as exc:
        print(f"cxlemu: warning: {exc}", file=sys.stderr)
        return {"memdev": name, "ram_size": None, "state": "unreadable", "host": None,
                "numa_node": None, "firmware_version": None, "preset": None, "error": str(exc),
                "path": str(device_path(name))}


def cmd_list(args: argparse.Namespace) -> int:
    from emulator.device import list_devices

    names = list_devices()
    for n in args.names:
        if n not in names:
            raise CliError(f"no device named {n!r} (see `cxlemu list`)")
    records = [_describe_or_report(n) for n in (args.names or names)]
    if args.human:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="cxlemu devices")
        for col in ("memdev", "ram_size", "state", "host", "numa_node", "firmware_version", "preset"):
            table.add_column(col)
        for r in records:
            table.add_row(*(str(r[c]) for c in ("memdev", "ram_size", "state", "host", "numa_node",
                                                  "firmware_version", "preset")))
        Console().print(table)
    else:
        print_json(records)
    return 0


def cmd_raw(args: argparse.Namespace) -> int:
    from emulator.spec.retcodes import retcode_name

    opcode = parse_int(args.opcode, "opcode")
    if not 0 <= opcode <= 0xFFFF:
        raise CliError(f"opcode {args.opcode} is out of range: opcodes are 0x0000-0xffff")
    payload = parse_hex(args.payload) if args.payload else b""
    from emulator.spec.registers import MAILBOX_PAYLOAD_SIZE

    if len(payload) > MAILBOX_PAYLOAD_SIZE:
        raise CliError(f"payload of {len(payload)} bytes exceeds the {MAILBOX_PAYLOAD_SIZE}-byte mailbox")
    with open_memdev(args.name, args.host) as md:
        rc, out = md.send(opcode, payload, wait_background=args.wait)
    print_json({"retcode": rc, "retcode_name": retcode_name(rc), "payload": out.hex()})
    if rc not in (0, 1):
        print(f"cxlemu: error: {args.name}: opcode {opcode:#06x} returned {rc:#04x} {retcode_name(rc)}",
              file=sys.stderr)
        return 1
    return 0


def cmd_destroy(args: argparse.Namespace) -> int:
    from emulator.device import destroy
    from emulator.spec.errors import ConfigError, DeviceNotFound

    try:
        destroy(args.name)
    except DeviceNotFound as exc:
        raise CliError(str(exc)) from None
    except ConfigError as exc:
        raise CliError(str(exc), exit_code=1) from None
    return 0
