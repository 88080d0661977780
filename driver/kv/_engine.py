"""The residency engine: which layer frames are on the accelerator, and the transfers between.

Per ``update(layer, k, v)`` (one attention layer of one forward)::

    poll finished transfers ──► make layer resident ──► append k, v ──► hint the firmware
          (non-blocking)        hit | late prefetch      into frame      ("the next layers come
                                | demand miss (stall)                     next"): prefetch them,
                                                                          evicting by policy

Eviction and prefetch are the firmware model's: an ``EvictionPolicy`` from
``firmware_model.policies`` keyed by layer orders the resident frames, and the engine prefetches
the layers the decode loop will visit next (``prefetch_depth`` ahead), protecting them and the
layer computing from eviction. A frame leaves by writing back only its dirty chunks (the tokens
appended since it was last saved); a load reads each distinct device chunk once, so sequences
sharing a prefix share the transfer too. Faults: a failed load is retried, then the lost chunks
are recomputed from the tokens (``recompute``) and written back, so no token changes.
"""
from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from driver.kv._arena import Arena, Frame, StagingPool
from driver.kv._chunks import ChunkPool
from driver.kv._layout import KVLayout
from driver.kv._mover import frame_to_chunks, make_mover
from driver.kv._store import BlockStore, Extent, Transfer, coalesce
from emulator.spec.errors import CxlemuError, DmaError, PoisonError
from firmware_model.policies import NoVictimError, make_policy

__all__ = ["KVLoadError", "ResidencyEngine"]

Recompute = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


class KVLoadError(CxlemuError):
    """A chunk could not be read back after every retry and could not be recomputed."""


@dataclass
class _Load:
    buf: torch.Tensor
    transfer: Transfer
    extents: list[Extent]
    firsts: dict[int, int]  # chunk -> host offset it is read into
    dups: list[tuple[int, int]]  # (from offset, to offset) filled after the read
    nblk: int
    seq_len: int
    attempts: int = 1


@dataclass
class _Write:
    buf: torch.Tensor
    transfer: Transfer
    extents: list[Extent]
    attempts: int = 1
    keys: list[tuple[int, bytes]] = field(default_factory=list)  # published when it lands


@dataclass
class _Layer:
    index: int
    batch: int
    frame: Frame | None = None
    seq_len: int = 0
    clean_upto: int = 0  # tokens [0, clean_upto) are on the device (or on their way)
    table: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    hashes: list[list[bytes]] = field(default_factory=list)
    load: _Load | None = None
    saves: list[tuple[object, int, int]] = field(default_factory=list)  # (mover token, j0, j1)
    writes: list[_Write] = field(default_factory=list)

    def ensure_blocks(self, nblk: int) -> None:
        if self.table.shape[1] < nblk:
            grown = np.full((self.batch, max(nblk, 2 * self.table.shape[1])), -1, np.int64)
            if self.table.size:
                grown[:, :self.table.shape[1]] = self.table
            self.table = grown
        for row in self.hashes:
            row.extend([b""] * (nblk - len(row)))


class ResidencyEngine:
    """Layer frames within an HBM budget over a chunk store; see the module docstring."""

    COUNTERS = ("loads", "offloads", "hits", "misses", "prefetch_late", "prefetch_issued",
                "stall_ns", "bytes_loaded", "bytes_offloaded", "shared_chunks", "dedup_write_bytes",
                "dedup_load_bytes", "cow_copies", "load_retries", "recomputed_chunks", "regrows")

    def __init__(self, *, budget: int, policy: str, block_tokens: int, store: BlockStore,
                 device: torch.device, dtype: torch.dtype,
                 prefetch_depth: int = 2, max_retries: int = 2, prefix_sharing: bool = True,
                 max_seq_len: int | None = None, recompute: Recompute | None = None,
                 full_writeback: bool = False) -> None:
        make_policy(policy, 1)  # fail fast on an unknown policy name, naming the known ones
        self.policy_name = policy
        self.block_tokens = block_tokens
        self.store = store
        self.pool: ChunkPool | None = None
        self.device = device
        self.dtype = dtype
        self.prefetch_depth = prefetch_depth
        self.max_retries = max_retries
        self.prefix_sharing = prefix_sharing
        self.max_seq_len = max_seq_len
        self.recompute = recompute
        self.full_writeback = full_writeback
        self.arena = Arena(budget, device, dtype)
        self.staging = StagingPool(pin=device.type == "cuda")
        self.mover = make_mover(device, self.staging)
        self.layout: KVLayout | None = None
        self.layers: list[_Layer] = []
        self.policy = make_policy(policy, 1)
        self.counters = dict.fromkeys(self.COUNTERS, 0)
        self._tick = 0
        self._num_layers = 0
        # keys of chunks whose write is in flight: shared within this engine, published on landing
        self._pending_key_of: dict[int, bytes] = {}
        self._pending_chunk_of: dict[bytes, int] = {}

    # ---------------------------------------------------------------- the path attention takes
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k``/``v`` (``(B, H, n, D)``) to ``layer``; returns views of the whole layer."""
        if self.layout is None:
            self._setup(k)
        while len(self.layers) <= layer:
            self.layers.append(_Layer(len(self.layers), k.shape[0], hashes=[[] for _ in range(k.shape[0])]))
        self._num_layers = max(self._num_layers, layer + 1)
        self._poll()
        st = self.layers[layer]
        new_len = st.seq_len + k.shape[-2]
        if new_len > self.arena.capacity:
            self._regrow(new_len)
        frame = self._acquire(st)
        frame.data[0][:, :, st.seq_len:new_len].copy_(k)
        frame.data[1][:, :, st.seq_len:new_len].copy_(v)
        st.seq_len = new_len
        st.ensure_blocks(self.layout.blocks(new_len))  # type: ignore[union-attr]
        self._prefetch_after(layer)
        return frame.data[0][:, :, :new_len], frame.data[1][:, :, :new_len]

    def seq_length(self, layer: int = 0) -> int:
        return self.layers[layer].seq_len if layer < len(self.layers) else 0

    def _setup(self, k: torch.Tensor) -> None:
        b, h, n, d = k.shape
        self.layout = KVLayout(batch=b, kv_heads=h, head_dim=d, itemsize=k.element_size(),
                               block_tokens=self.block_tokens)
        self.store.configure(self.layout.chunk_bytes)
        self.pool = self.store.pool
        needed = max(n, self.max_seq_len or 0)
        self.arena.configure(self.layout, needed, self._headroom(needed))
        self.policy = make_policy(self.policy_name, self.arena.max_frames)

    def _headroom(self, n: int) -> int:
        return 0 if self.max_seq_len else max(self.block_tokens, n // 4)

    def _acquire(self, st: _Layer) -> Frame:
        """Make ``st`` resident for compute, counting a hit, a late prefetch or a miss."""
        self._tick += 1
        if st.load is not None:
            if st.load.transfer.done():
                self.counters["hits"] += 1
            else:
                self.counters["prefetch_late"] += 1
            self._finish_load(st, stall=True)
            self.policy.touch(st.index, self._tick)
        elif st.frame is not None:
            if st.seq_len:
                self.counters["hits"] += 1
            self.policy.touch(st.index, self._tick)
        elif st.seq_len == 0:
            st.frame = self._take_frame({st.index} | self._inflight())
            st.frame.layer = st.index
            self.mover.before_overwrite(st.frame)
            self.policy.insert(st.index, self._tick)
        else:
            self.counters["misses"] += 1
            if not self._start_load(st, protected={st.index} | self._inflight()):
                raise AssertionError("no frame for the computing layer: budget below two frames")
            self._finish_load(st, stall=True)
            self.policy.insert(st.index, self._tick)
        assert st.frame is not None
        self.mover.before_compute(st.frame)
        return st.frame

    # ------------------------------------------------------------------------- prefetch hints
    def _upcoming(self, layer: int) -> list[int]:
        n = self._num_layers
        depth = min(self.prefetch_depth, self.arena.max_frames - 1, n - 1)
        return [(layer + i) % n for i in range(1, depth + 1)]

    def _prefetch_after(self, layer: int) -> None:
        """The firmware's hint: layers ``layer+1 ..`` run next; load the absent ones now."""
        window = self._upcoming(layer)
        protected = {layer, *window} | self._inflight()
        for nxt in window:
            st = self.layers[nxt] if nxt < len(self.layers) else None
            if st is None or st.frame is not None or st.load is not None or st.seq_len == 0:
                continue
            if not self._start_load(st, protected=protected):
                return
            self.counters["prefetch_issued"] += 1
            self._tick += 1
            self.policy.insert(nxt, self._tick)

    def _inflight(self) -> set[int]:
        return {st.index for st in self.layers if st.load is not None}

    # ------------------------------------------------------------------------- frames
    def _take_frame(self, protected: set[int]) -> Frame:
        frame = self.arena.take()
        while frame is None:
            victim = self.policy.evict(protected)
            self._evict(self.layers[victim])  # type: ignore[index]
            frame = self.arena.take()
        return frame

    def _evict(self, st: _Layer) -> None:
        assert st.frame is not None and st.load is None
        self._save(st)
        self.mover.release(st.frame)
        self.arena.give(st.frame)
        st.frame = None

    def _regrow(self, needed: int) -> None:
        """The sequences outgrew the frames: save everything, re-carve the arena larger."""
        self.counters["regrows"] += 1
        self._drain_loads()
        for st in self.layers:
            if st.frame is not None:
                self.policy.remove(st.index)
                self._evict(st)
        self._drain_writes()
        self.arena.release_all()
        assert self.layout is not None
        self.arena.configure(self.layout, needed, self._headroom(needed))
        self.policy = make_policy(self.policy_name, self.arena.max_frames)

    # ------------------------------------------------------------------------- offload
    def _save(self, st: _Layer) -> None:
        assert self.layout is not None and st.frame is not None
        bt = self.block_tokens
        j0 = 0 if self.full_writeback else st.clean_upto // bt
        j1 = self.layout.blocks(st.seq_len)
        if j0 >= j1:
            return
        if st.writes:
            self._wait_writes(st)  # a chunk freed below must not still have a write in flight
        token = self.mover.save_start(st.frame, j0, j1, st.seq_len, bt)
        st.clean_upto = st.seq_len
        st.saves.append((token, j0, j1))
        self._advance_saves(st)

    def _advance_saves(self, st: _Layer, force: bool = False) -> None:
        while st.saves and (force or self.mover.save_ready(st.saves[0][0])):
            token, j0, j1 = st.saves.pop(0)
            lay = self.layout
            assert lay is not None
            buf = self.staging.get(lay.batch * (j1 - j0) * lay.chunk_bytes)
            stage = self._stage_view(buf, j1 - j0)
            self.mover.save_finish(token, stage)
            self._write_chunks(st, buf, j0, j1)

    def _write_chunks(self, st: _Layer, buf: torch.Tensor, j0: int, j1: int) -> None:
        """Give each dirty chunk a device chunk (shared by hash, copied on write) and write it."""
        lay = self.layout
        assert lay is not None
        cb, nb = lay.chunk_bytes, j1 - j0
        host = buf.numpy()
        chunks: list[int] = []
        offsets: list[int] = []
        for b in range(lay.batch):
            for j in range(j0, j1):
                off = (b * nb + j - j0) * cb
                if self._place_chunk(st, b, j, host[off:off + cb]):
                    chunks.append(int(st.table[b, j]))
                    offsets.append(off)
        if not chunks:
            self.staging.put(buf)
            return
        extents = coalesce(chunks, offsets, cb)
        self.counters["offloads"] += len(chunks)
        self.counters["bytes_offloaded"] += len(chunks) * cb
        keys = [(c, self._pending_key_of[c]) for c in chunks if c in self._pending_key_of]
        st.writes.append(_Write(buf, self.store.write(extents, host), extents, keys=keys))

    def _place_chunk(self, st: _Layer, b: int, j: int, data: np.ndarray) -> bool:
        """Point (row b, block j) at a device chunk; True when its bytes must be written.

        With prefix sharing the chunk's key chains its parent's key, its layer and its bytes, so a
        match means the whole prefix up to it is equal; equal bytes are never written twice. A
        chunk others still reference is copied on write; a key is published only once its write
        has landed, so no reader can see a chunk before its bytes are there."""
        pool = self.pool
        assert pool is not None
        cur = int(st.table[b, j])
        key = b""
        if self.prefix_sharing:
            parent = st.hashes[b][j - 1] if j else b"root"
            key = hashlib.blake2b(parent + st.index.to_bytes(4, "little") + data.tobytes(),
                                  digest_size=16).digest()
            st.hashes[b][j] = key
            hit = pool.lookup(key)
            if hit is None:
                hit = self._pending_chunk_of.get(key)
            if hit is not None:
                if hit != cur:
                    pool.incref(hit)
                    if cur >= 0:
                        self._decref(cur)
                    st.table[b, j] = hit
                    self.counters["shared_chunks"] += 1
                self.counters["dedup_write_bytes"] += data.size
                return False
        if cur >= 0 and (pool.refs(cur) > 1 or pool.hashed(cur)):
            # copy on write: others (or later prefix hits) keep the old bytes under the old hash
            self.counters["cow_copies"] += pool.refs(cur) > 1
            self._decref(cur)
            cur = -1
        elif cur >= 0:
            self._forget_pending(cur)  # private, unpublished: rewritten in place
        if cur < 0:
            cur = pool.alloc(1)[0]
            st.table[b, j] = cur
        if self.prefix_sharing:
            self._forget_pending(cur)
            self._pending_key_of[cur] = key
            self._pending_chunk_of.setdefault(key, cur)
        return True

    def _decref(self, chunk: int) -> None:
        assert self.pool is not None
        self.pool.decref(chunk)
        if not self.pool.refs(chunk):
            self._forget_pending(chunk)

    def _forget_pending(self, chunk: int) -> None:
        key = self._pending_key_of.pop(chunk, None)
        if key is not None and self._pending_chunk_of.get(key) == chunk:
            del self._pending_chunk_of[key]

    # ------------------------------------------------------------------------- load
    def _stage_view(self, buf: torch.Tensor, nblk: int) -> torch.Tensor:
        lay = self.layout
        assert lay is not None
        n = lay.batch * nblk * lay.chunk_bytes
        return buf[:n].view(self.dtype).view(lay.batch, nblk, 2, lay.kv_heads, lay.block_tokens, lay.head_dim)

    def _start_load(self, st: _Layer, protected: set[int]) -> bool:
        """Reserve a frame and start reading ``st``'s chunks; False if no frame can be freed."""
        lay = self.layout
        assert lay is not None
        if st.writes or st.saves:
            self._advance_saves(st, force=True)
            self._wait_writes(st)  # a load must see the bytes its own offload wrote
        try:
            frame = self._take_frame(protected)
        except NoVictimError:
            return False
        frame.layer = st.index
        st.frame = frame
        nblk = lay.blocks(st.seq_len)
        cb = lay.chunk_bytes
        firsts: dict[int, int] = {}
        dups: list[tuple[int, int]] = []
        for b in range(lay.batch):
            for j in range(nblk):
                c, off = int(st.table[b, j]), (b * nblk + j) * cb
                if c in firsts:
                    dups.append((firsts[c], off))
                else:
                    firsts[c] = off
        buf = self.staging.get(lay.batch * nblk * cb)
        extents = coalesce(list(firsts), list(firsts.values()), cb)
        st.load = _Load(buf, self.store.read(extents, buf.numpy()), extents, firsts, dups, nblk, st.seq_len)
        self.counters["loads"] += len(firsts)
        self.counters["bytes_loaded"] += len(firsts) * cb
        self.counters["dedup_load_bytes"] += len(dups) * cb
        return True

    def _finish_load(self, st: _Layer, stall: bool) -> None:
        ld, frame = st.load, st.frame
        assert ld is not None and frame is not None
        t0 = time.perf_counter_ns()
        self._wait_load(st, ld)
        host = ld.buf.numpy()
        cb = self.layout.chunk_bytes  # type: ignore[union-attr]
        for src, dst in ld.dups:
            host[dst:dst + cb] = host[src:src + cb]
        self.mover.load_start(self._stage_view(ld.buf, ld.nblk), frame, ld.nblk, ld.seq_len, self.block_tokens)
        self.staging.put(ld.buf)
        st.load = None
        if stall:
            self.counters["stall_ns"] += time.perf_counter_ns() - t0

    def _wait_load(self, st: _Layer, ld: _Load) -> None:
        """Wait for the read; retry a failure, then recompute what stays unreadable."""
        while True:
            try:
                ld.transfer.wait()
                return
            except (DmaError, PoisonError) as exc:
                if ld.attempts > self.max_retries:
                    self._recover(st, ld, exc)
                    return
                ld.attempts += 1
                self.counters["load_retries"] += 1
                ld.transfer = self.store.read(ld.extents, ld.buf.numpy())

    def _recover(self, st: _Layer, ld: _Load, cause: Exception) -> None:
        """Read chunk by chunk; recompute the unreadable ones from the tokens and rewrite them."""
        host = ld.buf.numpy()
        bad: list[tuple[int, int]] = []
        for c, off in ld.firsts.items():
            try:
                self.store.read([Extent(c, 1, off)], host).wait()
            except (DmaError, PoisonError):
                bad.append((c, off))
        if not bad:
            return
        if self.recompute is None:
            raise KVLoadError(f"layer {st.index}: {len(bad)} KV chunk(s) unreadable after "
                              f"{self.max_retries} retries ({cause}); pass model= to CxlCache so "
                              "lost chunks can be recomputed from the tokens") from cause
        keys, values = self.recompute(st.index, ld.seq_len)
        full = torch.stack([keys, values]).to("cpu", self.dtype)
        stage = self._stage_view(ld.buf, ld.nblk)
        lay = self.layout
        assert lay is not None
        redo = torch.empty_like(stage)
        frame_to_chunks(full, redo, 0, ld.nblk, ld.seq_len, self.block_tokens)
        redo_host = redo.view(torch.uint8).reshape(-1).numpy()
        for c, off in bad:
            host[off:off + lay.chunk_bytes] = redo_host[off:off + lay.chunk_bytes]
            self.store.scrub(c)  # same bytes back in place: its hash and every sharer stay valid
            self.store.write([Extent(c, 1, off)], host).wait()
        self.counters["recomputed_chunks"] += len(bad)

    # ------------------------------------------------------------------------- bookkeeping
    def _poll(self) -> None:
        """Finish whatever completed, without blocking."""
        for st in self.layers:
            if st.load is not None and st.load.transfer.done():
                self._finish_load(st, stall=False)
            if st.saves:
                self._advance_saves(st)
            if st.writes:
                self._reap_writes(st, block=False)

    def _reap_writes(self, st: _Layer, block: bool) -> None:
        keep: list[_Write] = []
        for w in st.writes:
            if not block and not w.transfer.done():
                keep.append(w)
                continue
            while True:
                try:
                    w.transfer.wait()
                    break
                except (DmaError, PoisonError):
                    if w.attempts > self.max_retries:
                        raise
                    w.attempts += 1
                    w.transfer = self.store.write(w.extents, w.buf.numpy())
            self.staging.put(w.buf)
            for chunk, key in w.keys:
                if self._pending_key_of.get(chunk) != key:
                    continue  # rewritten or freed since: that later write publishes it
                self._forget_pending(chunk)
                if self.pool is not None and self.pool.refs(chunk) and not self.pool.hashed(chunk):
                    self.pool.register(chunk, key)  # an equal chunk may hold the key: fine, both valid
        st.writes = keep

    def _wait_writes(self, st: _Layer) -> None:
        self._reap_writes(st, block=True)

    def _drain_loads(self) -> None:
        for st in self.layers:
            if st.load is not None:
                self._finish_load(st, stall=False)

    def _drain_writes(self) -> None:
        for st in self.layers:
            self._advance_saves(st, force=True)
            self._wait_writes(st)

    def close(self) -> None:
        """Wait for every transfer, free every frame, drop every device chunk reference."""
        for st in self.layers:
            if st.load is not None:  # nobody needs these bytes any more: discard, even if it failed
                try:
                    st.load.transfer.wait()
                except (DmaError, PoisonError):
                    pass
                self.staging.put(st.load.buf)
                st.load = None
        for st in self.layers:
            if st.frame is not None:
                self.mover.release(st.frame)
                self.arena.give(st.frame)
                st.frame = None
        self._drain_writes()
        if self.pool is not None:
            for st in self.layers:
                for c in st.table[st.table >= 0].tolist():
                    self._decref(int(c))
                st.table[:] = -1
        self.layers.clear()
        if self.layout is not None:
            self.arena.release_all()
        self.staging.clear()

    def stats(self) -> dict[str, int]:
        out = dict(self.counters)
        out["hbm_peak_bytes"] = self.arena.peak_bytes
        out["hbm_bytes"] = self.arena.bytes_in_use
        out["hbm_budget_bytes"] = self.arena.budget
        out["frames"] = self.arena.max_frames
        out["staging_peak_bytes"] = self.staging.peak_bytes
        out["device_chunks_used"] = self.pool.used if self.pool else 0
        out["device_chunks_shared"] = self.pool.shared if self.pool else 0
        return out
