"""cxlemu as vLLM's KV offload tier.

Two plug points, both loaded by vLLM from this module path (vLLM need not be installed for the
rest of cxlemu: the classes import vLLM only when vLLM asks for them)::

    # vLLM's own offloading connector, with the device as its tier (loads before the forward)
    LLM(model=..., kv_transfer_config={
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "CxlOffloadingSpec", "spec_module_path": "driver.vllm",
            "device": "mem0",              # a served device; absent: a private one in-process
            "policy": "arc",               # any firmware_model policy; "hotness" uses the CHMU
            "cxl_bytes_to_use": 1 << 30}})

    # the same tier through CxlConnector: vLLM's load-failure path (a poisoned block or a failed
    # DMA is recomputed) and layer-wise prefetch ("prefetch": "layer")
    LLM(model=..., kv_transfer_config=kv_transfer_config(device="mem0", policy="arc",
                                                         prefetch="layer", cxl_bytes_to_use=1 << 30))

``tier_stats(name)`` reads the counters of the tier on device ``name`` in this process.
"""
from __future__ import annotations

from typing import Any

from driver.vllm._config import PREFETCH_MODES, TierConfig, kv_transfer_config, parse_extra_config
from driver.vllm._counters import ManagerCounters
from driver.vllm._stats import TierStats, reset_tier_stats, tier_stats

__all__ = ["PREFETCH_MODES", "CxlConnector", "CxlOffloadingSpec", "CxlOffloadingWorker", "ManagerCounters", "TierConfig",
           "TierStats", "kv_transfer_config", "live_worker", "parse_extra_config", "reset_tier_stats", "tier_stats"]

# the worker is public too: `cxlemu bench tier` drives one directly, `bench serve` finds the live one
_LAZY = {"CxlOffloadingSpec": "driver.vllm._spec", "CxlConnector": "driver.vllm._connector",
         "CxlOffloadingWorker": "driver.vllm._worker", "live_worker": "driver.vllm._worker"}


def __getattr__(name: str) -> Any:
    """vLLM's factories ``getattr`` the class by name: import it (and vLLM) only then."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'driver.vllm' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
