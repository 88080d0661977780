"""`KvPool`: a host's handle on the device's shared KV pool (docs/pool-design.md section 3).

    md = MemDev.open("pool0", host=1)
    pool = KvPool.open(md)                     # accepts the kv-index extent offered to this host
    fp = Fingerprint("llama", "bfloat16", 16, 32, 8, 128, tp_rank=0)
    pool.publish(fp, block_hash, payload)      # False: present already, or no room within quota
    pool.lookup(fp, block_hash)                # a sealed entry exists
    pool.load(fp, block_hash, out)             # False on a miss, or a torn read (counted)
    pool.stats(); pool.close(); md.close()

The index is ``firmware_model.kv_index`` over this host's mapping of the extent; its racing words
change by the C core's CAS (``emulator.timing.linkstate.WordCas``); payloads move by the timed
data path, so a released extent fails them (``PoolRevoked``). Publish: ALLOC by CAS -> payload
written -> key, dpa, length, crc32 -> SEALED by CAS (an error on the way leaves a TOMB, never an
ALLOC). Load: lookup -> pin by CAS (and the state word checked again) -> read -> key, fields and
checksum verified -> unpin. The firmware alone evicts, and drops a dead host's pins.

Opening joins the pool as this host with a new host generation (IDLE -> JOINING, which the
firmware turns LIVE once nothing of an earlier holder of the port is left); ``close`` leaves.
Close the pool before its MemDev (it holds views of the MemDev's media mapping).
"""
from __future__ import annotations

import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from emulator import liveness
from emulator.spec.errors import CxlemuError, NoExtent
from emulator.timing.linkstate import WordCas
from firmware_model import kv_index as K
from firmware_model.kv_index import Fingerprint

if TYPE_CHECKING:
    from driver.memdev import MemDev

__all__ = ["Fingerprint", "KvPool", "NoPool", "PinnedBlock", "PoolError", "PoolRevoked"]

JOIN_TIMEOUT_S = 5.0  # the firmware admits a joining host within one 20 ms pass; a loaded machine is slower
_TAG = K.INDEX_TAG.ljust(16, b"\0")
# the pools open in this process, by (device directory, host): a LIVE record naming this process
# with no open pool behind it is an earlier handle's (e.g. from before a firmware restart)
_OPEN: weakref.WeakValueDictionary[tuple[str, int], "KvPool"] = weakref.WeakValueDictionary()
_OPEN_LOCK = threading.Lock()


class PoolError(CxlemuError):
    """The shared KV pool cannot be used as asked; the message says why and what to do."""


class NoPool(PoolError):
    """The device offers this host no KV pool (no extent tagged kv-index, or none formatted)."""


class PoolRevoked(PoolError):
    """This host no longer belongs to the pool: its extent was released, or the firmware dropped
    it (it found the host's process gone). Open the pool again once the extent is offered again."""


class PinnedBlock:
    """A sealed block pinned by this host: the firmware does not evict it until ``release``."""

    def __init__(self, pool: "KvPool", slot: int, word: int, key: bytes) -> None:
        self.pool, self.slot, self.word, self.key = pool, slot, word, key
        idx = pool.index
        self.dpa, self.length, self.crc = idx.block_dpa(slot), idx.word(slot, K.E_LENGTH), idx.word(slot, K.E_CRC)

    def release(self) -> None:
        if self.pool._held.pop(id(self), None) is not None:
            self.pool.index.unpin(self.slot, self.pool.host)


def _key(fp: Fingerprint | bytes, block_hash: bytes) -> bytes:
    digest = fp.digest if isinstance(fp, Fingerprint) else bytes(fp)
    if len(digest) != K.FP_BYTES:
        raise ValueError(f"a fingerprint is {K.FP_BYTES} bytes (Fingerprint(...).digest), got {len(digest)}")
    if not isinstance(block_hash, (bytes, bytearray, memoryview)) or len(block_hash) != K.HASH_BYTES:
        raise ValueError(f"a block hash is {K.HASH_BYTES} bytes (sha256 of the block; Python's hash() "
                         f"differs per process and cannot be shared), got {block_hash!r:.40}")
    return digest + bytes(block_hash)


def _u8(buf: Any, writable: bool = False) -> np.ndarray:
    """A bytes-like, numpy array or tensor (``.numpy()``) as a flat uint8 array, without a copy."""
    if hasattr(buf, "numpy") and not isinstance(buf, np.ndarray):
        buf = buf.numpy()
    mv = memoryview(buf)
    if writable and mv.readonly:
        raise ValueError("out must be writable (a bytearray, numpy array or CPU tensor)")
    if not mv.c_contiguous:
        raise ValueError("payload and out must be contiguous")
    return np.frombuffer(mv.cast("B"), dtype=np.uint8)


class KvPool:
    """The shared KV index as host ``md.host`` uses it."""

    def __init__(self, md: MemDev, dpa: int) -> None:
        self.md, self.host, self.dpa = md, md.host, dpa
        head = np.frombuffer(md.media[dpa:dpa + K.HEADER_BYTES], dtype=np.uint64)
        if int(head[K.H_MAGIC]) != K.MAGIC:
            raise NoPool(f"{md.name}: the kv-index extent at DPA {dpa:#x} holds no index: create the pool "
                         f"with `cxlemu pool create {md.name} --size SIZE`")
        view = md.media[dpa:dpa + int(head[K.H_TOTAL])]
        self._cas = WordCas(view)
        self.index = K.KvIndex(view, self._cas)
        if self.host >= self.index.hosts:
            self._cas.release()
            raise PoolError(f"{md.name}: the pool serves hosts 0..{self.index.hosts - 1}, not {self.host}")
        self.gen = 0
        self._held: dict[int, PinnedBlock] = {}
        self._stats = dict.fromkeys(("hits", "misses", "published", "present", "no_room", "torn", "evicted_seen"), 0)

    # opening ------------------------------------------------------------------------------------------
    @classmethod
    def open(cls, md: MemDev, *, join_timeout_s: float = JOIN_TIMEOUT_S) -> "KvPool":
        """The pool in the extent tagged kv-index that ``md``'s host accepted (a pending offer of
        one is accepted here); ``NoPool`` when there is none."""
        pool = cls(md, cls._find_extent(md))
        slot = (str(md.files.path), md.host)
        with _OPEN_LOCK:
            other = _OPEN.get(slot)
            if other is not None and other._cas is not None and other.md._gone_reason(False) is None:
                pool._cas.release()
                raise PoolError(f"{md.name}: this process has the pool open on host {md.host} already")
            try:
                pool._join(join_timeout_s)
            except BaseException:
                pool._cas.release()
                raise
            _OPEN[slot] = pool
        return pool

    @staticmethod
    def _find_extent(md: MemDev) -> int:
        for e in md.get_dc_extents().extents:
            if e.tag == _TAG:
                return e.start_dpa
        offered = [e for e in md.fm_list() if e.host == md.host and e.pending and e.tag == _TAG]
        if offered:
            md.accept([(e.start_dpa, e.length) for e in offered])
            return offered[0].start_dpa
        raise NoPool(f"{md.name}: no KV pool is offered to host {md.host}: create one with "
                     f"`cxlemu pool create {md.name} --size SIZE` (the device needs --dc-region)")

    def _join(self, timeout_s: float) -> None:
        """IDLE(g) -> JOINING(g+1) with this process's pid, then wait for the firmware's LIVE."""
        idx, h = self.index, self.host
        deadline = time.monotonic() + timeout_s
        while True:
            word = idx.host_field(h, K.HS_STATE)
            phase, gen = word >> 32, word & 0xFFFF_FFFF
            pid, started = idx.host_field(h, K.HS_PID), idx.host_field(h, K.HS_START)
            if phase == K.LIVE and pid == os.getpid():
                idx.cas_host_state(h, word, K.host_word(gen, K.IDLE))  # an earlier handle's: left
                continue
            if phase == K.LIVE and liveness.process_alive(pid, started if started < 1 << 62 else -1):
                raise PoolError(f"{self.md.name}: pid {pid} uses the pool as host {h}: each process needs a "
                                "host port of its own (`cxlemu serve --hosts N`, MemDev.open(name, host=h))")
            if phase == K.IDLE:
                idx.set_host_field(h, K.HS_PID, os.getpid())
                idx.set_host_field(h, K.HS_START, liveness.start_time(os.getpid()) % (1 << 64))
                self.gen = liveness.next_generation(gen)
                if idx.cas_host_state(h, word, K.host_word(self.gen, K.JOINING)):
                    break
            self._wait(deadline, f"host {h}'s earlier holder to be dropped by the firmware")
        while idx.host_field(h, K.HS_STATE) != K.host_word(self.gen, K.LIVE):
            if idx.host_field(h, K.HS_STATE) >> 32 == K.IDLE:
                raise PoolRevoked(f"{self.md.name}: the firmware refused host {h} (it holds no kv-index extent)")
            self._wait(deadline, "the firmware to admit this host")

    def _wait(self, deadline: float, what: str) -> None:
        if time.monotonic() > deadline:
            raise PoolError(f"{self.md.name}: timed out waiting for {what}; is the firmware serving?")
        time.sleep(0.002)

    def _check(self) -> None:
        if self.index.host_field(self.host, K.HS_STATE) != K.host_word(self.gen, K.LIVE):
            raise PoolRevoked(f"{self.md.name}: host {self.host} was dropped from the pool (its kv-index "
                              "extent was released): open the pool again")

    # the operations ------------------------------------------------------------------------------------
    def lookup(self, fp: Fingerprint | bytes, block_hash: bytes) -> bool:
        """Whether a sealed entry holds this key now."""
        self._check()
        return self.index.lookup(_key(fp, block_hash)) is not None

    def publish(self, fp: Fingerprint | bytes, block_hash: bytes, payload: Any) -> bool:
        """Store ``payload`` under the key; False when the key is present already or there is no
        room (no free slot near its home, or this host's unshared bytes reached its quota)."""
        key, data = _key(fp, block_hash), _u8(payload)
        idx, h = self.index, self.host
        if not 0 < data.nbytes <= idx.slot_bytes:
            raise ValueError(f"a payload is 1..{idx.slot_bytes} bytes (the pool's slot), got {data.nbytes}")
        self._check()
        if idx.host_field(h, K.HS_UNSHARED) + data.nbytes > idx.host_field(h, K.HS_QUOTA):
            self._stats["no_room"] += 1
            return False
        status, slot, alloc = idx.reserve(key, h, self.gen)
        if status != "ok":
            self._stats["present" if status == "present" else "no_room"] += 1
            return False
        try:
            self.md.write(idx.block_dpa(slot), data)
            idx.fill(slot, key, data.nbytes, K.checksum(data))
            sealed = idx.seal(slot, alloc)
        except NoExtent as exc:
            idx.abort(slot, alloc)
            raise PoolRevoked(f"{self.md.name}: host {h} lost the pool's extent: {exc}") from exc
        except BaseException:
            idx.abort(slot, alloc)
            raise
        if sealed is None:  # the firmware dropped this allocation: this host was dropped
            self._check()
            return False
        self._stats["published"] += 1
        return True

    def pin(self, fp: Fingerprint | bytes, block_hash: bytes) -> PinnedBlock | None:
        """Pin the sealed entry holding the key (None on a miss); ``release`` it when done."""
        key = _key(fp, block_hash)
        self._check()
        for _ in range(2):  # an entry evicted between lookup and pin: look once more
            found = self.index.lookup(key)
            if found is None:
                return None
            if self.index.pin(found[0], found[1], self.host):
                block = PinnedBlock(self, found[0], found[1], key)
                self._held[id(block)] = block
                return block
            self._stats["evicted_seen"] += 1
        return None

    def load(self, fp: Fingerprint | bytes, block_hash: bytes, out: Any) -> bool:
        """Fill the first bytes of ``out`` with the block; False on a miss, or when what was read
        is not the block asked for (counted as torn: the caller recomputes)."""
        arr = _u8(out, writable=True)
        block = self.pin(fp, block_hash)
        if block is None:
            self._stats["misses"] += 1
            return False
        try:
            if block.length > arr.nbytes:
                raise ValueError(f"out holds {arr.nbytes} bytes; the block is {block.length}")
            try:
                self.md.read_into(block.dpa, arr[:block.length])
            except NoExtent as exc:
                raise PoolRevoked(f"{self.md.name}: host {self.host} lost the pool's extent: {exc}") from exc
            ok = (K.checksum(arr[:block.length]) == block.crc
                  and self.index.entry_matches(block.slot, block.word, block.key, block.length, block.crc))
        finally:
            block.release()
        if not ok:
            self._stats["torn"] += 1
            return False
        self.index.touch(block.slot, self.host, time.monotonic_ns())
        self._stats["hits"] += 1
        # counted in the host table too, where the firmware reads them for the telemetry page
        self.index.add_host_field(self.host, K.HS_HITS)
        if K.owner_of(block.word)[0] != self.host:  # a block another host published: a cross-host hit
            self.index.add_host_field(self.host, K.HS_CROSS_HITS)
        return True

    # reporting and closing -------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """This handle's counts: hits, misses, published, torn, evicted_seen, pins_held (and
        present / no_room: publishes refused)."""
        return {**self._stats, "pins_held": len(self._held)}

    def info(self) -> dict[str, int]:
        """The pool as the index's header tells it (the firmware's counters, this host's usage)."""
        idx, w = self.index, self.index.words
        return {"slots": idx.slots, "slot_bytes": idx.slot_bytes, "live_entries": int(w[K.H_LIVE_ENTRIES]),
                "evictions": int(w[K.H_EVICTIONS]), "quota_evictions": int(w[K.H_QUOTA_EVICTIONS]),
                "reaped_allocations": int(w[K.H_REAPED_ALLOCS]), "cleared_pins": int(w[K.H_CLEARED_PINS]),
                "quota": idx.host_field(self.host, K.HS_QUOTA), "unshared": idx.host_field(self.host, K.HS_UNSHARED)}

    def close(self) -> None:
        """Unpin what is still pinned, leave the pool (LIVE -> IDLE), drop the views."""
        if self._cas is None:
            return
        for block in list(self._held.values()):
            block.release()
        word = K.host_word(self.gen, K.LIVE)
        self.index.cas_host_state(self.host, word, K.host_word(self.gen, K.IDLE))
        self.index = None  # type: ignore[assignment]
        self._cas.release()
        self._cas = None  # type: ignore[assignment]

    def __enter__(self) -> "KvPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
