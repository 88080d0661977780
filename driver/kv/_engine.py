"""The residency engine: which layer frames are on the accelerator, and the transfers between.

Per ``update(layer, k, v)`` (one attention layer of one forward)::

    poll finished transfers ──► make layer resident ──► append k, v ──► hint the firmware,
          (non-blocking)        hit | late prefetch      into frame      report progress: its
                                | demand miss (stall)                     prefetch queue issues
                                                                          the loads now due,
                                                                          evicting by policy

Both decisions are the firmware model's. Eviction: an ``EvictionPolicy`` from
``firmware_model.policies``, keyed by layer, orders the resident frames. Prefetch: a
``firmware_model.prefetch.PrefetchQueue`` (one block per layer, one sequence: the batch) gets
the shim's hints ("the batch computes layer l at step t") and its progress; when progress comes
within ``prefetch_depth`` points of a hinted point (``"auto"``: the firmware model's
``window_points`` for the device's link model and the compute per layer measured on the engine's
clock), the queue issues that layer's load, which the engine starts on the device's DMA engine,
protecting the window's layers and the computing one. The queue's accounting is the shim's: a
prefetch is useful (landed before its compute), late (the compute waited for it) or wasted
(evicted unused). A frame leaves by writing back only its dirty blocks (the tokens appended
since its last save; :class:`WriteBack`); a load reads each distinct device chunk once
(:class:`ChunkTables` plans it), straight into the frame on CPU. Faults: a failed load is
retried, then the chunks still unreadable are recomputed from the tokens and rewritten, so no
token changes (:class:`LoadRecovery`). Every decision can be reported to ``record`` as a
:data:`Decision`; on a simulated clock they are deterministic.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from driver.kv._arena import Arena, Frame, StagingPool
from driver.kv._chunkio import ChunkTables, LayerChunks
from driver.kv._chunks import ChunkPool
from driver.kv._layout import KVLayout
from driver.kv._mover import make_mover
from driver.kv._recompute import KVLoadError, LoadRecovery, Recompute
from driver.kv._store import BlockStore, Extent, Transfer
from driver.kv._writeback import PendingWrite, WriteBack
from emulator.spec.errors import DmaError, PoisonError
from emulator.timing.clock import WallClock
from firmware_model.clock import Clock
from firmware_model.dma import QueueFullError
from firmware_model.link import LinkParams
from firmware_model.policies import NoVictimError, make_policy
from firmware_model.prefetch import PrefetchQueue, PrefetchStats, resolve_window

__all__ = ["Decision", "KVLoadError", "ResidencyEngine"]


#: What the engine reports to ``record`` (tests assert exact sequences of them):
#: ``(step, kind, layer)``, step = the forward it happened in, kind one of
#: "hit" (resident, loaded before), "late" (a prefetch still in flight: the compute waited),
#: "miss" (a demand load), "prefetch" (the firmware's queue issued a load), "evict".
Decision = tuple[int, str, int]


class _UnsizedPolicy:
    """The eviction policy while the frames it will order are not counted yet.

    A policy is built for a capacity, and the frames a budget affords may be far more than a
    cache ever uses (one per layer: ``hbm_budget_bytes=1 << 62`` affords ~10**17). Until the
    layer count is known (the second forward) or the frames run out (the first eviction, when
    the capacity is the frames allocated), the calls are recorded; :meth:`build` makes the
    policy for the capacity then known and replays them, so it is in exactly the state it would
    have been in had it been built for that capacity at the start."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._resident: dict[int, None] = {}
        self._calls: list[tuple[str, tuple[Any, ...]]] = []

    def insert(self, key: int, now: int = 0) -> None:
        self._resident[key] = None
        self._calls.append(("insert", (key, now)))

    def touch(self, key: int, now: int = 0) -> None:
        self._calls.append(("touch", (key, now)))

    def remove(self, key: int) -> None:
        del self._resident[key]
        self._calls.append(("remove", (key,)))

    def build(self, capacity: int) -> Any:
        policy = make_policy(self.name, capacity)
        for method, args in self._calls:
            getattr(policy, method)(*args)
        return policy

    def __contains__(self, key: object) -> bool:
        return key in self._resident

    def __len__(self) -> int:
        return len(self._resident)


class _Landed:
    """A prefetch's completion as the firmware's ``PrefetchQueue`` waits on it (simpy's shape:
    ``callbacks``, each called with the event), fired by the engine when the load lands."""

    __slots__ = ("callbacks",)

    def __init__(self) -> None:
        self.callbacks: list[Any] = []

    def fire(self) -> None:
        callbacks, self.callbacks = self.callbacks, []
        for callback in callbacks:
            callback(self)


@dataclass(eq=False)
class _Prefetch:
    """One layer load the prefetch queue issued (its ``DmaRequest`` in the shim)."""

    tag: int
    done: _Landed = field(default_factory=_Landed)


class _FrameLoads:
    """The DMA side of the firmware's prefetch queue in the shim: issuing block ``tag`` (a
    layer) starts its load into a frame on the device's DMA engine. With no frame to free,
    ``QueueFullError``: the queue keeps the hint and retries at the next progress point. A load
    in flight cannot be cancelled (the device's DMA engine has no abort)."""

    def __init__(self, engine: ResidencyEngine) -> None:
        self._engine = engine

    def submit(self, direction: str, nbytes: int, *, priority: Any = 0, tag: Any = None) -> _Prefetch:
        return self._engine._issue_prefetch(tag)

    def cancel(self, request: _Prefetch) -> bool:
        return False


@dataclass
class _Load:
    host: np.ndarray  # the image the DMA lands in
    cap: int  # its capacity in tokens
    token: Any  # the mover's handle on it
    transfer: Transfer
    extents: list[Extent]
    firsts: dict[int, tuple[int, int]] | None  # None: recovery builds it from the table
    dups: list[tuple[int, int, int]]
    seq_len: int
    attempts: int = 1
    chunks: LayerChunks | None = None  # the table it was planned from
    landed: threading.Event | None = None  # set by the completion callback (CPU)
    ok: bool = False  # the callback saw the DMA succeed and filled the shared copies
    prefetch: _Prefetch | None = None  # issued by the prefetch queue (None: a demand load)


@dataclass
class _Layer:
    index: int
    chunks: LayerChunks
    frame: Frame | None = None
    seq_len: int = 0
    clean_upto: int = 0  # tokens [0, clean_upto) are on the device (or on their way)
    load: _Load | None = None
    saves: list[tuple[Any, int, int, int]] = field(default_factory=list)  # (token, j0, j1, seq_len)
    writes: list[PendingWrite] = field(default_factory=list)
    tail: tuple[Any, int, int, int] | None = None  # kept tail image: (buffer, j0, j1, tokens in it)


class ResidencyEngine:
    """Layer frames within an HBM budget over a chunk store; see the module docstring.

    Its parts: ``tables`` (:class:`ChunkTables`: block tables, prefix sharing, load plans),
    ``writeback`` (:class:`WriteBack`: saving evicted frames) and ``recovery``
    (:class:`LoadRecovery`: retrying and recomputing failed loads), each given what it uses."""

    COUNTERS = ("loads", "offloads", "hits", "misses", "prefetch_late", "prefetch_issued",
                "stall_ns", "bytes_loaded", "bytes_offloaded", "shared_chunks", "dedup_write_bytes",
                "dedup_load_bytes", "cow_copies", "load_retries", "recomputed_chunks", "regrows",
                "evictions", "prefetch_useful", "prefetch_wasted", "tokens_generated")

    def __init__(self, *, budget: int, policy: str, block_tokens: int, store: BlockStore,
                 device: torch.device, dtype: torch.dtype, prefetch_depth: int | str | Callable[..., int] = "auto",
                 max_retries: int = 2, prefix_sharing: bool = True, max_seq_len: int | None = None,
                 recompute: Recompute | None = None, full_writeback: bool = False,
                 link: LinkParams | None = None, clock: Clock | None = None,
                 record: Callable[[Decision], None] | None = None) -> None:
        """``link``: the device's link model (``TimingConfig.link_params()``), which sizes the
        ``"auto"`` prefetch window; None or untimed: one layer ahead. ``clock``: what the compute
        per layer is measured on (default :class:`WallClock`). ``record``: called with every
        :data:`Decision` the engine takes."""
        make_policy(policy, 1)  # fail fast on an unknown policy name, naming the known ones
        self.policy_name = policy
        self.block_tokens = block_tokens
        self.store = store
        self.pool: ChunkPool | None = None
        self.dtype = dtype
        self.prefetch_depth = prefetch_depth
        # "auto" (window_points) or a window function of the user's: what sizes the window
        self._window_fn = None if isinstance(prefetch_depth, int) else resolve_window(prefetch_depth)
        self.max_seq_len = max_seq_len
        self.arena = Arena(budget, device, dtype)
        self.staging = StagingPool(pin=device.type == "cuda")
        self.mover = make_mover(device, self.staging)
        self.layout: KVLayout | None = None
        self.layers: list[_Layer] = []
        self.policy: Any = _UnsizedPolicy(policy)
        self.counters = dict.fromkeys(self.COUNTERS, 0)
        self._tick = 0
        self._num_layers = 0
        self._layers_counted = 0  # the layer count the arena's frames are limited to (0: not yet)
        self.link = link
        self.clock: Clock = clock if clock is not None else WallClock()
        self._record = record
        self._layer_ns = 0.0
        self._last_layer, self._last_ns, self._last_stall = -1, 0.0, 0
        self._loading: set[int] = set()  # layers with a load in flight
        self._pending: dict[int, _Layer] = {}  # layers that may have a load, save or write to finish
        self._window: tuple[int, tuple[int, ...]] = (-1, ())  # (depth, offsets) of the prefetch window
        self._registered: dict[int, np.ndarray] = {}  # host buffers registered with the store
        # the parts, each given what it uses (they count into this engine's counters)
        self.tables = ChunkTables(prefix_sharing=prefix_sharing, counters=self.counters)
        self.writeback: WriteBack[_Layer] = WriteBack(
            store=store, chunks=self.tables, staging=self.staging, mover=self.mover, counters=self.counters,
            register=self._register, pending=self._pending, block_tokens=block_tokens,
            # full_writeback: the transformers baseline, rewriting whole layers
            full_writeback=full_writeback, prefix_sharing=prefix_sharing, max_retries=max_retries)
        self.recovery = LoadRecovery(store=store, chunks=self.tables, counters=self.counters, dtype=dtype,
                                     max_retries=max_retries, recompute=recompute)
        self._pq: PrefetchQueue | None = None  # the firmware's prefetch queue (from the 2nd forward)
        self._step = -1  # forwards begun (a forward starts at layer 0)
        self._hinted = -1  # the last progress point hinted to the queue
        self._protect: set[int] | None = None  # layers a prefetch must not evict (built on demand)
        self._protect_window: tuple[int, list[int]] = (-1, [])  # (computing layer, window)

    # ---------------------------------------------------------------- the path attention takes
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k``/``v`` (``(B, H, n, D)``) to ``layer``; returns views of the whole layer."""
        if self.layout is None:
            self._setup(k)
        lay = self.layout
        assert lay is not None
        while len(self.layers) <= layer:
            self.layers.append(_Layer(len(self.layers), LayerChunks(lay.batch, lay.pieces)))
        self._num_layers = max(self._num_layers, layer + 1)
        n = k.shape[-2]
        self._step += layer == 0
        if layer == 0 and self._step and self._layers_counted != self._num_layers:
            self._count_layers()
        self._time_layer(layer, n)
        if self._pending:
            self._poll()
        st = self.layers[layer]
        old_len = st.seq_len
        new_len = old_len + n
        if new_len > self.arena.capacity:
            self._regrow(new_len)
        frame = self._acquire(st)
        if layer == 0:
            self.counters["tokens_generated"] += k.shape[0] * n
        self._append(frame, old_len, k, v)
        st.seq_len = new_len
        st.chunks.ensure(lay.blocks(new_len))
        if n > 1 and self.arena.ran_out:  # while every layer has a frame, none goes to the device
            self.writeback.write_through(st)
        self._prefetch_after(layer)
        return frame.k.narrow(2, 0, new_len), frame.v.narrow(2, 0, new_len)

    @staticmethod
    def _append(frame: Frame, at: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``, ``v`` at token ``at`` of the frame: with numpy on a CPU frame (two
        assignments; torch would dispatch a view and a copy for each), else with torch."""
        n = k.shape[-2]
        if frame.np_kv is not None and k.dtype == frame.data.dtype and not (k.requires_grad or v.requires_grad):
            try:
                frame.np_kv[0][:, :, at:at + n] = k.numpy()
                frame.np_kv[1][:, :, at:at + n] = v.numpy()
                return
            except (RuntimeError, TypeError):  # a tensor numpy cannot view (conj bit, subclass)
                pass
        frame.k.narrow(2, at, n).copy_(k)
        frame.v.narrow(2, at, n).copy_(v)

    def seq_length(self, layer: int = 0) -> int:
        return self.layers[layer].seq_len if layer < len(self.layers) else 0

    def _setup(self, k: torch.Tensor) -> None:
        b, h, n, d = k.shape
        self.layout = KVLayout(batch=b, kv_heads=h, head_dim=d, itemsize=k.element_size(),
                               block_tokens=self.block_tokens)
        self.store.configure(self.layout.chunk_bytes)
        self.pool = self.store.pool
        self.tables.configure(self.layout, self.pool)
        needed = max(n, self.max_seq_len or 0)
        if self.max_seq_len:
            when = f"found at the prefill, before any token was produced, for max_seq_len={self.max_seq_len}"
        else:
            when = (f"found at the prefill, before any token was produced, for the {n}-token prompt "
                    "(without max_seq_len= the final length is not known)")
        self.arena.configure(self.layout, needed, self._headroom(needed), when)
        self.policy = self._new_policy()

    def _headroom(self, n: int) -> int:
        return 0 if self.max_seq_len else max(self.block_tokens, n // 4)

    def _new_policy(self) -> Any:
        """The eviction policy for the arena's frames; unsized until the layer count is known."""
        if self._layers_counted:
            return make_policy(self.policy_name, self.arena.max_frames)
        return _UnsizedPolicy(self.policy_name)

    def _count_layers(self) -> None:
        """A forward has run: the layers it computed are all a frame is ever needed for, so the
        arena makes no more frames than that and the policy is built for what it makes."""
        self._layers_counted = self._num_layers
        self.arena.limit_frames(self._num_layers)
        if isinstance(self.policy, _UnsizedPolicy):
            self.policy = self.policy.build(self.arena.max_frames)

    def _acquire(self, st: _Layer) -> Frame:
        """Make ``st`` resident for compute, counting a hit, a late prefetch or a miss.

        The policy sees exactly the compute trace (one access per layer computed): a prefetched
        layer enters it when it is first used, not when its load starts, so prefetching does not
        disturb the recency / frequency / reuse statistics it learns the loop from."""
        self._tick += 1
        pq = self._pq
        if st.load is not None:  # a prefetch: landed (a hit, useful) or in flight (late, stall)
            done = self._load_done(st.load)
            if done:
                self._finish_load(st, stall=False)
            if pq is not None:
                pq.demand(st.index)
            if done:
                self.counters["hits"] += 1
            else:
                self._finish_load(st, stall=True)
            self._decided("hit" if done else "late", st.index)
        elif st.frame is not None:
            if pq is not None:
                pq.demand(st.index)  # a prefetch that landed while we computed: useful
            self.counters["hits"] += bool(st.seq_len)
            if st.seq_len:
                self._decided("hit", st.index)
        elif st.seq_len == 0:
            st.frame = self._take_frame({st.index, *self._loading})
            self.mover.before_overwrite(st.frame)
        else:
            self.counters["misses"] += 1
            if not self._start_load(st, protected={st.index, *self._loading}):
                raise AssertionError("no frame for the computing layer: budget below two frames")
            self._decided("miss", st.index)  # after the evictions that made room for it
            self._finish_load(st, stall=True)
        if st.index in self.policy:
            self.policy.touch(st.index, self._tick)
        else:
            self.policy.insert(st.index, self._tick)
        assert st.frame is not None
        self.mover.before_compute(st.frame)
        return st.frame

    def _decided(self, kind: str, layer: int) -> None:
        if self._record is not None:
            self._record((self._step, kind, layer))

    # ------------------------------------------------------------------------- prefetch hints
    def _depth(self) -> int:
        """Layers to load ahead: fixed, or (``"auto"``) the firmware model's prefetch window —
        just enough layers of compute to hide one layer's transfer (``window_points``), from the
        link's timing and the measured compute time per layer; or what a window function of the
        user's (``"package.module:function"`` or a callable, same arguments) returns for them."""
        if self._window_fn is None:
            return int(self.prefetch_depth)  # type: ignore[arg-type]  # an int when there is no function
        if self.link is None or self.link.untimed or self._layer_ns <= 0 or self.layout is None:
            return 1
        layer_bytes = self.layout.frame_bytes(self.layers[0].seq_len if self.layers else 1)
        return self._window_fn(self.link, layer_bytes, self._layer_ns, self._num_layers)

    def _upcoming(self, layer: int) -> list[int]:
        """The layers of the prefetch window after ``layer``. Its depth is sized once per decode
        step (at layer 0, or while compute per layer is not measured yet): the moving average
        it comes from changes slowly, and sizing it costs a firmware-model call per layer."""
        n = self._num_layers
        depth, offsets = self._window
        if layer == 0 or depth < 0 or self._layer_ns <= 0:
            depth = min(self._depth(), self.arena.max_frames - 1, n - 1)
            if depth != self._window[0]:
                offsets = tuple(range(1, depth + 1))
            self._window = (depth, offsets)
        return [(layer + i) % n for i in offsets]

    def _time_layer(self, layer: int, tokens: int) -> None:
        """Keep a moving average of decode compute time per layer: update to update, less the
        time this shim stalled in between (a stall is not compute it can hide transfers in)."""
        now, stalled = self.clock.now_ns(), self.counters["stall_ns"]
        if tokens == 1 and layer == self._last_layer + 1 and self._last_ns:
            dt = max(1, now - self._last_ns - (stalled - self._last_stall))
            self._layer_ns = dt if self._layer_ns <= 0 else 0.8 * self._layer_ns + 0.2 * dt
        self._last_layer, self._last_ns, self._last_stall = layer, now, stalled

    def _prefetch_after(self, layer: int) -> None:
        """Tell the firmware's prefetch queue where compute is (progress) and what comes next
        (hints for the points of the window ahead); it issues the loads now due."""
        window = self._upcoming(layer)
        pq = self._prefetcher()
        if pq is None:  # the first forward: the layer count is not known yet, nothing to load
            return
        n = self._num_layers
        here = self._step * n + layer
        self._protect = None
        self._protect_window = (layer, window)
        pq.window = len(window)
        pq.progress(0, self._step, layer)
        last = here + len(window)
        for p in range(max(self._hinted, here) + 1, last + 1):
            pq.hint(0, p // n, p % n, (p % n,))  # issued at once: it is within the window
        self._hinted = max(self._hinted, last)
        self._sync_prefetch()

    def _prefetcher(self) -> PrefetchQueue | None:
        """The prefetch queue, made once the layer count is known (the second forward on);
        a model whose layer count changes gets a new one, its accounting carried over."""
        pq = self._pq
        if pq is not None and pq.layers == self._num_layers:
            return pq
        if self._step < 1 or self.layout is None:
            return None
        new = PrefetchQueue(_FrameLoads(self), block_bytes=self.arena.frame_bytes, window=1,
                            layers=self._num_layers, is_resident=self._resident,
                            on_arrival=lambda _layer: True)  # the load landed in its frame
        if pq is not None:
            pq.end_sequence(0)
            new.stats = pq.stats
        self._pq, self._hinted = new, -1
        return new

    def _resident(self, layer: int) -> bool:
        """For the prefetch queue: nothing to load (resident, loading, or no tokens yet)."""
        st = self.layers[layer]
        return st.frame is not None or st.load is not None or st.seq_len == 0

    def _issue_prefetch(self, layer: int) -> _Prefetch:
        """The prefetch queue issues ``layer``: start its load (``_FrameLoads.submit``)."""
        st = self.layers[layer]
        if self._protect is None:  # built only when a load is issued (most calls issue none)
            computing, window = self._protect_window
            self._protect = {computing, *window, *self._loading}
        if not self._start_load(st, protected=self._protect):
            raise QueueFullError(f"no frame can be freed to prefetch layer {layer}")
        self._decided("prefetch", layer)  # after the evictions that made room for it
        assert st.load is not None
        st.load.prefetch = _Prefetch(layer)
        return st.load.prefetch

    def _sync_prefetch(self) -> None:
        """The queue's accounting into the counters (published to the device as they are)."""
        if self._pq is not None:
            s: PrefetchStats = self._pq.stats
            c = self.counters
            c["prefetch_issued"], c["prefetch_useful"] = s.issued, s.useful
            c["prefetch_late"], c["prefetch_wasted"] = s.late, s.wasted

    # ------------------------------------------------------------------------- frames
    def _take_frame(self, protected: set[int]) -> Frame:
        """A free frame, evicting the policy's victims (never a protected layer) until one is."""
        frame = self.arena.take()
        if frame is None and isinstance(self.policy, _UnsizedPolicy):
            self.policy = self.policy.build(self.arena.max_frames)  # all allocated: a real count
        while frame is None:
            victim = self.policy.evict(protected)
            self._evict(self.layers[cast(int, victim)])
            frame = self.arena.take()
        return frame

    def _evict(self, st: _Layer) -> None:
        assert st.frame is not None and st.load is None
        self.counters["evictions"] += 1
        self._decided("evict", st.index)
        if self._pq is not None:
            self._pq.evicted(st.index)  # a prefetch that landed and was never used: wasted
        self.writeback.save(st)
        self.writeback.release_frame(st)
        self.mover.release(st.frame)
        self.arena.give(st.frame)
        st.frame = None

    def _regrow(self, needed: int) -> None:
        """The sequences outgrew the frames: grow them in place if every layer still fits, else
        save everything and re-carve the arena larger."""
        self.counters["regrows"] += 1
        self._drain_loads()
        if self._grow_in_place(needed):
            return
        for st in self.layers:
            if st.frame is not None:
                if st.index in self.policy:
                    self.policy.remove(st.index)
                self._evict(st)
        self.writeback.drain_writes(self.layers)
        self._unregister_all()
        self.arena.release_all()
        assert self.layout is not None
        self.arena.configure(self.layout, needed, self._headroom(needed), self._outgrown(needed))
        self.policy = self._new_policy()
        self._window = (-1, ())  # the frame count changed: size the prefetch window again
        if self._pq is not None:  # every frame left: hint the window again from here
            self._pq.end_sequence(0)
            self._hinted = -1

    def _grow_in_place(self, needed: int) -> bool:
        """Every layer resident and every frame, larger, still within the budget: copy each
        frame into a larger one on the accelerator; nothing goes through the device, the frame
        count, the policy and the prefetch window stay as they are."""
        if not self._layers_counted or any(st.frame is None for st in self.layers):
            return False
        if not self.arena.grow(needed, self._headroom(needed), len(self.layers)):
            return False
        self.writeback.drain_writes(self.layers)  # writes straight from an old frame land first
        self._unregister_all()  # the old frames' byte views go with them
        for st in self.layers:
            old = cast(Frame, st.frame)
            self.mover.before_compute(old)  # CUDA: the copy waits for a load into it
            st.frame = self.arena.regrown(old)
            self.mover.release(old)
        return True

    def _outgrown(self, needed: int) -> str:
        """``BudgetTooSmall``'s detail when the sequences outgrow the frames after the prefill."""
        assert self.layout is not None
        held = self.layout.max_capacity(self.arena.budget)
        if self.max_seq_len:
            return (f"the sequences grew past max_seq_len={self.max_seq_len} to {needed} tokens, after "
                    f"tokens were produced (the budget holds {held} per sequence); raise max_seq_len to "
                    "the final length to have this found at the prefill, before any token is produced")
        return (f"the sequences grew to {needed} tokens, after tokens were produced (the budget holds "
                f"{held} per sequence): without max_seq_len= only the prompt is checked at the prefill; "
                "pass max_seq_len=<prompt + max_new_tokens> to have this found there, before any token "
                "is produced")

    # ------------------------------------------------------------------------- load
    def _start_load(self, st: _Layer, protected: set[int]) -> bool:
        """Reserve a frame and start reading ``st``'s chunks; False if no frame can be freed."""
        if st.saves:
            self.writeback.advance_saves(st, force=True)
        if st.writes:
            self.writeback.reap_writes(st, block=True)  # a load must see the bytes its own save wrote
        with self.store.batched():  # the victims' write-backs and this read: one DMA submission
            try:
                frame = self._take_frame(protected)
            except NoVictimError:
                return False
            st.frame = frame
            host, cap, token = self.mover.load_image(frame, st.seq_len)
            if not self.mover.cuda:  # the frame itself (on CUDA: a staging buffer, saves register it)
                self._register(host)
            extents, firsts, dups = self.tables.load_plan(st.chunks, cap, st.seq_len)
            transfer = self.store.read(extents, host)
        st.load = _Load(host, cap, token, transfer, extents, firsts, dups, st.seq_len, chunks=st.chunks)
        self._loading.add(st.index)
        self._pending[st.index] = st
        self.counters["loads"] += 1
        self.counters["bytes_loaded"] += sum(e.nbytes for e in extents)
        if dups:
            self.counters["dedup_load_bytes"] += sum(n for _, _, n in dups)
            self._watch_load(st.load)
        return True

    def _register(self, host: np.ndarray) -> None:
        """Let the store keep the descriptors of transfers with ``host`` (a frame or a staging
        buffer, alive until the arena is re-carved or the engine closes)."""
        if id(host) not in self._registered:
            self.store.register(host)
            self._registered[id(host)] = host

    def _unregister_all(self) -> None:
        for host in self._registered.values():
            self.store.unregister(host)
        self._registered.clear()

    def _watch_load(self, ld: _Load) -> None:
        """On CPU the DMA lands in the frame; when sequences share chunks, its completion
        callback (a DMA channel thread) also fills the shared copies, so the compute thread only
        checks a flag. (Without shared copies the compute thread polls the transfer itself:
        no callback, no event, nothing run on the channel thread.)"""
        add = getattr(ld.transfer, "add_done_callback", None)
        if self.mover.cuda or add is None:
            return
        ld.landed = threading.Event()

        def land() -> None:
            try:
                ld.transfer.wait()
                self._fill_dups(ld)
                ld.ok = True
            except BaseException:  # the compute thread sees ok=False: it retries / recovers
                ld.ok = False
            finally:
                ld.landed.set()  # type: ignore[union-attr]

        add(land)

    @staticmethod
    def _fill_dups(ld: _Load) -> None:
        for src, dst, n in ld.dups:
            ld.host[dst:dst + n] = ld.host[src:src + n]

    @staticmethod
    def _load_done(ld: _Load) -> bool:
        return ld.landed.is_set() if ld.landed is not None else ld.transfer.done()

    def _finish_load(self, st: _Layer, stall: bool) -> None:
        ld, frame = st.load, st.frame
        assert ld is not None and frame is not None
        t0 = self.clock.now_ns()
        if ld.landed is not None:
            ld.landed.wait()
        if not ld.ok:
            self.recovery.wait_load(st.index, ld)
            self._fill_dups(ld)
        self.mover.land(frame, ld.token, ld.seq_len)
        st.load = None
        self._loading.discard(st.index)
        if ld.prefetch is not None:
            ld.prefetch.done.fire()  # the prefetch queue: arrived (or, if demanded, late)
        if stall:
            self.counters["stall_ns"] += int(self.clock.now_ns() - t0)

    # ------------------------------------------------------------------------- bookkeeping
    def _poll(self) -> None:
        """Finish whatever completed, without blocking (only layers with something pending)."""
        for st in list(self._pending.values()):
            if st.load is not None and self._load_done(st.load):
                self._finish_load(st, stall=False)
            if st.saves:
                self.writeback.advance_saves(st)
            if st.writes and st.writes[0].transfer.done():  # writes complete in order, mostly
                self.writeback.reap_writes(st, block=False)
            if st.load is None and not st.saves and not st.writes:
                del self._pending[st.index]

    def _drain_loads(self) -> None:
        for st in self.layers:
            if st.load is not None:
                self._finish_load(st, stall=False)

    def close(self) -> None:
        """Wait for every transfer, free every frame, drop every device chunk reference."""
        for st in self.layers:
            if st.load is not None:  # nobody needs these bytes any more: discard, even if it failed
                try:
                    st.load.transfer.wait()
                except (DmaError, PoisonError):
                    pass
                if st.load.landed is not None:
                    st.load.landed.wait()
                if self.mover.cuda:
                    self.staging.put(st.load.token[0])
                if st.load.prefetch is not None:
                    st.load.prefetch.done.fire()
                st.load = None
                self._loading.discard(st.index)
            if st.frame is not None:
                self.mover.release(st.frame)
                self.arena.give(st.frame)
                st.frame = None
        if self._pq is not None:  # what landed and was never used is wasted
            self._pq.end_sequence(0)
            self._sync_prefetch()
            self._pq = None
        self.writeback.drain_writes(self.layers)
        self.writeback.drop_tails(self.layers)
        for st in self.layers:
            ids = st.chunks.ids
            for c in ids[ids >= 0].tolist():
                self.tables.decref(int(c))
            ids[:] = -1
            st.chunks.version += 1
        self.layers.clear()
        self._pending.clear()
        self._unregister_all()
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
