"""KV chunks stored compressed: the controller's codec (``firmware_model.kv_codec``) at the store seam.

``CompressedStore`` wraps any :class:`~driver.kv._store.BlockStore`. The engine above it sees
native chunks (``chunk_bytes`` of one piece: ``block_tokens`` tokens of one head's K or V); the
store below holds and moves *encoded* chunks (``PieceCodec.encoded_bytes`` each), so::

    engine ── native extents ──► CompressedStore ── encoded extents ──► DeviceBlockStore ──► link
                                  encode on write          (the timed DMA moves the encoded
                                  decode on read            bytes: link time and media use are
                                                            the compressed sizes)

The codec is the controller's logic; in this emulation it runs at the store's end of the link
(writes encoded before they are issued, reads decoded on the DMA channel's thread as they
complete, overlapping compute as a device would), and the link carries the encoded bytes. The
pool's chunk count is the region over the *encoded* size, so the same device holds
``native / encoded`` times more tokens. Which chunks hold values is the pool's ``values`` map,
set by the chunk tables when they place a block (int4 quantizes keys and values differently).

A write extent's last chunk may be partial (``nbytes`` not a whole chunk: the valid tokens of a
block); it is encoded with those tokens only, and moves as the valid tokens' records where the
format keeps a token's bytes together (int8), else whole (int4: a key block is one group).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from driver.kv._chunks import ChunkPool
from driver.kv._store import BlockStore, Extent, Transfer
from emulator.spec.errors import ConfigError
from firmware_model.kv_codec import FORMATS, PieceCodec

__all__ = ["CompressedStore", "check_kv_format", "compressed"]


class _DecodingRead:
    """A read of encoded chunks that decodes them into the caller's buffer once they landed:
    on the DMA channel's thread when the inner transfer offers a completion callback (armed when
    its batch is submitted), else in :meth:`wait`."""

    def __init__(self, inner: Transfer, decode: Callable[[], None]) -> None:
        self._inner = inner
        self._decode = decode
        self._lock = threading.Lock()
        self._decoded = False
        self._settled = threading.Event()  # decoded, or the transfer failed
        self._callbacks: list[Callable[[], None]] = []
        self._armed = False

    def arm(self) -> None:
        add = getattr(self._inner, "add_done_callback", None)
        if add is not None:
            self._armed = True
            add(self._landed)

    def _landed(self) -> None:
        try:
            self._inner.wait()
            self._finish()
        except BaseException:  # wait() raises it again on the caller's thread
            pass
        with self._lock:
            self._settled.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()

    def _finish(self) -> None:
        with self._lock:
            if not self._decoded:
                self._decode()
                self._decoded = True

    def done(self) -> bool:
        return self._settled.is_set() if self._armed else self._inner.done()

    def wait(self) -> None:
        self._inner.wait()  # a failed transfer raises its DmaError / PoisonError here
        self._finish()

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """``fn()`` once the chunks are decoded or the transfer failed; with an inner transfer
        that has no callbacks, now (``fn`` then waits itself)."""
        with self._lock:
            if self._armed and not self._settled.is_set():
                self._callbacks.append(fn)
                return
        fn()


class _Pending(threading.local):
    depth = 0

    def __init__(self) -> None:
        self.reads: list[_DecodingRead] = []


class CompressedStore:
    """A :class:`BlockStore` of native chunks kept as ``codec``'s encoded chunks in ``inner``."""

    def __init__(self, inner: BlockStore, codec: PieceCodec) -> None:
        if codec.fmt == "native":
            raise ConfigError("CompressedStore needs a compressed kv_format ('int8' or 'int4'); "
                              "'native' uses the store as it is")
        self.inner = inner
        self.codec = codec
        self.chunk_bytes = 0
        self._pending = _Pending()
        #: bytes the engine asked for (native) and bytes the link moved (encoded), each way
        self.counters = dict.fromkeys(("native_bytes_read", "native_bytes_written", "link_bytes_read",
                                       "link_bytes_written"), 0)

    @property
    def capacity_chunks(self) -> int:
        return self.inner.capacity_chunks

    @property
    def pool(self) -> ChunkPool | None:
        return self.inner.pool

    @property
    def stored_chunk_bytes(self) -> int:
        """Bytes one chunk takes on the device (and on the link)."""
        return self.codec.encoded_bytes

    def __getattr__(self, name: str) -> Any:
        # the device store's ``timing`` (the link the prefetch window is sized for) and
        # ``telemetry``; a memory store has neither
        if name in ("timing", "telemetry"):
            return getattr(self.__dict__["inner"], name, None)
        raise AttributeError(name)

    def configure(self, chunk_bytes: int) -> None:
        if chunk_bytes != self.codec.native_bytes:
            raise ConfigError(f"the KV's chunks are {chunk_bytes} bytes, the codec's pieces "
                              f"{self.codec.native_bytes} ({self.codec.tokens} tokens x {self.codec.head_dim} "
                              f"{self.codec.elem}): build the codec for this model's shape")
        self.inner.configure(self.codec.encoded_bytes)
        self.chunk_bytes = chunk_bytes

    def _spans(self, extents: Sequence[Extent]) -> tuple[list[Extent], list[tuple[int, int, int]]]:
        """The encoded extents (rows of one staging buffer) and, per extent, its first encoded
        row, chunk count and the valid tokens of its last chunk. A partial last chunk moves only
        its valid tokens' bytes where the format has them first (int8), else whole (int4)."""
        cb, ecb, codec = self.chunk_bytes, self.codec.encoded_bytes, self.codec
        token = cb // codec.tokens
        out, rows, row = [], [], 0
        for e in extents:
            k = -(-e.nbytes // cb)
            valid = (e.nbytes - (k - 1) * cb) // token
            last = codec.prefix_bytes(valid) if valid < codec.tokens else None
            out.append(Extent(e.chunk, (k - 1) * ecb + (ecb if last is None else last), row * ecb))
            rows.append((row, k, valid))
            row += k
        return out, rows

    def write(self, extents: Sequence[Extent], host: np.ndarray) -> Transfer:
        enc_extents, rows = self._spans(extents)
        n = sum(k for _, k, _ in rows)
        cb, codec = self.chunk_bytes, self.codec
        raw = np.empty((n, cb), np.uint8)
        chunks = np.empty(n, np.int64)
        for e, (row, k, _) in zip(extents, rows, strict=True):
            raw.reshape(-1)[row * cb:row * cb + e.nbytes] = host[e.host_offset:e.host_offset + e.nbytes]
            chunks[row:row + k] = np.arange(e.chunk, e.chunk + k)
        pool = self.pool
        assert pool is not None
        values = pool.values[chunks]
        # rows by the valid tokens of their block (a partial block's rest is not KV): the tail
        # blocks of one save share one count, so a write is one or two encode calls
        valid = np.full(n, codec.tokens)
        for row, k, v in rows:
            valid[row + k - 1] = v
        staging = np.empty((n, codec.encoded_bytes), np.uint8)
        for v in np.unique(valid).tolist():
            sel = valid == v
            staging[sel] = codec.encode(raw[sel], values[sel], v)
        self.counters["native_bytes_written"] += sum(e.nbytes for e in extents)
        self.counters["link_bytes_written"] += sum(e.nbytes for e in enc_extents)
        return self.inner.write(enc_extents, staging.reshape(-1))

    def read(self, extents: Sequence[Extent], host: np.ndarray) -> Transfer:
        enc_extents, rows = self._spans(extents)
        n = sum(k for _, k, _ in rows)
        codec, cb = self.codec, self.chunk_bytes
        staging = np.empty((n, codec.encoded_bytes), np.uint8)

        def decode() -> None:  # whole chunks straight into the caller's buffer; a partial one via a copy
            for i, (e, (row, _, _)) in enumerate(zip(extents, rows, strict=True)):
                whole, rest = divmod(e.nbytes, cb)
                at = e.host_offset
                if whole:
                    codec.decode_into(staging[row:row + whole], host[at:at + whole * cb].reshape(whole, cb))
                if rest:  # what the read left of this row is not this chunk's: zeros, not garbage
                    moved = enc_extents[i].nbytes - whole * codec.encoded_bytes
                    staging[row + whole, moved:] = 0
                    part = codec.decode(staging[row + whole:row + whole + 1]).reshape(-1)
                    host[at + whole * cb:at + e.nbytes] = part[:rest]

        self.counters["native_bytes_read"] += sum(e.nbytes for e in extents)
        self.counters["link_bytes_read"] += sum(e.nbytes for e in enc_extents)
        transfer = _DecodingRead(self.inner.read(enc_extents, staging.reshape(-1)), decode)
        if self._pending.depth:
            self._pending.reads.append(transfer)  # its handle exists once the batch is submitted
        else:
            transfer.arm()
        return transfer

    def register(self, host: np.ndarray) -> None:
        """Nothing to keep: the DMA moves this store's own staging buffers, not ``host``."""

    def unregister(self, host: np.ndarray) -> None:
        """See :meth:`register`."""

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        pending = self._pending
        pending.depth += 1
        try:
            with self.inner.batched():
                yield
        finally:
            pending.depth -= 1
            if not pending.depth:
                reads, pending.reads = pending.reads, []
                for t in reads:
                    t.arm()

    def scrub(self, chunk: int) -> int:
        return self.inner.scrub(chunk)

    def close(self) -> None:
        self.inner.close()


_ELEMENTS = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}


def check_kv_format(kv_format: object, prefix_sharing: bool) -> None:
    """``ConfigError`` naming the allowed formats, or the setting ``kv_format`` cannot go with."""
    if kv_format not in FORMATS:
        raise ConfigError(f"kv_format must be one of {', '.join(map(repr, FORMATS))} (native: the KV's own "
                          f"bytes; int8: per-token int8; int4: KIVI-style 4-bit), got {kv_format!r}")
    if kv_format == "int4" and not prefix_sharing:
        raise ConfigError("kv_format='int4' quantizes a full key block per channel across its tokens, so it "
                          "must know a partial block's valid tokens, which only the prefix-sharing save path "
                          "writes (prefix_sharing=False writes tail blocks whole): keep prefix_sharing=True "
                          "or use kv_format='int8'")


def compressed(store: BlockStore, kv_format: str, *, block_tokens: int, head_dim: int, dtype: object) -> BlockStore:
    """``store`` itself for ``"native"``, else a :class:`CompressedStore` over it for pieces of
    ``block_tokens`` x ``head_dim`` elements of ``dtype`` (a torch dtype)."""
    if kv_format == "native":
        return store
    name = str(dtype).removeprefix("torch.")
    if name not in _ELEMENTS:
        raise ConfigError(f"kv_format={kv_format!r} encodes float16, bfloat16 or float32 KV; this model's "
                          f"is {name}: use kv_format='native'")
    return CompressedStore(store, PieceCodec(kv_format, block_tokens, head_dim, _ELEMENTS[name]))


def link_stats(engine: Any) -> dict[str, int]:
    """What the link and the device carried for ``engine`` (a ``ResidencyEngine``, or hot
    attention's engine, whose chunk pool is its store's): bytes each way as moved (encoded when
    compressed) and the device bytes its chunks take; nothing for an engine without a store (H2O)."""
    store = getattr(engine, "store", None)
    if store is None:
        return {}
    c = engine.counters
    pool = getattr(engine, "pool", None) or getattr(store, "pool", None)
    if isinstance(store, CompressedStore):
        return {"link_bytes_loaded": store.counters["link_bytes_read"],
                "link_bytes_offloaded": store.counters["link_bytes_written"],
                "device_chunk_bytes": store.stored_chunk_bytes,
                "device_bytes_used": (pool.used if pool else 0) * store.stored_chunk_bytes}
    layout = getattr(engine, "layout", None)
    chunk = layout.chunk_bytes if layout is not None else 0
    return {"link_bytes_loaded": c["bytes_loaded"], "link_bytes_offloaded": c.get("bytes_offloaded", 0),
            "device_chunk_bytes": chunk, "device_bytes_used": (pool.used if pool else 0) * chunk}
