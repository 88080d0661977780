"""``CxlOffloadingWorker``: KV blocks between vLLM's KV tensors and the device, by its DMA engine.

The device's layout is layer-major: KV tensor ``t`` (one per attention layer) owns the region
``[off_t, off_t + num_chunks * page_t)`` and chunk ``c`` of it sits at ``off_t + c * page_t``, so
a run of consecutive chunks matching a run of consecutive KV blocks is one descriptor per layer
(vLLM's block pool hands out runs). A job (``submit_load`` / ``submit_store``) is one descriptor
list, ordered by layer, submitted at once to the DMA engine (loads and stores on separate
channels: the link is full duplex); ``get_finished`` reports the jobs whose handles completed,
a job with any failed descriptor (a poisoned line, a range error, a device gone) as failed.

Layer-wise loading (``submit_load(..., layerwise=True)``, used by ``CxlConnector``): the job's
descriptors are split per layer, one submission each, issued in layer order up to a window of
layers ahead of the layer the forward waits for (``wait_layer``), so the link streams layer l+1
while layer l computes and the forward never waits for what it does not need yet. The window is
the firmware model's prefetch window (``firmware_model.prefetch.window_points``, or the function
``window`` names): just enough layers of compute to hide one layer's transfer on this device's
link, from the link model and the compute per layer measured between the forward's waits; until
a forward has been measured, every layer is issued at once.

KV tensors the DMA engine cannot address (CUDA) are staged through a host bounce buffer
(``driver.vllm._staging``): the engine's descriptors then move the buffer's slots, and the copies
between the slots and the KV tensors run on a side stream (a layer-wise load's, on the forward's).

A compressed ``kv_format`` (``driver.vllm._codec``): each layer's page takes its encoded size on
the device; a job's descriptors move an encoded staging array, encoded at a store's submission
and decoded into the KV blocks when a load is waited for (layer by layer) or reported.
"""
from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from driver.vllm._compat import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
    init_logger,
)
from driver.vllm._codec import CodedJob, PageCodec
from driver.vllm._config import tier_region
from driver.vllm._counters import ManagerCounters
from driver.vllm._pool import layer_offsets
from driver.vllm._stats import TierStats, live_manager
from driver.vllm._staging import Pump, Staging
from emulator.dma import BlockRuns, DescriptorArray, DmaHandle, PinnedHosts
from emulator.spec.errors import ConfigError, CxlemuError, DeviceGone

__all__ = ["CxlOffloadingWorker", "live_worker"]

logger = init_logger(__name__)

LOAD_CHANNEL, STORE_CHANNEL = 0, 1

_LIVE: dict[str, CxlOffloadingWorker] = {}


def live_worker(device: str) -> CxlOffloadingWorker | None:
    """The tier's worker on ``device`` in this process, while its engine runs (tests and tools
    reach the device layout through it)."""
    return _LIVE.get(device)


def _host_bytes(tensor: torch.Tensor) -> tuple[np.ndarray, int]:
    """A flat writable uint8 view of a ``(num_blocks, page)`` int8 host tensor (a KV view or the
    bounce buffer) and its block stride."""
    if tensor.device.type != "cpu":
        raise ConfigError(f"the DMA engine addresses host memory; this KV tensor is on {tensor.device}: leave "
                          "kv_connector_extra_config['staging'] absent (or true) to stage it through host memory")
    num_blocks, page = tensor.shape
    stride = tensor.stride(0)
    span = (num_blocks - 1) * stride + page
    flat = torch.empty(0, dtype=torch.int8).set_(tensor.untyped_storage(), tensor.storage_offset(), (span,), (1,))
    return flat.numpy().view(np.uint8), stride


class _Job:
    """One transfer job: its handles, and for a layer-wise load the layers still to issue."""

    __slots__ = ("blocks", "coded", "error", "handles", "is_load", "job_id", "layer_handles", "nbytes",
                 "pending_layers", "pieces", "start")

    def __init__(self, job_id: int, is_load: bool, blocks: int, nbytes: int, start: float) -> None:
        self.job_id, self.is_load, self.blocks, self.nbytes, self.start = job_id, is_load, blocks, nbytes, start
        self.handles: list[DmaHandle] = []
        self.pending_layers: deque = deque()  # layer-wise: (layer, descriptors) to issue
        self.layer_handles: dict[int, DmaHandle] = {}
        self.error: str | None = None
        self.pieces: list[Any] | None = None  # a staged job's pieces (driver.vllm._staging)
        self.coded: CodedJob | None = None  # a compressed kv_format's staging (driver.vllm._codec)


def _link_done(job: _Job, now: float, link_now_ns: int) -> float | None:
    """When the job's last descriptor completed on the link, in ``perf_counter`` seconds
    (``now`` there is ``link_now_ns`` on the link's clock); None where no descriptor reported a
    completion time (an untimed link reports 0; a failed descriptor, its error)."""
    last = max((r for h in job.handles for r in h.wait() if isinstance(r, int) and r > 0), default=None)
    return None if last is None else now - (link_now_ns - last) / 1e9


class CxlOffloadingWorker(OffloadingWorker):
    """The tier's worker: one per engine worker process (see the module doc)."""

    def __init__(self, spec: Any, kv_caches: CanonicalKVCaches) -> None:
        from driver.kv import DeviceBlockStore, claim_kv
        from driver.memdev import MemDev

        self.spec = spec
        self.stats: TierStats = spec.stats
        self.num_chunks = spec.num_chunks
        self._stack = contextlib.ExitStack()
        try:
            if spec.tier.device is None:
                from emulator.device import DeviceConfig, serve

                self._stack.enter_context(serve(DeviceConfig(name=spec.device_name, capacity=spec.device_capacity)))
            md = self._stack.enter_context(MemDev.open(spec.device_name, host=spec.tier.host))
            claim_kv(md, self._stack)  # one process's KV per host port: a second one is refused
            self.memdev = md
            # each host port's tier in a part of its own of the static capacity
            base, size = tier_region(md.config.capacity, md.config.hosts, spec.tier.host)
            self._layout(kv_caches, base, size)
            self.store = DeviceBlockStore(md, base=base, size=self.region_bytes,
                                          channels=max(2, spec.tier.channels))
            self._stack.callback(self.store.close)
            self.pool = None  # shared=True: the device's pool, which loads read from directly
            if spec.tier.shared:
                if self.staging is not None:
                    raise ConfigError("kv_connector_extra_config['shared']: pool blocks are read into the KV "
                                      "tensors on the host; staged KV (CUDA, or staging=True) is not shared yet")
                self.pool = spec.pool_link()
                self._stack.callback(self.pool.release)
        except BaseException:
            self._stack.close()
            raise
        self.dma = self.store.dma
        from firmware_model.prefetch import resolve_window

        self._window_fn = resolve_window(spec.tier.window)
        self._link = md.config.timing.link_params()
        self._layer_ns = 0.0  # compute per layer, measured between the forward's waits (EMA)
        self._last_wait: tuple[int, int] | None = None  # (layer, ns) of the last wait_layer
        self._open_jobs: dict[int, _Job] = {}  # in submission order
        self._lost = False
        #: when a list: one entry per finished job (``get_finished``), for benchmarks that set
        #: it: [submitted, "load" | "store", blocks, link done, reported, ok], times in
        #: ``time.perf_counter()`` seconds; link done is the last descriptor's completion on a
        #: timed link, else None
        self.job_log: list[list[Any]] | None = None
        self._telemetry = _Publisher(md, self)
        self._stack.callback(self._telemetry.close)
        _LIVE[spec.device_name] = self
        self._stack.callback(_LIVE.pop, spec.device_name, None)
        logger.info("cxlemu tier: device %s, %d chunks of %d bytes (%d layers), policy %s, prefetch %s",
                    spec.device_name, self.num_chunks, self.chunk_bytes, len(self.pages), spec.tier.policy,
                    spec.tier.prefetch)

    # -- layout -------------------------------------------------------------------------------
    def _layout(self, kv_caches: CanonicalKVCaches, base: int, size: int) -> None:
        self.tensors = [t.tensor for t in kv_caches.tensors]
        self.pages: list[int] = [int(t.page_size_bytes) for t in kv_caches.tensors]
        self.chunk_bytes = sum(self.pages)
        staged = self.spec.tier.staging
        if staged is None:
            staged = any(t.device.type != "cpu" for t in self.tensors)
        self.staging: Staging | None = None
        if staged:  # the DMA engine moves the bounce buffer's slots; the KV moves to and from them
            slots = max(1, min(self.spec.tier.staging_bytes // self.chunk_bytes, len(self.tensors[0])))
            self.staging = Staging(self.tensors, self.pages, slots)
            buffers = self.staging.bounce
        else:
            buffers = self.tensors
        self.hosts: list[np.ndarray] = []
        self.strides: list[int] = []
        # a compressed kv_format: each layer's page takes its encoded size on the device
        self.codec = None if self.spec.codec is None else PageCodec(self.spec.codec, self.pages)
        device_pages = self.pages if self.codec is None else self.codec.device_pages
        for t in buffers:
            host, stride = _host_bytes(t)
            self.hosts.append(host)
            self.strides.append(stride)
        self.offsets: list[int] = layer_offsets(base, self.num_chunks, device_pages)
        off = base + self.num_chunks * sum(device_pages)
        self.device_pages = device_pages
        if self.spec.tier.shared and len(set(self.pages)) > 1:  # the manager copies pool blocks so
            raise ConfigError(f"kv_connector_extra_config['shared']: the tier's layers must have one page size "
                              f"to share blocks; this model's are {sorted(set(self.pages))} bytes")
        self._pinned = PinnedHosts(self.hosts, writable=True)  # pinned once, as a driver registers buffers
        self._planner = BlockRuns(self._pinned, self.num_chunks, self.strides, self.offsets, self.pages)
        self._pump = None if self.staging is None else Pump(
            self.staging, self._plan, self._submit_array, lambda job: self._issue_layers(job, len(self.hosts)),
            self._device_lost, DeviceGone)
        self.region_base, self.region_bytes = base, off - base
        if off - base > size:
            raise ConfigError(f"{self.num_chunks} chunks of {self.chunk_bytes} bytes need {off - base} bytes; device "
                              f"{self.spec.device_name!r} has {size} for host port {self.spec.tier.host}: lower "
                              "cxl_bytes_to_use")

    def chunk_dpa(self, chunk: int, layer: int = 0) -> int:
        """Where layer ``layer`` of chunk ``chunk`` lies on the device (tests poison it)."""
        return self.offsets[layer] + chunk * self.device_pages[layer]

    def blocks(self, layer: int) -> np.ndarray:
        """Layer ``layer``'s KV tensor as a writable (num_blocks, page) uint8 view (what a
        compressed job gathers from and decodes into)."""
        return np.lib.stride_tricks.as_strided(self.hosts[layer], (len(self.tensors[layer]), self.pages[layer]),
                                               (self.strides[layer], 1), writeable=True)

    # -- jobs ---------------------------------------------------------------------------------
    def _descriptors(self, direction: str, kv: np.ndarray, chunks: np.ndarray,
                     layerwise: bool) -> list[tuple[int, DescriptorArray]]:
        """The job as one DescriptorArray (layer by layer: one descriptor per run of consecutive
        blocks and layer, where a layer's blocks are not padded; one per block and layer where
        they are), planned in one C call; or one array per layer for a layer-wise load."""
        arr = self._plan(direction, kv, chunks)
        if not layerwise:
            return [(-1, arr)]
        return list(enumerate(arr.split(len(self.hosts))))

    def _plan(self, direction: str, blocks: np.ndarray, chunks: np.ndarray) -> DescriptorArray:
        """One job's (or staged piece's) descriptors, noted to the CHMU."""
        arr = self._planner.plan(direction, blocks, chunks)
        feed = self.memdev.access_feed  # the CHMU counts what the tier touches
        if feed.enabled:
            rec = arr.records
            for dpa, nbytes in zip(rec["dpa"].tolist(), rec["len"].tolist()):
                feed.note(dpa, nbytes, direction == "write")
        return arr

    def _submit_array(self, arr: DescriptorArray, is_load: bool) -> DmaHandle:
        return self.dma.submit(arr, channel=LOAD_CHANNEL if is_load else STORE_CHANNEL)

    def _submit(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec, is_load: bool,
                layerwise: bool = False) -> bool:
        t0 = time.perf_counter_ns()
        kv_spec, dev_spec = (dst, src) if is_load else (src, dst)
        if not isinstance(kv_spec, GPULoadStoreSpec) or not isinstance(dev_spec, BlockIDsLoadStoreSpec):
            raise TypeError(f"job {job_id}: expected a GPULoadStoreSpec and the tier's chunk spec, got "
                            f"{type(src).__name__} -> {type(dst).__name__}")
        kv, chunks = kv_spec.block_ids, dev_spec.block_ids
        if len(kv) != len(chunks):
            raise ValueError(f"job {job_id}: {len(kv)} KV blocks for {len(chunks)} device chunks")
        job = _Job(job_id, is_load, len(kv), len(kv) * self.chunk_bytes, time.perf_counter())
        self._open_jobs[job_id] = job
        pool_hashes = getattr(dev_spec, "pool_hashes", None)
        if is_load and pool_hashes is not None:  # the pool's blocks first, the tier's by DMA below
            kv, chunks, unread = self._load_from_pool(kv, chunks, pool_hashes)
            if unread:
                job.error = f"{unread} block(s) of the shared pool could not be read (evicted, or torn)"
        if job.error is None and self._lost:
            job.error = "device gone"
        if job.error is not None:
            pass  # failed already: nothing more moves for it
        elif self._pump is not None:
            self._pump.add(job, np.asarray(kv, np.int64), np.asarray(chunks, np.int64), layerwise)
            if job.pending_layers:
                self._issue_layers(job, self._window(job))
            self._pump.pump()
        elif self.codec is not None and len(kv):
            self._submit_coded(job, np.asarray(kv, np.int64), np.asarray(chunks, np.int64), layerwise)
        elif len(kv):
            arrays = self._descriptors("read" if is_load else "write", kv, chunks, layerwise)
            try:
                if layerwise:
                    job.pending_layers.extend(arrays)
                    self._issue_layers(job, self._window(job))
                else:
                    job.handles.append(self._submit_array(arrays[0][1], is_load))
            except DeviceGone as exc:
                self._device_lost(exc)
                job.error = str(exc)
        self.stats.add(host_ns=time.perf_counter_ns() - t0, host_blocks=len(kv),
                       **({"load_jobs": 1} if is_load else {"store_jobs": 1}))
        return True

    def _submit_coded(self, job: _Job, kv: np.ndarray, chunks: np.ndarray, layerwise: bool) -> None:
        """A job of a compressed kv_format: a store's pages encoded now, its staging DMA'd; a
        load's staging DMA'd, decoded into the KV when waited for or reported (``CodedJob``)."""
        assert self.codec is not None
        coded = CodedJob(self.codec, self.blocks, self.offsets, kv, chunks, job.is_load)
        job.coded = coded
        feed = self.memdev.access_feed  # the CHMU counts what the tier touches
        if feed.enabled:
            for _, descs in coded.descriptors:
                for d in descs:
                    feed.note(d.dpa, d.length, not job.is_load)
        try:
            if layerwise:
                job.pending_layers.extend(coded.descriptors)
                self._issue_layers(job, self._window(job))
            else:
                descs = [d for _, layer_descs in coded.descriptors for d in layer_descs]
                job.handles.append(self.dma.submit(descs, channel=LOAD_CHANNEL if job.is_load else STORE_CHANNEL))
        except DeviceGone as exc:
            self._device_lost(exc)
            job.error = str(exc)

    def _load_from_pool(self, kv: np.ndarray, chunks: np.ndarray,
                        pool_hashes: Sequence[bytes | None]) -> tuple[np.ndarray, np.ndarray, int]:
        """Read the job's pool blocks (chunk -1) into their KV blocks: each the pool's verified
        copy, its pages scattered to the layers' tensors (host memory). Returns the job's tier
        blocks and chunks, and how many pool blocks could not be read."""
        keep, unread = [], 0
        for i, block_hash in enumerate(pool_hashes):
            if block_hash is None:
                keep.append(i)
                continue
            buf = self.pool.load(block_hash)
            if buf is None:
                unread += 1
                continue
            block, pos = int(kv[i]), 0
            for host, stride, page in zip(self.hosts, self.strides, self.pages):
                host[block * stride:block * stride + page] = buf[pos:pos + page]
                pos += page
        return np.asarray(kv)[keep], np.asarray(chunks)[keep], unread

    def _window(self, job: _Job) -> int:
        """Layers to issue ahead of the one the forward needs (see the module doc)."""
        layers = len(self.hosts)
        if self._layer_ns <= 0:
            return layers
        return self._window_fn(self._link, job.nbytes // layers, self._layer_ns, layers)

    def _issue_layers(self, job: _Job, upto: int) -> None:
        """Issue the job's layers below ``upto`` not issued yet (layer l on channel l mod n)."""
        while job.pending_layers and job.pending_layers[0][0] < upto:
            layer, descs = job.pending_layers.popleft()
            if len(descs):
                h = self.dma.submit(descs, channel=layer % self.dma.channels)
                job.layer_handles[layer] = h
                job.handles.append(h)

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, src_spec, dst_spec, is_load=False)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    layerwise: bool = False) -> bool:
        return self._submit(job_id, src_spec, dst_spec, is_load=True, layerwise=layerwise)

    def wait_layer(self, job_ids: Sequence[int], layer: int) -> None:
        """Layer-wise loads: wait until ``layer`` of each job has arrived, issuing the layers
        up to ``layer + window`` first (the prefetch bound to the forward's progress)."""
        now = time.perf_counter_ns()
        if self._last_wait is not None and self._last_wait[0] == layer - 1:  # one layer's compute
            dt = now - self._last_wait[1]
            self._layer_ns = dt if self._layer_ns <= 0 else 0.8 * self._layer_ns + 0.2 * dt
        self._wait(job_ids, layer)
        self._last_wait = (layer, time.perf_counter_ns())
        self.stats.add(layer_waits=1)

    def wait(self, job_ids: set[int]) -> None:
        self._wait(job_ids, None)

    def _wait(self, job_ids: Iterable[int], layer: int | None) -> None:
        """Wait for layer ``layer`` of each job (every layer: None), counting the stall."""
        t0 = time.perf_counter_ns()
        for job_id in job_ids:
            job = self._open_jobs.get(job_id)
            if job is None or job.error:
                continue
            try:
                if job.pieces is not None and (layer is None or not job.layer_handles and not job.pending_layers):
                    self._pump.pump(until=job)  # type: ignore[union-attr]  # staged: all of it
                    continue
                if layer is None:
                    self._issue_layers(job, len(self.hosts))
                    handles = job.handles
                else:
                    self._issue_layers(job, layer + 1 + self._window(job))
                    handles = [job.layer_handles[layer]] if layer in job.layer_handles else []
                for h in handles:
                    h.wait()
                if job.coded is not None and not any(h.errors for h in handles):
                    job.coded.land(layer)  # the forward reads these pages next
                if job.pieces is not None and layer is not None:
                    self._pump.layer_arrived(job, layer)  # type: ignore[union-attr]
            except DeviceGone as exc:
                self._device_lost(exc)
                job.error = str(exc)
        self.stats.add(stall_ns=time.perf_counter_ns() - t0)

    def _device_lost(self, exc: BaseException) -> None:
        if not self._lost:
            self._lost = True
            if not self.stats.mark_lost():  # the manager, in this process, found it first and said so
                return
            logger.error("cxlemu tier: device %s is gone (%s); every later load fails and is recomputed by "
                         "vLLM, stores are dropped: serving goes on without the tier", self.spec.device_name, exc)

    def _result(self, job: _Job) -> TransferResult:
        failed = job.error
        if failed is None:
            for h in job.handles:
                try:
                    h.wait()
                    if h.errors:  # the first descriptor that failed
                        failed = str(h.errors[0])
                        if isinstance(h.errors[0].__cause__, DeviceGone):
                            self._device_lost(h.errors[0].__cause__)
                except DeviceGone as exc:
                    self._device_lost(exc)
                    failed = str(exc)
                except CxlemuError as exc:
                    failed = str(exc)
                if failed:
                    break
        now = time.perf_counter()
        elapsed = now - job.start
        if self.job_log is not None:
            self.job_log.append([job.start, "load" if job.is_load else "store", job.blocks,
                                 _link_done(job, now, self.dma.now_ns()), now, failed is None])
        if failed:
            job.error = failed
            if job.is_load:
                self.stats.add(failed_loads=1, failed_blocks=job.blocks)
            else:
                self.stats.add(failed_stores=1)
            if not self._lost:  # a lost device was reported once, as an error
                logger.warning("cxlemu tier: %s job %d of %d blocks failed: %s",
                               "load" if job.is_load else "store", job.job_id, job.blocks, failed)
        else:
            link = job.nbytes if job.coded is None else job.coded.link_bytes
            if job.is_load:
                if job.coded is not None:
                    job.coded.land()  # what no wait decoded yet, before vLLM may read it
                self.stats.add(blocks_loaded=job.blocks, bytes_loaded=job.nbytes, link_bytes_loaded=link)
            else:
                self.stats.add(blocks_stored=job.blocks, bytes_stored=job.nbytes, link_bytes_stored=link)
        return TransferResult(job.job_id, failed is None, job.nbytes, elapsed)

    def _finished(self, job: _Job) -> bool:
        if job.pieces is not None:  # staged: once every piece gave its slots back
            return Pump.done(job)
        return job.error is not None or (not job.pending_layers and all(h.done() for h in job.handles))

    def get_finished(self) -> list[TransferResult]:
        t0 = time.perf_counter_ns()
        if self._pump is not None:
            self._pump.pump()
        out = []
        for job_id, job in list(self._open_jobs.items()):
            if self._finished(job):
                out.append(self._result(job))
                del self._open_jobs[job_id]
        self._telemetry.publish()
        self.stats.add(host_ns=time.perf_counter_ns() - t0)
        return out

    def pending_jobs(self) -> int:
        return len(self._open_jobs)

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self.wait(set(self._open_jobs))
        self._stack.close()


class _Publisher:
    """The tier's counters in the device's telemetry page (host section), so ``cxlemu monitor``
    and the exporter show a vLLM run live: hits/lookups, blocks each way, evictions, stalls,
    the DMA queue and the jobs in flight. Throttled to one publish per PERIOD_S."""

    PERIOD_S = 0.1

    def __init__(self, md: Any, worker: CxlOffloadingWorker) -> None:
        from driver.kv import host_writer

        self.worker = worker
        self._last = 0.0
        self._writer: Any = host_writer(md, "tier")
        self._manager = ManagerCounters(worker.spec.device_name, writer=False,  # a scheduler elsewhere
                                        host=worker.spec.tier.host)

    def publish(self, force: bool = False) -> None:
        now = time.monotonic()
        if self._writer is None or (not force and now - self._last < self.PERIOD_S):
            return
        self._last = now
        w = self.worker
        s = w.stats.as_dict()
        manager = live_manager(w.spec.device_name)  # in-process: the scheduler's, counting into s
        if manager is not None:
            used = manager.chunks_in_use()
        else:  # vLLM's multiprocessing: the scheduler's counters come from its page
            remote = self._manager.read() or dict.fromkeys(ManagerCounters.FIELDS, 0)
            s.update(lookups=remote["lookups"], hits=remote["hits"], evictions=remote["evictions"])
            used = remote["chunks_in_use"]
        self._writer.publish(hits=s["hits"], misses=s["lookups"] - s["hits"], loads=s["blocks_loaded"],
                             offloads=s["blocks_stored"], evictions=s["evictions"], stall_ns=s["stall_ns"],
                             blocks_resident=used, blocks_total=w.num_chunks, chunk_bytes=w.chunk_bytes,
                             device_chunks_used=used, dma_sq_depth=min(w.dma.pending(), 2**32 - 1),
                             prefetch_queue_depth=min(w.pending_jobs(), 2**32 - 1))

    def close(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self.publish(force=True)
            self._writer.close()
            self._writer = None
        self._manager.close()
