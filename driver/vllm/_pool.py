"""The tier's side of the device's shared KV pool (``shared=True``): several engines, each on a
host port of its own, find each other's blocks there. Nothing here imports vLLM.

The tier's manager (scheduler side) and worker share one :class:`PoolLink` per process. A block
the engine's own tier lacks is looked up in the pool by vLLM's block hash and the engine's
:func:`fingerprint` (model, dtype, block size, layers, KV heads, head size, TP rank: engines of
different models never match) and pinned; the worker reads a hit from the pool straight into the
engine's KV block (one crossing of the link, as a tier hit's), verified, and unpins it. A block
the engine stores in its tier is published to the pool once the store completes (read back from
the tier). A block's payload is its pages in layer order, as the tier lays a chunk out (one page
per layer at ``offsets[layer] + chunk * page``), so every engine with the same fingerprint reads
and writes the same bytes.

The pool itself (the index in a shared Dynamic Capacity extent, its publish / seal / verify
protocol, pins and eviction) is ``driver.pool``.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from driver.vllm._stats import TierStats
from emulator.spec.errors import ConfigError, CxlemuError

__all__ = ["PoolLink", "fingerprint", "layer_offsets", "model_heads"]

logger = logging.getLogger(__name__)


def layer_offsets(base: int, num_chunks: int, pages: Sequence[int]) -> list[int]:
    """Where each layer's region of the tier starts: layer-major from ``base``, layer t's
    ``num_chunks`` pages of ``pages[t]`` bytes after layer t-1's (the worker's layout)."""
    out, off = [], base
    for page in pages:
        out.append(off)
        off += num_chunks * page
    return out


def model_heads(name: str, tp_size: int, vllm_config: Any = None) -> tuple[int, int]:
    """``(KV heads per TP rank, head size)`` of the model: from vLLM's config where the process
    has one (the worker side), else from the model's own ``config.json`` (the scheduler side
    gets no vLLM config from the offloading connector)."""
    if vllm_config is not None:
        mc = vllm_config.model_config
        return int(mc.get_num_kv_heads(vllm_config.parallel_config)), int(mc.get_head_size())
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(name)
    cfg = getattr(cfg, "text_config", None) or cfg
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return max(1, kv // max(1, tp_size)), head_dim


def fingerprint(offload_config: Any, vllm_config: Any = None) -> Any:
    """The pool's ``Fingerprint`` of an engine, from vLLM's ``OffloadingConfig``."""
    from driver.pool import Fingerprint

    groups = offload_config.groups
    if len({g.tokens_per_block for g in groups}) != 1:
        raise ConfigError("kv_connector_extra_config['shared']: the pool keys blocks of one size; this model's KV "
                          f"groups have {sorted({g.tokens_per_block for g in groups})} tokens per block")
    par = offload_config.parallel
    kv_heads, head_dim = model_heads(offload_config.model.name, par.tp_size, vllm_config)
    return Fingerprint(model=str(offload_config.model.name), dtype=str(offload_config.model.dtype),
                       block_tokens=int(groups[0].tokens_per_block),
                       layers=sum(len(g.layer_names) for g in groups), kv_heads=kv_heads, head_dim=head_dim,
                       tp_rank=int(par.rank))


class PoolLink:
    """The engine's handle on the device's KV pool, through its own host port (see the module
    doc): one per (device, port) in a process, shared by the tier's manager and worker
    (``acquire`` / ``release``): a port's pool is joined once per process."""

    _OPEN: dict[tuple[str, int], PoolLink] = {}
    _LOCK = threading.Lock()

    @classmethod
    def acquire(cls, device: str, host: int, fp: Any, offsets: Sequence[int], pages: Sequence[int],
                stats: TierStats) -> PoolLink:
        with cls._LOCK:
            link = cls._OPEN.get((device, host))
            if link is None:
                link = cls._OPEN[(device, host)] = cls(device, host, fp, offsets, pages, stats)
            elif (link.fp, link.offsets, link.pages) != (fp, list(offsets), list(pages)):
                raise ConfigError(f"the tier's scheduler side and worker on device {device!r} port {host} disagree on "
                                  f"the pool's key or layout: {link.fp} at {link.offsets} against {fp} at "
                                  f"{list(offsets)}")
            link.users += 1
            return link

    def __init__(self, device: str, host: int, fp: Any, offsets: Sequence[int], pages: Sequence[int],
                 stats: TierStats) -> None:
        from driver.memdev import MemDev
        from driver.pool import KvPool

        self.key, self.users = (device, host), 0
        self.fp, self.stats = fp, stats
        self.offsets, self.pages = list(offsets), list(pages)
        self.buf = np.empty(sum(self.pages), np.uint8)
        self._pins: dict[bytes, list[Any]] = {}
        self._md = MemDev.open(device, host=host)
        try:
            self.pool = KvPool.open(self._md)
            slot = int(self.pool.info()["slot_bytes"])
            if slot < self.buf.nbytes:
                raise ConfigError(f"kv_connector_extra_config['shared']: a KV block of this engine is "
                                  f"{self.buf.nbytes} bytes, more than a slot of device {device!r}'s pool ({slot}): "
                                  f"create the pool with slots of at least {self.buf.nbytes} bytes")
        except BaseException:
            if getattr(self, "pool", None) is not None:
                self.pool.close()
            self._md.close()
            raise
        self.failed = False  # once a pool operation raised, the pool is not used again

    def _failed(self, what: str, exc: BaseException) -> bool:
        """A pool operation raised (the device gone, the pool's extent released): the engine goes
        on with its own tier; said once."""
        self.stats.add(pool_errors=1)
        if not self.failed:
            self.failed = True
            logger.error("cxlemu tier: the shared pool failed on %s (%s); the engine goes on with its own tier",
                         what, exc)
        return False

    def pin(self, block_hash: bytes) -> bool:
        """Whether the pool holds the block; if so it is pinned (the firmware does not evict it)
        until ``unpin`` or ``load``."""
        if self.failed:
            return False
        try:
            block = self.pool.pin(self.fp, block_hash)
        except CxlemuError as exc:
            return self._failed("a lookup", exc)
        self.stats.add(pool_lookups=1, pool_hits=int(block is not None))
        if block is None:
            return False
        self._pins.setdefault(block_hash, []).append(block)
        return True

    def unpin(self, block_hash: bytes) -> None:
        pins = self._pins.get(block_hash)
        if pins:
            block = pins.pop()
            if not pins:
                del self._pins[block_hash]
            with contextlib.suppress(CxlemuError):  # a pool gone took its pins with it
                block.release()

    def load(self, block_hash: bytes) -> np.ndarray | None:
        """The pinned block read into ``buf`` (verified: its hash and checksum), its pin given
        back; None when it could not be read (vLLM recomputes it)."""
        if self.failed:
            self.unpin(block_hash)
            return None
        try:
            ok = self.pool.load(self.fp, block_hash, self.buf)
        except CxlemuError as exc:
            ok = self._failed("a load", exc)
        finally:
            self.unpin(block_hash)
        self.stats.add(**({"pool_loaded": 1} if ok else {"pool_load_misses": 1}))
        return self.buf if ok else None

    def publish(self, block_hash: bytes, chunk: int) -> bool:
        """Publish tier chunk ``chunk`` as the block ``block_hash``; False where the pool did not
        take it (already there, full, over this host's quota)."""
        if self.failed:
            return False
        try:
            pos = 0
            for off, page in zip(self.offsets, self.pages):
                self._md.read_into(off + chunk * page, self.buf[pos:pos + page])
                pos += page
            done = bool(self.pool.publish(self.fp, block_hash, self.buf))
        except CxlemuError as exc:
            return self._failed("a publish", exc)
        self.stats.add(pool_published=int(done))
        return done

    def release(self) -> None:
        """One user fewer; the last leaves the pool (its pins with it) and closes the port."""
        with self._LOCK:
            self.users -= 1
            if self.users > 0:
                return
            self._OPEN.pop(self.key, None)
        for block_hash in list(self._pins):
            while block_hash in self._pins:
                self.unpin(block_hash)
        self.pool.close()  # before its MemDev: it holds views of the MemDev's media
        self._md.close()
