"""``CxlOffloadingSpec``: vLLM's offloading spec with a cxlemu device as the tier.

Scheduler side (``get_manager``): vLLM's own chunk bookkeeping (``CPUOffloadingManager``:
reference counts, pins, the store/load protocol) over the device's block index, chunk ``c`` at
the DPAs the worker computes, with eviction decided by a firmware_model policy
(``_FirmwarePolicy``) and the number of chunks set by the device's capacity. Worker side
(``get_worker``): ``driver.vllm._worker.CxlOffloadingWorker``, the device's DMA engine.

The device: ``device`` names a served one (``cxlemu serve --name mem0``); absent, the worker
serves a private one in its own process, sized to ``cxl_bytes_to_use``.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Collection, Container, Hashable, Iterable, Sequence
from typing import Any

from typing_extensions import override

from driver.vllm import _compat
from driver.vllm._compat import (
    CachePolicy,
    CanonicalKVCaches,
    ChunkStatus,
    CPULoadStoreSpec,
    CPUOffloadingManager,
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
    init_logger,
    order_request_keys,
)
from driver.vllm._codec import PageCodec, piece_codec
from driver.vllm._config import TierConfig, chunk_of_dpa, hotlist_unit, parse_extra_config, tier_region
from driver.vllm._counters import ManagerCounters
from driver.vllm._stats import TierStats, register_manager, tier_stats, unregister_manager
from emulator.device_dir import device_path
from emulator.liveness import dead_firmware
from emulator.spec.errors import ConfigError, PortClaimed
from firmware_model.policies import HotnessPolicy, NoVictimError, resolve_policy

__all__ = ["CxlOffloadingManager", "CxlOffloadingSpec", "DeviceHotlist", "PoolLoadSpec", "private_device_name"]

logger = init_logger(__name__)

from emulator.spec.payloads_memdev import CAPACITY_UNIT  # noqa: E402
LIVENESS_S = 1.0  # the manager looks at a served device's firmware this often (a /proc read)


def private_device_name(engine_id: str) -> str:
    """The private device of engine ``engine_id`` in this process (device names: 32 characters)."""
    return f"vllm{os.getpid()}-{abs(hash(engine_id)) % 10**8}"


def private_capacity(cxl_bytes_to_use: int) -> int:
    return -(-cxl_bytes_to_use // CAPACITY_UNIT) * CAPACITY_UNIT


def device_ports(name: str, host: int = 0) -> tuple[int, int]:
    """``(capacity, host ports)`` of served device ``name`` (DeviceNotFound, naming it, when none
    is served; NoSuchHost past its ports). Read from its configuration, not by opening port
    ``host``: vLLM's scheduler runs in a process of its own by default, and the worker's process
    has claimed the port by the time the scheduler's spec is made."""
    from emulator.device_dir import check_host, load_config

    config = load_config(name)
    check_host(name, host, config.hosts)
    return int(config.capacity), int(config.hosts)


class PoolLoadSpec(CPULoadStoreSpec):
    """A load's source: tier chunks, and where ``pool_hashes[i]`` is not None (chunk -1), the
    device pool's block of that hash, which the worker reads into the engine's KV block itself."""

    def __init__(self, block_ids: list[int], pool_hashes: list[bytes | None]) -> None:
        super().__init__(block_ids)
        self.pool_hashes = pool_hashes


class _Pinned(Container[Hashable]):
    """What eviction must skip: the caller's protected keys and every pinned chunk."""

    __slots__ = ("evictable", "protected")

    def __init__(self, protected: Container[Hashable], evictable: set[Hashable]) -> None:
        self.protected, self.evictable = protected, evictable

    def __contains__(self, key: object) -> bool:
        return key in self.protected or key not in self.evictable


class _FirmwarePolicy(CachePolicy):
    """vLLM's ``CachePolicy`` seam backed by a firmware_model policy (``resolve_policy``): the
    same decisions the firmware model makes on traces, and libCacheSim checks, made for vLLM.

    vLLM pins chunks while they move (``mark_non_evictable``); the firmware policy keeps order
    over every resident chunk and is asked for victims with the pinned ones protected. Time is
    the count of accesses (the firmware model's simulated clock: no policy reads a clock)."""

    def __init__(self, cache_capacity: int, spec: str = "lru") -> None:
        super().__init__(cache_capacity)
        self.spec = spec
        self._factory = resolve_policy(spec)
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self._evictable: set[OffloadKey] = set()
        self.now = 0
        self.policy: Any = self._factory(max(cache_capacity, 1))

    @override
    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    @override
    def insert(self, key: OffloadKey, chunk: ChunkStatus) -> None:
        self.chunks[key] = chunk
        self.now += 1
        self.policy.insert(key, self.now)
        if chunk.ref_cnt == 0:
            self._evictable.add(key)

    @override
    def remove(self, key: OffloadKey) -> None:
        del self.chunks[key]
        self._evictable.discard(key)
        self.policy.remove(key)

    @override
    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        for key in keys:
            if key in self.chunks:
                self.now += 1
                self.policy.touch(key, self.now)

    @override
    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        on_miss = getattr(self.policy, "on_miss", None)  # ARC learns from its ghost lists here
        if on_miss is None:
            return
        for key in keys:
            self.now += 1
            on_miss(key, self.now)

    @override
    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]],
                            insertion_only_keys: set[OffloadKey], reused_keys: set[OffloadKey],
                            req_context: ReqContext) -> None:
        # tail first, so a request's head (the prefix other requests share) is the most recent,
        # as vLLM's own LRU orders it; blocks only inserted were counted by insert()
        keys = order_request_keys(key_groups, req_context)
        self.touch([k for k in reversed(keys) if k not in insertion_only_keys], req_context)

    @override
    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n == 0:
            return []
        if sum(1 for k in self._evictable if k not in protected) < n:
            return None  # atomic: nothing changes when n victims cannot be found
        skip = _Pinned(protected, self._evictable)
        out = []
        for _ in range(n):
            try:
                key = self.policy.evict(skip)
            except NoVictimError:  # the policy disagrees with the count above: undo, say so
                for k, chunk in out:
                    self.insert(k, chunk)  # evictable again: its ref_cnt is 0
                logger.error("eviction policy %s found no victim among %d evictable chunks", self.spec,
                             len(self._evictable))
                return None
            chunk = self.chunks.pop(key)
            self._evictable.discard(key)
            out.append((key, chunk))
        return out

    @override
    def clear(self) -> None:
        self.chunks.clear()
        self._evictable.clear()
        self.now = 0
        self.policy = self._factory(max(self.cache_capacity, 1))

    @override
    def mark_evictable(self, key: OffloadKey) -> None:
        self._evictable.add(key)

    @override
    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._evictable.discard(key)


class DeviceHotlist:
    """The served device's CHMU, programmed to count the tier's accesses, read as blocks: its
    hotlist's DPAs mapped to chunks by the worker's layer-major layout (equal pages of ``page``
    bytes per layer). Holds a handle on the device until ``close``.

    Its unit is the largest power of two dividing a page (256 B to 2 MiB, the unit sizes a CHMU
    offers): no unit straddles two chunks' pages, and a page touched is one hotlist entry per
    epoch, its count the 4 KiB granules touched, rather than one entry per 4 KiB. With 4 KiB
    units the 1023-entry hotlist overflowed within a few jobs (a 16-block job of a 32-layer
    model touches 512 pages)."""

    def __init__(self, device: str, page: int, num_chunks: int, host: int = 0) -> None:
        from driver.chmu import ChmuRegs
        from driver.memdev import MemDev

        self.page, self.num_chunks = page, num_chunks
        self.unit = hotlist_unit(page)
        self._md = MemDev.open(device, host=host)
        try:
            self.regs = ChmuRegs.of_bar(self._md.bar)
            self.regs.configure(unit_size=self.unit, threshold=1, mode="epoch", epoch_ns=10_000_000)
        except BaseException:
            self._md.close()
            raise

    def read(self) -> list[tuple[int, int]]:
        """(DPA, count) entries since the last read."""
        return self.regs.read_hotlist()

    def chunk_of(self, dpa: int) -> int:
        return chunk_of_dpa(dpa, self.page, self.num_chunks)

    def close(self) -> None:
        self._md.close()


class CxlOffloadingManager(CPUOffloadingManager):
    """vLLM's chunk bookkeeping over the device's chunks, the firmware policy deciding eviction,
    counting lookups, hits and evictions into the tier's ``TierStats``."""

    def __init__(self, num_chunks: int, tier: TierConfig, stats: TierStats, device_name: str, *,
                 enable_events: bool = False, hotlist: DeviceHotlist | None = None, pool: Any = None) -> None:
        super().__init__(num_chunks=num_chunks, cache_policy="lru", enable_events=enable_events)
        self.firmware_policy = _FirmwarePolicy(num_chunks, tier.policy)
        _compat.set_cache_policy(self, self.firmware_policy)  # vLLM's bookkeeping asks it
        self.tier = tier
        self.stats = stats
        self.device_name = device_name
        self._hotlist = hotlist  # "hotness" on a served device: its CHMU
        self._steps = 0
        # for a worker in another process, which publishes the telemetry page: written every
        # scheduler step (four words: a few us against a step's ms)
        self._remote = ManagerCounters(device_name, writer=True, host=tier.host)
        self._served_dir = device_path(device_name) if tier.device is not None else None
        self._check_at = 0.0
        self.pool = pool  # shared=True: a driver.vllm._pool.PoolLink
        self._pool_keys: dict[OffloadKey, list[bytes]] = {}  # pool hits of this step, a pin each

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self.stats.device_lost:  # found gone (check_device, or the worker in this process): no tier
            return LookupResult.MISS
        got = super().lookup(key, req_context)
        if got is LookupResult.MISS and self.pool is not None:
            block_hash = _compat.get_offload_block_hash(key)
            if self.pool.pin(block_hash):  # pinned until the worker loaded it, or this step ends
                self._pool_keys.setdefault(key, []).append(block_hash)
                got = LookupResult.HIT
        self.stats.add(lookups=1, hits=int(got is LookupResult.HIT))
        return got

    @override
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """A load of blocks from the tier and, shared=True, from the device's pool: the pool's
        go straight into the engine's KV blocks (``PoolLoadSpec``: chunk -1 and the block hash),
        one crossing of the link, as a tier hit."""
        pooled = {k for k in keys if k not in self.firmware_policy.chunks and self._pool_keys.get(k)}
        if not pooled:
            return super().prepare_load(keys, req_context)
        local = [k for k in keys if k not in pooled]
        spec = super().prepare_load(local, req_context) if local else None
        chunks = iter(spec.block_ids.tolist() if spec is not None else ())
        hashes = [self._pool_keys[k].pop() if k in pooled else None for k in keys]
        return PoolLoadSpec([-1 if h is not None else next(chunks) for h in hashes], hashes)

    @override
    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        super().complete_load([k for k in keys if k in self.firmware_policy.chunks], req_context)

    @override
    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        fresh = []
        if self.pool is not None and success:  # what this store makes ready, published once ready
            fresh = [k for k in keys if (c := self.firmware_policy.get(k)) is not None and not c.is_ready]
        super().complete_store(keys, req_context, success)
        for key in fresh:
            chunk = self.firmware_policy.get(key)
            if chunk is not None and chunk.is_ready:
                self.pool.publish(_compat.get_offload_block_hash(key), chunk.chunk_id)

    @override
    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        if self.stats.device_lost:  # store nothing, quietly: vLLM goes on without the tier. None
            # is an allocation failure to vLLM, one warning per request and step (1,600-2,200
            # lines over 20 rounds); the worker reported the loss once
            return PrepareStoreOutput(keys_to_store=[], store_spec=CPULoadStoreSpec([]), evicted_keys=[])
        out = super().prepare_store(keys, req_context)
        if out is not None and out.evicted_keys:
            self.stats.add(evictions=len(out.evicted_keys))
        return out

    @override
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._steps += 1
        if self._pool_keys:  # pool blocks found this step that no load took: their pins go
            for hashes in self._pool_keys.values():
                for block_hash in hashes:
                    self.pool.unpin(block_hash)
            self._pool_keys.clear()
        self.check_device()
        if self._hotlist is not None and self._steps % self.tier.hotlist_every == 0 and not self.stats.device_lost:
            self.feed_hotlist()
        self._publish()

    def check_device(self) -> None:
        """Whether a served device's firmware still runs, looked at once every LIVENESS_S. In a
        process of its own (vLLM's default) the manager learns of a loss only here: the worker
        that finds it is in another process. Whichever finds it first says so, once."""
        if self._served_dir is None or self.stats.device_lost:
            return
        now = time.monotonic()
        if now < self._check_at:
            return
        self._check_at = now + LIVENESS_S
        reason = dead_firmware(self._served_dir)
        if reason is not None and self.stats.mark_lost():
            logger.error("cxlemu tier: device %s is gone (%s); nothing more is looked up on it or stored to it: "
                         "serving goes on without the tier", self.device_name, reason)

    def _publish(self) -> None:
        st = self.stats  # three ints read: no copy of every counter each step
        self._remote.write({"lookups": st.lookups, "hits": st.hits, "evictions": st.evictions,
                            "chunks_in_use": self.chunks_in_use()})

    def feed_hotlist(self) -> int:
        """Add the CHMU's hotlist (device accesses, counted by the device) to the hotness
        policy's heat; returns the entries used."""
        policy = self.firmware_policy.policy
        if self._hotlist is None or not isinstance(policy, HotnessPolicy):
            return 0
        by_chunk = {c.chunk_id: k for k, c in self.firmware_policy.chunks.items()}
        used = 0
        for dpa, count in self._hotlist.read():
            key = by_chunk.get(self._hotlist.chunk_of(dpa))
            if key is not None:
                policy.hint_heat(key, count)
                used += 1
        if used:
            self.stats.add(hotlist_entries=used)
        return used

    def drop(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """Forget blocks whose copy on the device is lost (a load or store of theirs failed):
        their chunks go back to the pool; pinned ones (a transfer still using them) stay."""
        dropped = []
        for key in keys:
            chunk = self.firmware_policy.get(key)
            if chunk is None or chunk.ref_cnt != 0:
                continue
            self.firmware_policy.remove(key)
            _compat.free_chunk(self, chunk)
            dropped.append(key)
        if dropped:
            self.stats.add(dropped=len(dropped))
            if self.events is not None:
                self.events.append(OffloadingEvent(keys=dropped, medium=self.medium, removed=True))
        return dropped

    def chunks_in_use(self) -> int:
        return _compat.chunks_in_use(self)

    @override
    def shutdown(self) -> None:
        self._publish()
        self._remote.close()
        unregister_manager(self.device_name, self)
        if self.pool is not None:
            self.pool.release()
            self.pool = None
        if self._hotlist is not None:
            self._hotlist.close()
            self._hotlist = None
        super().shutdown()


class CxlOffloadingSpec(OffloadingSpec):
    """vLLM's offloading spec for a cxlemu device (see the module doc)."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """The manager is vLLM's CPU manager underneath and reports its gauges and histograms:
        vLLM's stat loggers need their definitions (they assert every reported key has one)."""
        return _compat.CPUOffloadingSpec.build_metric_definitions(extra_config)

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.tier = parse_extra_config(self.extra_config)
        if config.parallel.world_size != 1:
            raise ConfigError(f"the cxlemu tier serves one worker; this engine has {config.parallel.world_size} "
                              "(tensor/pipeline parallel): run with tensor_parallel_size=1")
        if self.blocks_per_chunk != 1:
            raise ConfigError(f"the cxlemu tier moves whole KV blocks: leave 'block_size' out of "
                              f"kv_connector_extra_config (it made {self.blocks_per_chunk} blocks per chunk)")
        self.chunk_bytes = int(config.worker_kv_bytes_per_block)
        self.layers = max(1, sum(len(g.layer_names) for g in config.groups))
        if self.tier.device is not None:
            self.device_name = self.tier.device
            capacity, hosts = device_ports(self.tier.device, self.tier.host)
            share = tier_region(capacity, hosts, self.tier.host)[1]
            if self.tier.cxl_bytes_to_use > share:
                raise ConfigError(f"cxl_bytes_to_use {self.tier.cxl_bytes_to_use} is more than device "
                                  f"{self.tier.device!r} holds for host port {self.tier.host} ({share} bytes of "
                                  f"{capacity}, {hosts} ports): lower it or serve a larger device")
        else:
            self.device_name = private_device_name(config.engine_id)
            capacity = private_capacity(self.tier.cxl_bytes_to_use)
        self.device_capacity = capacity
        #: the codec of a compressed kv_format (None: native); a chunk then takes its encoded size
        self.codec = None if self.tier.kv_format == "native" or not self.chunk_bytes else piece_codec(
            self.tier.kv_format, model=config.model.name, dtype=config.model.dtype,
            block_size=config.groups[0].tokens_per_block)
        stored = self.chunk_bytes if self.codec is None else PageCodec.block_bytes(self.codec, self.chunk_bytes)
        self.stored_chunk_bytes = stored  # a block of every layer on the device
        self.num_chunks = self.tier.cxl_bytes_to_use // stored if stored else 0
        if self.chunk_bytes and self.num_chunks < 1:
            raise ConfigError(f"cxl_bytes_to_use {self.tier.cxl_bytes_to_use} holds no KV block of "
                              f"{self.chunk_bytes} bytes: raise it")
        self.stats = tier_stats(self.device_name)
        self.fingerprint: Any = None
        if self.tier.shared:
            vllm_config = _compat.get_current_vllm_config_or_none()  # the worker side's; the
            if vllm_config is not None:  # scheduler side's is checked by CxlConnector, or was by the worker's
                cache = vllm_config.cache_config
                _compat.check_shared_hash(cache.prefix_caching_hash_algo, cache.enable_prefix_caching)
            from driver.vllm._pool import fingerprint

            self.fingerprint = fingerprint(config, vllm_config)
        self._manager: CxlOffloadingManager | None = None
        self._worker: OffloadingWorker | None = None
        self._lock = threading.Lock()

    @override
    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            hotlist = None
            if self.tier.policy == "hotness" and self.tier.device is not None and self.chunk_bytes:
                hotlist = DeviceHotlist(self.tier.device, self.stored_chunk_bytes // self.layers, self.num_chunks,
                                        self.tier.host)
            self._manager = CxlOffloadingManager(self.num_chunks, self.tier, self.stats, self.device_name,
                                                 enable_events=self.kv_events_config.enable_kv_cache_events,
                                                 hotlist=hotlist, pool=self.pool_link())
            register_manager(self.device_name, self._manager)
        return self._manager

    def pool_link(self) -> Any:
        """shared=True: this process's handle on the device's pool through the engine's port
        (``PoolLink.acquire``: the manager's and the worker's are one), the tier laid out as the
        worker lays it (a page per layer, every layer's page the same: vLLM's one KV group)."""
        if not self.tier.shared or not self.chunk_bytes:
            return None
        from driver.vllm._pool import PoolLink, layer_offsets

        capacity, hosts = device_ports(self.device_name, self.tier.host)
        base = tier_region(capacity, hosts, self.tier.host)[0]
        pages = [self.chunk_bytes // self.layers] * self.layers
        try:
            return PoolLink.acquire(self.device_name, self.tier.host, self.fingerprint,
                                    layer_offsets(base, self.num_chunks, pages), pages, self.stats)
        except PortClaimed as exc:  # the worker, in a process of its own (vLLM's default)
            raise ConfigError(f"kv_connector_extra_config['shared']: the tier's scheduler side and its worker share "
                              f"host port {self.tier.host} and must run in one process: set "
                              f"VLLM_ENABLE_V1_MULTIPROCESSING=0 ({exc})") from None

    @override
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        with self._lock:
            if self._worker is None:
                from driver.vllm._worker import CxlOffloadingWorker

                self._worker = CxlOffloadingWorker(self, kv_caches)
            return self._worker
