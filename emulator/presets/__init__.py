"""Timing presets: TOML files shipped in this package, each naming the source of its numbers.

A preset has ``name``, ``description``, ``source``, an optional ``note``, a ``[timing]`` table
(``TimingConfig`` fields) and optionally a ``[relative]`` table whose ``latency_factor`` and
``bandwidth_fraction`` are applied to this host's local memory (``emulator.timing.localmem``):
added latency = (factor − 1) × local latency, bandwidth = fraction × local bandwidth, as
CXL-DMSim states its expanders against local DRAM.  Values in ``[timing]`` win over derived ones.

How to add one: drop ``<name>.toml`` here with the fields above; ``cxlemu presets`` lists it.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import tomllib

from emulator.spec.errors import ConfigError
from emulator.timing.config import TimingConfig

__all__ = ["Preset", "UnknownPreset", "load", "load_all", "names"]

_TOP_KEYS = {"name", "description", "source", "note", "timing", "relative"}
_RELATIVE_KEYS = {"latency_factor", "bandwidth_fraction"}


class UnknownPreset(ConfigError, KeyError):
    """No preset of that name (a ConfigError, and a KeyError for dict-like callers)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    source: str
    timing: TimingConfig
    note: str = ""
    derived_from: str = ""  # for relative presets: the local numbers used


def _files() -> dict[str, Path]:
    root = resources.files(__name__)
    return {Path(str(f)).stem: Path(str(f)) for f in root.iterdir() if str(f).endswith(".toml")}


def names() -> list[str]:
    """Shipped preset names, sorted."""
    return sorted(_files())


def _relative_timing(rel: dict[str, Any], where: str) -> tuple[dict[str, float], str]:
    unknown = set(rel) - _RELATIVE_KEYS
    if unknown or set(rel) != _RELATIVE_KEYS:
        raise ConfigError(f"{where}: [relative] needs exactly {sorted(_RELATIVE_KEYS)}, got {sorted(rel)}")
    factor, fraction = float(rel["latency_factor"]), float(rel["bandwidth_fraction"])
    if factor < 1 or not 0 < fraction <= 1:
        raise ConfigError(f"{where}: latency_factor must be >= 1 and bandwidth_fraction in (0, 1], "
                          f"got {factor}, {fraction}")
    from emulator.timing.localmem import local_memory

    local = local_memory()
    added = round((factor - 1) * local.latency_ns, 1)
    bw = round(fraction * local.bandwidth_gbps, 3)
    derived = (f"local {local.latency_ns:.1f} ns, {local.bandwidth_gbps:.2f} GB/s ({local.source}): "
               f"+{added:g} ns = ({factor:g} - 1) x local, {bw:g} GB/s = {fraction:g} x local")
    return ({"read_latency_ns": added, "write_latency_ns": added,
             "read_bandwidth_gbps": bw, "write_bandwidth_gbps": bw}, derived)


def parse(text: str, where: str) -> Preset:
    """A preset from TOML text; ``where`` names it in errors."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: not valid TOML: {exc}") from None
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}; known: {sorted(_TOP_KEYS)}")
    for key in ("name", "description", "source"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise ConfigError(f"{where}: '{key}' must be a non-empty string (every preset cites its source)")
    fields: dict[str, Any] = {}
    derived = ""
    if "relative" in data:
        fields, derived = _relative_timing(data["relative"], where)
    fields.update(data.get("timing", {}))
    try:
        timing = TimingConfig.from_dict(fields)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return Preset(name=data["name"], description=data["description"], source=data["source"],
                  timing=timing, note=data.get("note", ""), derived_from=derived)


def load(name: str) -> Preset:
    """A shipped preset by name, or a ``.toml`` file by path.  Raises ``UnknownPreset``."""
    if name.endswith(".toml") and Path(name).is_file():
        return parse(Path(name).read_text(), name)
    files = _files()
    if name not in files:
        raise UnknownPreset(f"unknown preset {name!r}: choose one of {', '.join(sorted(files))}")
    preset = parse(files[name].read_text(), f"preset {name}")
    if preset.name != name:
        raise ConfigError(f"preset file {name}.toml names itself {preset.name!r}")
    return preset


def load_all() -> list[Preset]:
    return [load(n) for n in names()]
