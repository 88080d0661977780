"""NUMA placement of a device's media: bind the mapping to a node, ask where it lives.

The media of an emulated expander should sit where a real one would: on a CPU-less or remote
node when the host has one (Pond's zNUMA).  Binding goes through py-libnuma's ctypes handle on
libnuma (``numa_tonode_memory``, an mbind of the range); a shared tmpfs mapping keeps the policy
for every process mapping the file.  A machine with one node has nowhere else to put it: the
media stays in local memory and ``bind`` says so in one line.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import numpy as np

from emulator.spec.errors import ConfigError

__all__ = ["bind", "node_count", "numa_node_of", "online_nodes"]

_MPOL_F_NODE, _MPOL_F_ADDR = 1, 2
_NODE_ONLINE = Path("/sys/devices/system/node/online")


def online_nodes() -> list[int]:
    """Online node ids from sysfs (``0-1,3`` → [0, 1, 3]); [0] where sysfs has no NUMA."""
    try:
        text = _NODE_ONLINE.read_text().strip()
    except OSError:
        return [0]
    nodes: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        nodes.extend(range(int(lo), int(hi or lo) + 1))
    return nodes or [0]


def node_count() -> int:
    return len(online_nodes())


def _libnuma() -> Any | None:
    try:
        import numa  # py-libnuma; without libnuma.so its module-level calls fail too
    except (ImportError, OSError, AttributeError):
        return None
    lib = numa.LIBNUMA
    return lib if lib.numa_available() != -1 else None


def _address(buffer: Any) -> tuple[int, int]:
    """Start address and length of a writable buffer (mmap, bytearray, numpy array)."""
    arr = np.frombuffer(buffer, dtype=np.uint8)
    addr, size = int(arr.ctypes.data), int(arr.nbytes)
    del arr
    return addr, size


def bind(buffer: Any, node: int | None) -> str | None:
    """Bind ``buffer``'s pages to ``node`` (None: leave the default, local, policy).

    Returns None when bound (or nothing was asked), or a one-line notice when the machine
    cannot honour it (one node, libnuma missing); raises ``ConfigError`` for a node the
    machine does not have."""
    if node is None:
        return None
    if isinstance(node, bool) or not isinstance(node, int) or node < 0:
        raise ConfigError(f"numa node must be an int >= 0 or None, got {node!r}")
    nodes = online_nodes()
    if len(nodes) == 1:
        if node == nodes[0]:
            return None  # already where every page of this machine lives
        return (f"one NUMA node on this machine: media stays in local memory "
                f"(node {nodes[0]}), not node {node}")
    if node not in nodes:
        raise ConfigError(f"numa node {node} is not online; online nodes: {nodes}")
    lib = _libnuma()
    if lib is None:
        return f"py-libnuma/libnuma unavailable: media not bound to node {node} (pip install py-libnuma)"
    addr, size = _address(buffer)
    page = os.sysconf("SC_PAGE_SIZE")
    if addr % page:
        return f"media buffer is not page-aligned: not bound to node {node} (use an mmap)"
    lib.numa_tonode_memory.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.numa_tonode_memory.restype = None
    lib.numa_tonode_memory(ctypes.c_void_p(addr), ctypes.c_size_t(size), ctypes.c_int(node))
    return None


def numa_node_of(buffer: Any, offset: int = 0) -> int | None:
    """The node holding the page at ``offset`` of ``buffer`` (faulting it in if absent), or
    None when the kernel will not say (no libnuma, no NUMA)."""
    lib = _libnuma()
    if lib is None:
        return None
    addr, size = _address(buffer)
    if not 0 <= offset < size:
        raise ValueError(f"offset {offset:#x} outside the buffer ({size:#x} B)")
    mode = ctypes.c_int(-1)
    lib.get_mempolicy.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_ulong,
                                  ctypes.c_void_p, ctypes.c_uint]
    lib.get_mempolicy.restype = ctypes.c_int
    rc = lib.get_mempolicy(ctypes.byref(mode), None, 0, ctypes.c_void_p(addr + offset),
                           _MPOL_F_NODE | _MPOL_F_ADDR)
    return int(mode.value) if rc == 0 else None
