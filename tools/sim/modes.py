"""The serving modes: where a request's KV may live besides the accelerator's own KV space, and
how it comes back. One table for the simulator (``tools.sim.run``), ``cxlemu bench serve``
(``tools.bench.serve``, which runs each on vLLM-CPU with a cxlemu device as the tier) and
``cxlemu sim validate`` (which simulates each of the bench's modes as the bench ran it).

* ``all-resident``    a KV space for every client: the bench's reference (no tier);
* ``none``            the accelerator's KV space alone; preemption by recompute (the simulator's
                      ``--preemption swap``: a preempted request's blocks go to host memory);
* ``host-lru``        + host memory over PCIe (``pcie-host``: Gen4 x16), LRU, loads before the
                      forward (vLLM's CPU offload);
* ``cxl-lru``         + a CXL pool on a Leo-class x16 link (``leo-x16``), LRU, before the forward;
* ``cxl-arc-forward`` the pool, ARC, before the forward (the bench's control for layer-wise loads);
* ``cxl-smart``       the pool, the smart firmware: ARC (or the simulator's ``smart_policy``),
                      loads layer by layer inside the forward.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BENCH_MODES", "CXL_MODES", "DEFAULT_LINKS", "MODES", "SIM_MODES", "Mode", "parse_modes"]


@dataclass(frozen=True)
class Mode:
    name: str
    tier: str | None  # None: no tier; "host": host memory behind the host link; "cxl": the CXL pool
    policy: str = "lru"  # the tier's eviction policy (a firmware_model policy name)
    prefetch: str = "forward"  # "forward": load, then schedule; "layer": load inside the step, layer by layer
    smart: bool = False  # its policy is the simulator's ``smart_policy`` (the sweep's policy dimension)


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("all-resident", None),
    Mode("none", None),
    Mode("host-lru", "host"),
    Mode("cxl-lru", "cxl"),
    Mode("cxl-arc-forward", "cxl", "arc"),
    Mode("cxl-smart", "cxl", "arc", "layer", smart=True),
)}

#: the modes ``cxlemu sim serve`` and ``sim sweep`` run (all-resident is ``none`` with a huge
#: ``--kv-blocks``; cxl-arc-forward is ``cxl-smart`` with ``prefetch="forward"``), in table order
SIM_MODES = ("none", "host-lru", "cxl-lru", "cxl-smart")
#: the modes ``cxlemu bench serve`` runs, in its order
BENCH_MODES = ("all-resident", "none", "host-lru", "cxl-lru", "cxl-arc-forward", "cxl-smart")
#: the simulator's modes with a CXL pool (the ones a pool size applies to)
CXL_MODES = tuple(m for m in SIM_MODES if MODES[m].tier == "cxl")
#: the emulator timing preset of each kind of tier's link
DEFAULT_LINKS = {"host": "pcie-host", "cxl": "leo-x16"}


def parse_modes(text: str, known: tuple[str, ...] = SIM_MODES) -> list[str]:
    """Comma-separated modes of ``known``; ValueError names the known ones."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in known]
    if bad or not modes:
        raise ValueError(f"unknown mode {bad[0] if bad else text!r}: choose from {', '.join(known)}")
    return modes
