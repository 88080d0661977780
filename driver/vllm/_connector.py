"""``CxlConnector``: vLLM's offloading connector over the cxlemu tier, with what the stock one lacks.

``OffloadingConnector`` asserts that every transfer succeeds (a poisoned block would stop the
engine) and loads a request's blocks before its forward. ``CxlConnector`` is that connector with
``CxlOffloadingSpec`` as its tier and:

* **load failures** reported through vLLM's load-failure path: a load job that failed (a
  poisoned line, a DMA error, a device gone) still completes for the scheduler, and its KV-space
  blocks are returned by ``get_block_ids_with_load_errors`` so vLLM recomputes them
  (``kv_load_failure_policy: "recompute"``) or fails the request ("fail"); it never attends to
  what did not arrive. A failed store is dropped: its blocks are recomputed if ever wanted.
* **layer-wise prefetch** (``"prefetch": "layer"``): a request with blocks in the tier is
  scheduled at once (a synchronous load in vLLM's terms) and its forward waits, layer by layer,
  only for that layer's blocks (``wait_for_layer_load``), which the worker issues a window of
  layers ahead of the forward's progress.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from driver.vllm import _compat
from driver.vllm._compat import (
    KVConnectorRole,
    OffloadingConnector,
    OffloadingConnectorWorker,
    OffloadingWorkerMetadata,
    init_logger,
)
from driver.vllm._config import parse_extra_config
from emulator.spec.errors import ConfigError

__all__ = ["CxlConnector"]

logger = init_logger(__name__)


@dataclass
class CxlWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's completed jobs plus the ones that failed (they complete too): the scheduler side
    drops a failed job's blocks from the tier, or every later lookup would find them again and
    every load fail again."""

    failed_jobs: set[int] = field(default_factory=set)

    def aggregate(self, other: Any) -> Any:
        merged = super().aggregate(other)
        return CxlWorkerMetadata(completed_jobs=merged.completed_jobs, transfer_stats=merged.transfer_stats,
                                 failed_jobs=self.failed_jobs | getattr(other, "failed_jobs", set()))


class _CxlConnectorWorker(OffloadingConnectorWorker):
    """The worker side: failed jobs reported, layer-wise loads issued and waited per layer."""

    def __init__(self, spec: Any, vllm_config: Any, kv_cache_config: Any, layerwise: bool) -> None:
        super().__init__(spec, vllm_config, kv_cache_config)
        self.layerwise = layerwise
        self._load_blocks: dict[int, list[int]] = {}  # load job -> the KV-space blocks it fills
        self._load_errors: set[int] = set()
        self._failed_jobs: set[int] = set()
        self._layer_jobs: list[int] = []  # layer-wise loads of the step being computed
        self._layer_index: dict[str, int] = {}

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        # which tier tensor holds each attention layer (the tensors are the layers' own views)
        by_ptr = {t.data_ptr(): i for i, t in enumerate(self.worker.tensors)}
        for name, tensor in kv_caches.items():
            idx = by_ptr.get(tensor.data_ptr())
            if idx is not None:
                self._layer_index[name] = idx

    def start_kv_transfers(self, metadata: Any) -> None:
        assert self.worker is not None
        for job_id, src_spec, dst_spec in _compat.take_unsubmitted_stores(self):
            self.worker.submit_store(job_id, src_spec, dst_spec)
        self._layer_jobs = []
        for job_id, entry in metadata.load_jobs.items():
            self._load_blocks[job_id] = [int(b) for b in entry.dst_spec.block_ids]
            if self.layerwise:
                self._layer_jobs.append(job_id)  # synchronous: no finished_recving for it
            else:
                _compat.load_jobs(self)[job_id] = entry.req_id
            self.worker.submit_load(job_id, entry.src_spec, entry.dst_spec, layerwise=self.layerwise)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._layer_jobs and self.worker is not None:
            layer = self._layer_index.get(layer_name)
            if layer is not None:
                self.worker.wait_layer(self._layer_jobs, layer)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        assert self.worker is not None
        finished_recving: set[str] = set()
        for result in self.worker.get_finished():
            job_id = result.job_id
            blocks = self._load_blocks.pop(job_id, None)
            if not result.success:
                self._failed_jobs.add(job_id)
                if blocks is not None:
                    self._load_errors.update(blocks)
            if result.transfer_time is not None and result.transfer_size is not None and result.success:
                meta = _compat.worker_meta(self).transfer_stats
                (meta.load if blocks is not None else meta.store).record(result.transfer_size, result.transfer_time)
            _compat.worker_meta(self).mark_completed(job_id)
            req_id = _compat.load_jobs(self).pop(job_id, None)
            if req_id is not None:
                finished_recving.add(req_id)
        return set(), finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> OffloadingWorkerMetadata | None:
        meta = super().build_connector_worker_meta()
        if not self._failed_jobs:
            return meta
        meta = meta or OffloadingWorkerMetadata()
        failed, self._failed_jobs = self._failed_jobs, set()
        return CxlWorkerMetadata(completed_jobs=meta.completed_jobs, transfer_stats=meta.transfer_stats,
                                 failed_jobs=failed)


class _Fresh:
    __slots__ = ("block_hash", "block_id", "is_null")

    def __init__(self, block: Any) -> None:
        self.block_id, self.is_null, self.block_hash = block.block_id, block.is_null, None


class _FreshFrom:
    """``KVCacheBlocks`` as the offloading scheduler reads it, blocks from the one holding token
    ``computed`` on shown without a hash (see ``CxlConnector.update_state_after_alloc``)."""

    def __init__(self, blocks: Any, computed: int, group_configs: Any) -> None:
        groups = list(blocks.blocks)
        for cfg in group_configs:
            first = -(-computed // cfg.tokens_per_block)
            group = list(groups[cfg.group_idx])
            group[first:] = [_Fresh(b) for b in group[first:]]
            groups[cfg.group_idx] = group
        self.blocks = tuple(groups)


class CxlConnector(OffloadingConnector):
    """``kv_connector: "CxlConnector"``, ``kv_connector_module_path: "driver.vllm"`` (see the
    module doc); ``kv_connector_extra_config`` as for ``CxlOffloadingSpec`` plus ``prefetch``."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        extra.setdefault("spec_name", "CxlOffloadingSpec")
        extra.setdefault("spec_module_path", "driver.vllm")
        if (extra["spec_name"], extra["spec_module_path"]) != ("CxlOffloadingSpec", "driver.vllm"):
            raise ConfigError("CxlConnector runs the cxlemu tier only: leave spec_name / spec_module_path out "
                              f"(got {extra['spec_name']!r} from {extra['spec_module_path']!r})")
        self.tier = parse_extra_config(extra)
        if self.tier.shared:  # both roles: the scheduler side's spec sees no vLLM config of its own
            cache = vllm_config.cache_config
            _compat.check_shared_hash(cache.prefix_caching_hash_algo, cache.enable_prefix_caching)
        self.layerwise = self.tier.prefetch == "layer"
        self._sync_loads: dict[int, Any] = {}  # layer-wise load job -> its request's context
        super().__init__(vllm_config, role, kv_cache_config)
        if self.connector_worker is not None:
            self.connector_worker = _CxlConnectorWorker(self.connector_worker.spec, vllm_config, kv_cache_config,
                                                        self.layerwise)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.connector_worker is not None:
            self.connector_worker.wait_for_layer_load(layer_name)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.connector_worker is None:
            return set()
        return self.connector_worker.get_block_ids_with_load_errors()

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        jobs = _compat.scheduler_jobs(self.scheduler)
        lost = [jobs[j].keys for j in getattr(meta, "failed_jobs", None) or () if j in jobs]
        sync_done = [j for j in getattr(meta, "completed_jobs", {}) if j in self._sync_loads]
        for job_id in sync_done:  # completed here, below: the request no longer lists them
            del meta.completed_jobs[job_id]
        super().update_connector_output(connector_output)  # completes the rest: pins come off
        for job_id in sync_done:
            context = self._sync_loads.pop(job_id)
            job = jobs.pop(job_id, None)
            if job is None:  # dropped by a reset of the cache meanwhile
                continue
            self.scheduler.manager.complete_load(job.keys, context)
            _compat.loading_done(self.scheduler, job.keys)
        for keys in lost:
            self.scheduler.manager.drop(keys)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if not (self.layerwise and num_external_tokens):
            super().update_state_after_alloc(request, blocks, num_external_tokens)
            return
        # A synchronous load's blocks come back from allocate_slots already hashed (cached at
        # once, where an asynchronous load's wait until it lands); the offloading scheduler
        # finds what to load by their missing hash. Show it the blocks past the locally
        # computed prefix as fresh: exactly those the load fills.
        status = _compat.request_state(self.scheduler, request.request_id)
        fresh = _FreshFrom(blocks, status.num_locally_computed_tokens, self.scheduler.config.kv_group_configs)
        super().update_state_after_alloc(request, fresh, num_external_tokens)
        # The load lands within this step's forward (each layer waits for its blocks), so it
        # must not hold the request's transfer slot: the store of what this forward computes is
        # prepared in this same step, and vLLM asserts no load is pending then (it expects loads
        # to finish between steps). Its completion is taken in update_connector_output.
        for job_id in list(status.transfer_jobs):
            if not _compat.scheduler_jobs(self.scheduler)[job_id].is_store:
                status.transfer_jobs.discard(job_id)
                self._sync_loads[job_id] = status.req_context

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        n, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if self.layerwise:
            return n, False  # scheduled now: the forward waits per layer
        return n, load_async
