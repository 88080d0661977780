"""The grid of ``cxlemu sim sweep``: models x accelerators x pool sizes x policies x workloads x
modes x concurrency levels as :class:`~tools.sim.run.Point` s (:func:`expand`), each row's
identifying fields and its sort order.

Dimensions that do not apply collapse: the eviction policy applies to ``cxl-smart`` only (its
``smart_policy``), the pool size to the ``cxl-*`` modes only (``pool_gb``); the other modes get
one point each with ``policy`` and ``pool_gb`` shown as ``"-"``. In the plots those modes are
the baselines drawn in every (pool, policy) group.
"""
from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from tools.sim import hardware as hw
from tools.sim.modes import CXL_MODES, SIM_MODES
from tools.sim.profile import COST_MODELS
from tools.sim.run import ConcurrencyError, Point

__all__ = ["DEFAULT_GRID", "NA", "WORKLOADS", "SweepError", "expand", "point_fields", "sort_key", "workload_label"]

#: The named workload presets (``--workloads``); ``fixed``'s context is the grid's ``context``.
WORKLOADS: dict[str, dict[str, Any]] = {
    "fixed": {"kind": "fixed", "context": 4096, "output_tokens": 128, "requests": 8},
    # long turns (1024 new tokens each): from ~20 open sessions on, a 7B's history outgrows an
    # 80 GB accelerator's KV space, so the modes differ
    "sessions": {"kind": "sessions", "sessions": 96, "turns": 4, "system_tokens": 1024, "system_prompts": 4,
                 "user_tokens": 1024, "output_tokens": 128, "think_s": 5.0},
}
NA = "-"  # a dimension that does not apply to the row's mode

#: The grid the CLI starts from; every key may be overridden.
DEFAULT_GRID: dict[str, Any] = {
    "models": ["llama-2-7b"], "accelerators": ["h100"], "pool_gb": [1024.0], "policies": ["arc"],
    "workloads": ["fixed", "sessions"], "modes": list(SIM_MODES), "concurrency": [1, 2, 4, 8, 16, 32],
    "tp": [1], "cost": ["roofline"],
}



class SweepError(ValueError):
    """A bad grid value; ``key`` is the grid key (``models``, ``pool_gb``, ...) to change."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def _online_policies() -> tuple[str, ...]:
    from firmware_model.policies import ONLINE_POLICY_NAMES

    return ONLINE_POLICY_NAMES




def workload_label(spec: Mapping[str, Any]) -> str:
    """A preset's name for a preset's spec; else its kind and the keys that differ from that
    kind's preset, e.g. ``fixed(context=512,requests=2)``."""
    for name, preset in WORKLOADS.items():
        if dict(spec) == preset:
            return name
    kind = str(spec.get("kind", "?"))
    base = WORKLOADS.get(kind, {})
    diff = ",".join(f"{k}={v}" for k, v in spec.items() if k != "kind" and base.get(k) != v)
    return f"{kind}({diff})" if diff else kind


def _workload_specs(grid: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The grid's workloads as specs: a name (a preset) or a dict (passed through)."""
    context = grid.get("context")
    contexts = [None] if context is None else (list(context) if isinstance(context, (list, tuple)) else [context])
    for c in contexts:
        if c is not None and (not isinstance(c, int) or c < 1):
            raise SweepError("context", f"context must be a whole number of tokens >= 1, got {c!r}")
    specs: list[dict[str, Any]] = []
    for w in grid.get("workloads", DEFAULT_GRID["workloads"]):
        if isinstance(w, Mapping):
            if w.get("kind") not in ("fixed", "sessions", "trace", "bench"):
                raise SweepError("workloads", f"workload dict {dict(w)!r} needs kind fixed, sessions, trace or bench")
            specs.append(dict(w))
        elif w not in WORKLOADS:
            raise SweepError("workloads", f"unknown workload {w!r}: choose from {', '.join(WORKLOADS)}")
        elif w == "fixed":
            specs.extend(dict(WORKLOADS[w], **({} if c is None else {"context": c})) for c in contexts)
        else:
            specs.append(dict(WORKLOADS[w]))
    return specs


def _names(grid: Mapping[str, Any], key: str, known: Sequence[str], what: str) -> list[str]:
    values = list(grid.get(key, DEFAULT_GRID[key]))
    if not values:
        raise SweepError(key, f"no {key} given: name at least one of {', '.join(known)}")
    for v in values:
        if v not in known:
            raise SweepError(key, f"unknown {what} {v!r}: choose from {', '.join(known)}")
    return values


def _numbers(grid: Mapping[str, Any], key: str, kind: type, what: str) -> list[Any]:
    values = list(grid.get(key, DEFAULT_GRID[key]))
    if not values:
        raise SweepError(key, f"no {key} given: give at least one {what}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)) \
                or not v > 0:
            raise SweepError(key, f"{key} must be {what}s > 0, got {v!r}")
    return values


def expand(grid: Mapping[str, Any]) -> list[Point]:
    """The grid's cartesian product as points, deduplicated and in grid order.

    Keys (each a list; missing ones take :data:`DEFAULT_GRID`'s): ``models``, ``accelerators``,
    ``tp`` (accelerators per instance), ``cost`` (cost models: roofline, profile), ``pool_gb``,
    ``policies``, ``workloads`` (preset names, or workload dicts passed through), ``modes``,
    ``concurrency``, and ``context`` (an int or a list: the ``fixed`` preset's context).
    ``policies`` varies ``cxl-smart`` only and ``pool_gb`` the ``cxl-*`` modes only; the other
    modes keep the first value. Raises :class:`SweepError` (a ValueError) naming the key."""
    models = _names(grid, "models", tuple(hw.MODELS), "model")
    accs = _names(grid, "accelerators", tuple(hw.ACCELERATORS), "accelerator")
    modes = _names(grid, "modes", SIM_MODES, "mode")
    policies = _names(grid, "policies", _online_policies(), "eviction policy")
    pools = [float(p) for p in _numbers(grid, "pool_gb", float, "pool size in GB")]
    levels = _numbers(grid, "concurrency", int, "whole number")
    tps = _numbers(grid, "tp", int, "whole number")
    costs = _names(grid, "cost", COST_MODELS, "cost model")
    workloads = _workload_specs(grid)
    if not workloads:
        raise SweepError("workloads", f"no workloads given: name at least one of {', '.join(WORKLOADS)}")
    for model, acc, tp in itertools.product(models, accs, tps):  # each level within what the KV space holds
        try:
            base = Point(model=model, accelerator=acc, tp=tp, concurrency=max(levels))
        except ValueError as e:  # the model does not split tp ways
            raise SweepError("tp", str(e)) from None
        try:
            base.check_concurrency()
        except ConcurrencyError as e:
            raise SweepError("concurrency", str(e)) from None
    out: list[Point] = []
    seen: set[str] = set()
    for model, acc, tp, cost, wl, mode in itertools.product(models, accs, tps, costs, workloads, modes):
        mode_pools = pools if mode in CXL_MODES else pools[:1]
        mode_policies = policies if mode == "cxl-smart" else policies[:1]
        for pool, policy, c in itertools.product(mode_pools, mode_policies, levels):
            p = Point(mode=mode, concurrency=c, model=model, accelerator=acc, tp=tp, cost_model=cost,
                      workload=dict(wl), pool_gb=pool, smart_policy=policy)
            key = json.dumps(p.to_dict(), sort_keys=True, default=str)
            if key not in seen:
                seen.add(key)
                out.append(p)
    return out


def point_fields(p: Point) -> dict[str, Any]:
    """The identifying fields of a point's row."""
    return {"model": p.model, "accelerator": p.accelerator, "tp": p.tp, "cost_model": p.cost_model,
            "workload": workload_label(p.workload),
            "pool_gb": p.pool_gb if p.mode in CXL_MODES else NA,
            "policy": p.smart_policy if p.mode == "cxl-smart" else NA, "mode": p.mode,
            "concurrency": p.concurrency, "host_gb": p.host_gb if p.mode == "host-lru" else NA}


def sort_key(row: Mapping[str, Any]) -> tuple[Any, ...]:
    """(model, accelerator, tp, cost model, workload, pool, policy, mode in SIM_MODES order, concurrency)."""
    pool = row.get("pool_gb", NA)
    mode = row.get("mode")
    return (row.get("model", ""), row.get("accelerator", ""), row.get("tp", 1), row.get("cost_model", ""),
            row.get("workload", ""),
            -1.0 if pool == NA else float(pool), row.get("policy", NA),
            SIM_MODES.index(mode) if mode in SIM_MODES else len(SIM_MODES), row.get("concurrency", 0))
