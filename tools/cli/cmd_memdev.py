"""Memory-device commands: identify, health, partition, timestamp, LSA, firmware update.

    cxlemu identify mem0                      Identify and Identify Memory Device (MemDev.identity())
    cxlemu health mem0 [--alerts]             Get Health Info [+ Get Alert Configuration], `cxl list -H -A` keys
    cxlemu set-alert-config mem0 --over-temperature-threshold 70 --over-temperature-alert on
    cxlemu partition mem0                     Get Partition Info
    cxlemu timestamp mem0 [--set [NS]]        Get / Set Timestamp (--set alone: this host's clock)
    cxlemu lsa mem0 [--offset N] [--length N] read the label storage area as hex
    cxlemu lsa mem0 --offset N --write HEX    write it
    cxlemu fw info mem0                       Get FW Info
    cxlemu fw pack --revision R [--body F] -o OUT   build a cxlemu firmware package
    cxlemu fw update mem0 FILE [--slot S]     Transfer FW (progress on stderr)
    cxlemu fw activate mem0 --slot S [--on-reset]

JSON on stdout by default (as ndctl's `cxl` prints JSON), `--human` for a rich table.
"""
from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tools.cli._common import (
    CliError,
    add_host_flag,
    human_table,
    parse_hex,
    parse_int,
    parse_size,
    print_json,
)
from tools.cli._common import (
    memdev_session as device,
)

_MEDIA_STATUS = ("normal", "not_ready", "persistence_lost", "data_lost", "powerloss_persistence_loss",
                 "shutdown_persistence_loss", "persistence_loss_imminent", "powerloss_data_loss",
                 "shutdown_data_loss", "data_loss_imminent")
_LEVELS = ("normal", "warning", "critical", "reserved")
# driver threshold name -> (ndctl `cxl set-alert-config` flag stem, ndctl `cxl list -A` key stem)
_ALERT_FLAGS = {
    "life_used_warning": ("life-used", "life_used"),
    "over_temp_warning": ("over-temperature", "dev_over_temperature"),
    "under_temp_warning": ("under-temperature", "dev_under_temperature"),
    "corrected_volatile_warning": ("volatile-mem-err", "corrected_volatile_mem_err"),
    "corrected_persistent_warning": ("pmem-err", "corrected_pmem_err"),
}


def _named(parent: argparse._SubParsersAction, cmd: str, help_text: str, func: Any,
           human: bool = True) -> argparse.ArgumentParser:
    p = parent.add_parser(cmd, help=help_text)
    p.add_argument("name", help="device name, e.g. mem0")
    add_host_flag(p)
    if human:
        p.add_argument("--human", action="store_true", help="a rich table instead of JSON")
    p.set_defaults(func=func)
    return p


def register(sub: argparse._SubParsersAction) -> None:
    _named(sub, "identify", "Identify and Identify Memory Device as JSON (MemDev.identity())", cmd_identify)
    p = _named(sub, "health", "health, temperature and alert state (Get Health Info)", cmd_health)
    p.add_argument("--alerts", action="store_true", help="add the alert configuration (like `cxl list -A`)")
    p = _named(sub, "set-alert-config", "program warning thresholds (like `cxl set-alert-config`)",
               cmd_set_alert_config, human=False)
    for flag, _ in _ALERT_FLAGS.values():
        p.add_argument(f"--{flag}-threshold", default=None, metavar="N")
        p.add_argument(f"--{flag}-alert", choices=("on", "off"), default=None)
    _named(sub, "partition", "capacity partitioning (Get Partition Info)", cmd_partition)
    p = _named(sub, "timestamp", "read or set the device clock", cmd_timestamp)
    p.add_argument("--set", nargs="?", const="now", default=None, metavar="NS",
                   help="set it: ns since the Unix epoch (default: this host's clock)")
    p = _named(sub, "lsa", "read or write the label storage area", cmd_lsa, human=False)
    p.add_argument("--offset", default="0", help="byte offset (default 0)")
    p.add_argument("--length", default=None, help="bytes to read (default: to the end)")
    p.add_argument("--write", default=None, metavar="HEX", help="write these bytes at --offset")

    fw = sub.add_parser("fw", help="firmware slots: info, pack, update, activate")
    fsub = fw.add_subparsers(dest="fw_command", metavar="ACTION", parser_class=type(fw))
    fsub.required = True
    _named(fsub, "info", "slots and their revisions (Get FW Info)", cmd_fw_info)
    p = fsub.add_parser("pack", help="build a firmware package the device accepts")
    p.add_argument("--revision", required=True, help="1-16 ASCII characters, e.g. 2.0.1")
    p.add_argument("--body", default=None, help="file whose bytes become the package body")
    p.add_argument("-o", "--output", required=True, help="where to write the package")
    p.set_defaults(func=cmd_fw_pack)
    p = _named(fsub, "update", "transfer a package into a slot (Transfer FW)", cmd_fw_update, human=False)
    p.add_argument("file", help="firmware package (see `cxlemu fw pack`)")
    p.add_argument("--slot", default=None, help="target slot (default: the first inactive one)")
    p = _named(fsub, "activate", "run a slot's firmware (Activate FW)", cmd_fw_activate, human=False)
    p.add_argument("--slot", required=True, help="slot to activate")
    p.add_argument("--on-reset", action="store_true", help="activate at the next reset, not now")




def _emit(args: argparse.Namespace, title: str, record: dict[str, Any]) -> int:
    if getattr(args, "human", False):
        human_table(title, record)
    else:
        print_json(record)
    return 0


def cmd_identify(args: argparse.Namespace) -> int:
    with device(args.name, args.host) as md:
        record = {"memdev": args.name, **md.identity()}  # the driver's record, as `md.identity()` prints it
    return _emit(args, f"{args.name}: Identify and Identify Memory Device", record)


def health_json(h: Any) -> dict[str, Any]:
    """Get Health Info in the key names of ndctl's util_cxl_memdev_health_to_json."""
    record: dict[str, Any] = {
        "maintenance_needed": bool(h.health_status & 1), "performance_degraded": bool(h.health_status & 2),
        "hw_replacement_needed": bool(h.health_status & 4)}
    for i, status in enumerate(_MEDIA_STATUS):
        record[f"media_{status}"] = h.media_status == i
    record.update({
        "ext_life_used": _LEVELS[h.additional_status & 3],
        "ext_temperature": _LEVELS[h.additional_status >> 2 & 3],
        "ext_corrected_volatile": "warning" if h.additional_status & 0x10 else "normal",
        "ext_corrected_persistent": "warning" if h.additional_status & 0x20 else "normal",
        "life_used_percent": h.life_used, "temperature": h.temperature,
        "dirty_shutdowns": h.dirty_shutdowns, "volatile_errors": h.corrected_volatile_errors,
        "pmem_errors": h.corrected_persistent_errors})
    return record


def alert_config_json(cfg: Any) -> dict[str, Any]:
    """Get Alert Configuration in the key names of ndctl's util_cxl_memdev_alert_config_to_json."""
    stems = [key for _, key in _ALERT_FLAGS.values()]
    record: dict[str, Any] = {}
    for bit, stem in enumerate(stems):
        record[f"{stem}_prog_warn_threshold_valid"] = bool(cfg.valid_alerts >> bit & 1)
    for bit, stem in enumerate(stems):
        record[f"{stem}_prog_warn_threshold_writable"] = bool(cfg.programmable_alerts >> bit & 1)
    record.update({
        "life_used_crit_alert_threshold": cfg.life_used_critical,
        "life_used_prog_warn_threshold": cfg.life_used_warning,
        "dev_over_temperature_crit_alert_threshold": cfg.over_temp_critical,
        "dev_under_temperature_crit_alert_threshold": cfg.under_temp_critical,
        "dev_over_temperature_prog_warn_threshold": cfg.over_temp_warning,
        "dev_under_temperature_prog_warn_threshold": cfg.under_temp_warning,
        "corrected_volatile_mem_err_prog_warn_threshold": cfg.corrected_volatile_warning,
        "corrected_pmem_err_prog_warn_threshold": cfg.corrected_persistent_warning})
    return record


def cmd_health(args: argparse.Namespace) -> int:
    with device(args.name, args.host) as md:
        health = health_json(md.health())
        alerts = alert_config_json(md.alert_config()) if args.alerts else None
    if args.human:
        human_table(f"{args.name}: health", {**health, **(alerts or {})})
        return 0
    record: dict[str, Any] = {"memdev": args.name, "health": health}  # the shape of `cxl list -M -H`
    if alerts is not None:
        record["alert_config"] = alerts
    print_json(record)
    return 0


def cmd_set_alert_config(args: argparse.Namespace) -> int:
    """ndctl's rule: enable with a threshold and `--X-alert on`, disable with `--X-alert off` alone."""
    enable: dict[str, int] = {}
    disable: list[str] = []
    for name, (flag, _) in _ALERT_FLAGS.items():
        threshold = getattr(args, f"{flag.replace('-', '_')}_threshold")
        alert = getattr(args, f"{flag.replace('-', '_')}_alert")
        if alert == "on" and threshold is not None:
            enable[name] = parse_int(threshold, f"--{flag}-threshold")
        elif alert == "off" and threshold is None:
            disable.append(name)
        elif alert is not None or threshold is not None:
            raise CliError(f"use --{flag}-threshold N --{flag}-alert on to enable, "
                           f"or --{flag}-alert off alone to disable")
    if not enable and not disable:
        raise CliError("nothing to set: give at least one --X-alert on|off (see --help)")
    with device(args.name, args.host) as md:
        md.set_alert_config(disable=disable, **enable)
        alerts = alert_config_json(md.alert_config())
    print_json({"memdev": args.name, "alert_config": alerts})
    return 0


def cmd_partition(args: argparse.Namespace) -> int:
    with device(args.name, args.host) as md:
        part = md.partition_info()
    return _emit(args, f"{args.name}: partition", {"memdev": args.name, **asdict(part)})


def cmd_timestamp(args: argparse.Namespace) -> int:
    with device(args.name, args.host) as md:
        if args.set is not None:
            md.set_timestamp(None if args.set == "now" else parse_int(args.set, "timestamp"))
        ns = md.timestamp()
    return _emit(args, f"{args.name}: timestamp", {"memdev": args.name, "timestamp_ns": ns})


def cmd_lsa(args: argparse.Namespace) -> int:
    offset = parse_int(args.offset, "offset")
    if args.write is not None and args.length is not None:
        raise CliError("--length reads; --write writes: give one of them")
    with device(args.name, args.host) as md:
        lsa_size = md.identify_memdev().lsa_size
        if args.write is not None:
            data = parse_hex(args.write, "--write data")
            if offset < 0 or offset + len(data) > lsa_size:
                raise CliError(f"writing {len(data)} bytes at {offset} runs past the {lsa_size}-byte LSA")
            md.set_lsa(offset, data)
            print_json({"memdev": args.name, "offset": offset, "written": len(data)})
            return 0
        length = lsa_size - offset if args.length is None else parse_size(args.length)
        if offset < 0 or length < 0 or offset + length > lsa_size:
            raise CliError(f"range [{offset}, {offset + length}) runs past the {lsa_size}-byte LSA")
        data = md.get_lsa(offset, length)
    print_json({"memdev": args.name, "offset": offset, "length": length, "data": data.hex()})
    return 0


def cmd_fw_info(args: argparse.Namespace) -> int:
    with device(args.name, args.host) as md:
        info = md.fw_info()
    return _emit(args, f"{args.name}: firmware", {"memdev": args.name, **asdict(info),
                                                  "revisions": list(info.revisions)})


def cmd_fw_pack(args: argparse.Namespace) -> int:
    from emulator.fwslots import build_image
    from emulator.spec.errors import ConfigError

    body = b""
    if args.body is not None:
        try:
            body = Path(args.body).read_bytes()
        except OSError as exc:
            raise CliError(f"cannot read --body {args.body}: {exc.strerror}") from None
    try:
        image = build_image(args.revision, body)
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    try:
        Path(args.output).write_bytes(image)
    except OSError as exc:  # a bad -o is a bad argument: exit 2, the reason without the errno noise
        raise CliError(f"cannot write --output {args.output}: {exc.strerror or exc}") from None
    print_json({"output": args.output, "revision": args.revision, "size": len(image)})
    return 0


@contextmanager
def progress_bar(description: str) -> Iterator[Any]:
    """A rich progress bar on stderr (stdout stays JSON); yields `update(done, total)`."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True)) as bar:
        task = bar.add_task(description, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def cmd_fw_update(args: argparse.Namespace) -> int:
    try:
        image = Path(args.file).read_bytes()
    except OSError as exc:
        raise CliError(f"cannot read {args.file}: {exc.strerror}") from None
    with device(args.name, args.host) as md:
        info = md.fw_info()
        slot = parse_int(args.slot, "slot") if args.slot is not None else \
            next(s for s in range(1, info.slots_supported + 1) if s != info.active_slot)
        with progress_bar(f"{args.name}: firmware -> slot {slot}") as bar:
            md.update_firmware(image, slot, progress=bar)
        revision = md.fw_info().revisions[slot - 1]
    print_json({"memdev": args.name, "slot": slot, "revision": revision, "size": len(image)})
    return 0


def cmd_fw_activate(args: argparse.Namespace) -> int:
    slot = parse_int(args.slot, "slot")
    with device(args.name, args.host) as md:
        md.activate_firmware(slot, online=not args.on_reset)
        info = md.fw_info()
    print_json({"memdev": args.name, "active_slot": info.active_slot, "staged_slot": info.staged_slot,
                "firmware_version": info.revisions[info.active_slot - 1]})
    return 0
