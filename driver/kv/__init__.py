"""KV cache offload onto a cxlemu device: the transformers ``CxlCache`` and its parts.

    from driver.kv import CxlCache
    cache = CxlCache(hbm_budget_bytes=256 << 20, policy="reuse")   # a private device
    out = model.generate(input_ids, attention_mask=mask, past_key_values=cache)
    print(cache.stats()); cache.close()

Pieces: ``cache`` (the transformers Cache), ``_engine`` (residency of layer frames: hits,
prefetch, eviction by the firmware model's policy), ``_chunkio`` (block tables, prefix sharing,
transfer plans), ``_arena`` (frames within the budget, staging), ``_mover`` (CPU / CUDA copies
and their ordering), ``_store`` / ``_device_store`` (where chunks live), ``_chunks`` (chunk ids
on the firmware block pool), ``_recompute`` (lost chunks from the tokens), ``_telemetry``.
"""
from driver.kv._chunks import ChunkPool, DeviceFull
from driver.kv._device_store import DeviceBlockStore, DeviceInUse, claim_kv
from driver.kv._engine import KVLoadError, ResidencyEngine
from driver.kv._layout import BudgetTooSmall, KVLayout
from driver.kv._recompute import cache_argument
from driver.kv._store import BlockStore, FaultInjectingStore, MemoryBlockStore
from driver.kv._telemetry import host_writer, sharing_gauges

# The vLLM tier (driver.vllm) and the benches use the device store, the one-process claim, the
# telemetry writer and the prefix-sharing gauges as well: public here, their modules stay private.
__all__ = ["BlockStore", "BudgetTooSmall", "ChunkPool", "CxlCache", "DeviceBlockStore", "DeviceFull", "DeviceInUse",
           "FaultInjectingStore", "KVLayout", "KVLoadError", "MemoryBlockStore", "ResidencyEngine", "cache_argument",
           "claim_kv", "host_writer", "sharing_gauges"]


def __getattr__(name: str) -> object:
    # transformers is optional for the rest of cxlemu: import it only when CxlCache is asked for
    if name == "CxlCache":
        from driver.kv.cache import CxlCache
        return CxlCache
    raise AttributeError(name)
