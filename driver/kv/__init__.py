"""KV cache offload onto a cxlemu device: the transformers ``CxlCache`` and its parts."""
from driver.kv._chunks import ChunkPool, DeviceFull
from driver.kv._engine import KVLoadError, ResidencyEngine
from driver.kv._layout import BudgetTooSmall, KVLayout
from driver.kv._store import BlockStore, FaultInjectingStore, MemoryBlockStore

__all__ = ["BlockStore", "BudgetTooSmall", "ChunkPool", "CxlCache", "DeviceFull", "FaultInjectingStore",
           "KVLayout", "KVLoadError", "MemoryBlockStore", "ResidencyEngine"]


def __getattr__(name: str) -> object:
    # transformers is optional for the rest of cxlemu: import it only when CxlCache is asked for
    if name == "CxlCache":
        from driver.kv.cache import CxlCache
        return CxlCache
    raise AttributeError(name)
