"""A device: its directory under the runtime dir (``emulator.device_dir``: configuration, files,
create / provision / destroy) and serving it in this process (``emulator.serving``). Hosts, tools
and tests import these names from here."""
from __future__ import annotations

from emulator.device_dir import (
    CAPACITY_UNIT,
    MAX_HOSTS,
    DeviceConfig,
    DeviceFiles,
    check_backing,
    destroy,
    device_path,
    device_state,
    firmware_pid,
    host_claims,
    list_devices,
    load_config,
    numa_node,
    open_bar,
    poison_bitmap_size,
    provision,
    runtime_dir,
)
from emulator.serving import Served, bind_media, serve

__all__ = [
    "CAPACITY_UNIT", "MAX_HOSTS", "DeviceConfig", "DeviceFiles", "Served", "bind_media", "check_backing", "destroy",
    "device_path", "device_state", "firmware_pid", "host_claims", "list_devices", "load_config", "numa_node", "open_bar",
    "poison_bitmap_size", "provision", "runtime_dir", "serve",
]
