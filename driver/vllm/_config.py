"""The tier's configuration (vLLM's ``kv_connector_extra_config``) and its layout on the device.

Nothing here imports vLLM: ``cxlemu bench serve`` and the tests build configurations whether or
not vLLM is installed. The counters are in ``_stats``, the manager's page in ``_counters``.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from emulator.spec.errors import ConfigError
from firmware_model.kv_codec import FORMATS
from firmware_model.policies import POLICY_NAMES, resolve_policy

__all__ = ["PREFETCH_MODES", "TierConfig", "chunk_of_dpa", "hotlist_unit", "kv_transfer_config", "parse_extra_config",
           "tier_region"]

PREFETCH_MODES = ("forward", "layer")
"""``forward``: a request's blocks are loaded before its forward starts (vLLM's offload).
``layer``: its forward starts at once and layer l waits only for layer l's blocks."""

_KNOWN = {"spec_name", "spec_module_path", "device", "policy", "cxl_bytes_to_use", "prefetch",
          "channels", "block_size", "offload_prompt_only", "self_describing_kv_events",
          "store_threshold", "max_tracker_size", "hotlist_every", "window", "staging", "staging_bytes",
          "kv_format", "shared", "host"}


@dataclass(frozen=True)
class TierConfig:
    """What the tier takes from ``kv_connector_extra_config``, checked."""

    device: str | None  # a served device's name; None: a private device in-process
    policy: str  # a firmware_model policy name or "package.module:Class"
    cxl_bytes_to_use: int  # the tier's share of the device, bytes
    prefetch: str = "forward"
    channels: int = 2  # DMA channels: loads on one, stores on the other
    hotlist_every: int = 64  # "hotness": read the CHMU's hotlist every this many scheduler steps
    window: str = "auto"  # layer-wise: layers issued ahead, firmware_model.prefetch.resolve_window
    staging: bool | None = None  # KV through a host bounce buffer; None: where the KV is not on the CPU
    staging_bytes: int = 2 << 30  # the bounce buffer: whole blocks (>= 1); a 7B's 4096-token context at fp16
    kv_format: str = "native"  # blocks on the device: the KV's bytes, or firmware_model.kv_codec's int8 / int4
    shared: bool = False  # the device's KV pool is shared with the other engines on it (driver.pool)
    host: int = 0  # the device's host port this engine uses (MemDev.open(device, host=host))


def _int(extra: Mapping[str, Any], key: str, default: int | None, low: int) -> int:
    value = extra.get(key, default)
    if value is None:
        raise ConfigError(f"kv_connector_extra_config[{key!r}] is required (an int >= {low})")
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be an int >= {low}, got {value!r}")
    return value


def parse_extra_config(extra: Mapping[str, Any]) -> TierConfig:
    """The tier's settings from vLLM's ``kv_connector_extra_config``; ``ConfigError`` (a
    ``ValueError``) naming the key and what it takes for anything else."""
    unknown = sorted(set(extra) - _KNOWN)
    if unknown:
        raise ConfigError(f"kv_connector_extra_config: unknown key(s) {', '.join(map(repr, unknown))}; "
                          f"the cxlemu tier takes {', '.join(sorted(_KNOWN))}")
    device = extra.get("device")
    if device is not None and (not isinstance(device, str) or not device):
        raise ConfigError(f"kv_connector_extra_config['device'] must be a served device's name, got {device!r}")
    policy = extra.get("policy", "lru")
    if not isinstance(policy, str):
        raise ConfigError(f"kv_connector_extra_config['policy'] must be a string: one of "
                          f"{', '.join(POLICY_NAMES)} or 'package.module:Class', got {policy!r}")
    if policy == "opt":
        raise ConfigError("kv_connector_extra_config['policy']: 'opt' needs the future and cannot run a "
                          "cache; choose one of " + ", ".join(n for n in POLICY_NAMES if n != "opt"))
    try:  # an unknown name or a class that does not fit: refused now, not at the first eviction
        resolve_policy(policy)
    except ValueError as exc:
        raise ConfigError(f"kv_connector_extra_config['policy']: {exc}") from None
    prefetch = extra.get("prefetch", "forward")
    if prefetch not in PREFETCH_MODES:
        raise ConfigError(f"kv_connector_extra_config['prefetch'] must be one of {PREFETCH_MODES}, got {prefetch!r}")
    window = extra.get("window", "auto")
    try:
        from firmware_model.prefetch import resolve_window

        resolve_window(window)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"kv_connector_extra_config['window']: {exc}") from None
    staging = extra.get("staging")
    if staging is not None and not isinstance(staging, bool):
        raise ConfigError(f"kv_connector_extra_config['staging'] must be true, false or absent (staged where "
                          f"the KV is not in host memory: CUDA), got {staging!r}")
    kv_format = extra.get("kv_format", "native")
    if kv_format not in FORMATS:
        raise ConfigError(f"kv_connector_extra_config['kv_format'] must be one of {', '.join(map(repr, FORMATS))} "
                          f"(native: the KV's own bytes; int8, int4: quantized on the device), got {kv_format!r}")
    if kv_format != "native" and staging:
        raise ConfigError(f"kv_connector_extra_config['kv_format']={kv_format!r} encodes KV in host memory (CPU); "
                          "staged KV (CUDA) is moved native: leave kv_format out or staging false")
    shared = extra.get("shared", False)
    if not isinstance(shared, bool):
        raise ConfigError(f"kv_connector_extra_config['shared'] must be true or false, got {shared!r}")
    if shared and device is None:
        raise ConfigError("kv_connector_extra_config['shared']: a pool is shared on a served device; name it in "
                          "'device' (cxlemu serve --name NAME --hosts N)")
    if shared and kv_format != "native":
        raise ConfigError(f"kv_connector_extra_config['kv_format']={kv_format!r} with 'shared': the pool keeps "
                          "blocks as the engines' own bytes, which every engine reads; leave kv_format out")
    return TierConfig(device=device, policy=policy, cxl_bytes_to_use=_int(extra, "cxl_bytes_to_use", None, 1),
                      prefetch=prefetch, channels=_int(extra, "channels", 2, 1),
                      hotlist_every=_int(extra, "hotlist_every", 64, 1), window=window, staging=staging,
                      staging_bytes=_int(extra, "staging_bytes", 2 << 30, 1), kv_format=kv_format, shared=shared,
                      host=_int(extra, "host", 0, 0))


def kv_transfer_config(*, device: str | None = None, policy: str = "lru", prefetch: str = "forward",
                       cxl_bytes_to_use: int, recompute_failed_loads: bool = True, shared: bool = False,
                       host: int = 0, **extra: Any) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for the cxlemu tier through :class:`CxlConnector`.

    ``shared``: the engine looks up, loads and publishes blocks in the device's KV pool, which
    every engine on the device shares (``host``: this engine's host port; each engine process
    takes its own).

    ``recompute_failed_loads``: vLLM's ``kv_load_failure_policy`` "recompute" (a block that fails
    to load is computed again; the request goes on) rather than "fail" (the request ends with an
    error)."""
    cfg = {"device": device, "policy": policy, "prefetch": prefetch, "cxl_bytes_to_use": cxl_bytes_to_use,
           **({"shared": shared} if shared else {}), **({"host": host} if host else {}), **extra}
    if device is None:
        del cfg["device"]
    parse_extra_config(cfg)
    return {"kv_connector": "CxlConnector", "kv_connector_module_path": "driver.vllm", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute" if recompute_failed_loads else "fail",
            "kv_connector_extra_config": cfg}


def hotlist_unit(page: int) -> int:
    """The CHMU unit for pages of ``page`` bytes: the largest power of two dividing it, within
    the unit sizes a CHMU offers (256 B to 2 MiB), so no unit straddles two pages."""
    if isinstance(page, bool) or not isinstance(page, int) or page <= 0:
        raise ValueError(f"page must be an int > 0 bytes, got {page!r}")
    return min(max(page & -page, 256), 2 << 20)


def chunk_of_dpa(dpa: int, page: int, num_chunks: int) -> int:
    """The chunk a DPA of the tier's region belongs to, for equal pages of ``page`` bytes per
    layer (the worker's layer-major layout, driver/vllm/_worker.py)."""
    return (dpa // page) % num_chunks


def tier_region(capacity: int, hosts: int, host: int) -> tuple[int, int]:
    """``(base, size)`` of host port ``host``'s private tier on a device of ``capacity`` static
    bytes and ``hosts`` ports: the static capacity cut in equal 1 MiB-aligned parts, one per port,
    so engines on different ports never overlap (the shared pool lives in Dynamic Capacity)."""
    if not 0 <= host < hosts:
        raise ConfigError(f"kv_connector_extra_config['host'] must be a host port of the device: 0 to {hosts - 1}, "
                          f"got {host}")
    size = (capacity // hosts) & ~((1 << 20) - 1)
    return host * size, size
