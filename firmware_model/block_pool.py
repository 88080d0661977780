"""The KV block pool, after vLLM v1's ``block_pool`` / ``kv_cache_utils``.

Each block is created once, on first use: a pool of n blocks starts as one sentinel standing for
the n blocks never used yet, at the head of the free queue, in id order (where vLLM's fresh
queue has them), and a block object exists from its first allocation (or first look-up by id) on.
A device of a million 1-KiB chunks then costs nothing until it fills: creating them all up front
took 2 s per KV cache opened on a 1 GiB device. A block with no references sits in an intrusive
doubly-linked free queue with sentinel head and tail (O(1) removal from the middle, no
allocation per operation).
Freed blocks keep their content hash and stay findable for prefix sharing until they are reused:
allocation takes the queue head and, if that block still carries a hash, evicts it from the
cache map then ("lazy eviction"). A pin is a reference held under a lease that expires at a
simulated time (Mooncake uses 10 s leases), so a forgotten pin cannot leak a block forever.

    sentinel head <-> b6 <-> b7 <-> b3 <-> ... <-> sentinel tail
    (next victim)                                  (most recently freed)
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NewType

__all__ = ["BlockHash", "BlockPool", "FreeBlockQueue", "KVBlock", "NoFreeBlocksError", "hash_block_tokens"]

BlockHash = NewType("BlockHash", bytes)


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    """Chained content hash of one full block: parent hash, token ids, extra keys (LoRA, media).

    Two sequences share a block only if every block before it is identical too, which the chain
    guarantees. blake2b over a canonical encoding: stable across processes (unlike ``hash()``).
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(repr((tuple(int(t) for t in token_ids), extra_keys)).encode())
    return BlockHash(h.digest())


@dataclass(eq=False, slots=True)
class KVBlock:
    """One block slot: passive data, manipulated only by the pool."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash.hex()[:8] if self.block_hash else None})"


class NoFreeBlocksError(RuntimeError):
    """The pool cannot supply the blocks asked for; free some (end or preempt a sequence)."""


class FreeBlockQueue:
    """Intrusive doubly-linked list of free blocks between two sentinels.

    ``pending`` blocks not created yet stand, in id order, where a third sentinel sits (created
    by ``make(block_id)`` when they come to the head or are looked up: ``materialize``)."""

    def __init__(self, blocks: Iterable[KVBlock] = (), *, pending: int = 0,
                 make: Callable[[int], KVBlock] | None = None) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-2)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for b in blocks:
            self.append(b)
        self._pending = 0
        self._next_id = 0
        self._make = make
        self._pending_node = KVBlock(-3)
        if pending:
            if make is None:
                raise ValueError("pending blocks need make(block_id)")
            self.append(self._pending_node)
            self._pending = pending
            self.num_free_blocks += pending - 1

    @property
    def created(self) -> int:
        """Blocks ``make`` has created so far (ids 0 .. created-1)."""
        return self._next_id

    def materialize(self, block_id: int) -> None:
        """Create the pending blocks up to ``block_id``, in place (ahead of those still pending)."""
        node = self._pending_node
        while self._pending and self._next_id <= block_id:
            assert self._make is not None
            block = self._make(self._next_id)
            prev = node.prev_free
            assert prev is not None
            prev.next_free, block.prev_free = block, prev
            block.next_free, node.prev_free = node, block
            self._next_id += 1
            self._pending -= 1
        if not self._pending and node.prev_free is not None:
            self._unlink(node)

    def popleft(self) -> KVBlock:
        first = self._head.next_free
        if first is self._pending_node:
            self.materialize(self._next_id)
            first = self._head.next_free
        if first is self._tail or first is None:
            raise NoFreeBlocksError("no free blocks")
        self.remove(first)
        return first

    def _unlink(self, node: KVBlock) -> None:
        prev, nxt = node.prev_free, node.next_free
        assert prev is not None and nxt is not None
        prev.next_free, nxt.prev_free = nxt, prev
        node.prev_free = node.next_free = None

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block!r} is not in the free queue")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"{block!r} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def prepend(self, blocks: Sequence[KVBlock]) -> None:
        """Put ``blocks`` at the head, in the order given (the first is the next victim)."""
        for block in reversed(blocks):
            if block.prev_free is not None or block.next_free is not None:
                raise ValueError(f"{block!r} is already in the free queue")
            first = self._head.next_free
            assert first is not None
            self._head.next_free, block.prev_free = block, self._head
            block.next_free, first.prev_free = first, block
            self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVBlock]:
        """Every free block in queue order (creating the pending ones)."""
        if self._pending:
            self.materialize(self._next_id + self._pending - 1)
        out, cur = [], self._head.next_free
        while cur is not None and cur is not self._tail:
            out.append(cur)
            cur = cur.next_free
        return out


class _Blocks(Sequence[KVBlock]):
    """``pool.blocks``: every block by id, created on first look-up; iteration visits the blocks
    created so far (those never used have no reference and no hash, so skipping them changes no
    count a caller takes)."""

    def __init__(self, num_blocks: int) -> None:
        self._num = num_blocks
        self._made: list[KVBlock] = []
        self._queue = FreeBlockQueue(pending=num_blocks, make=self._make)

    def _make(self, block_id: int) -> KVBlock:
        block = KVBlock(block_id)
        self._made.append(block)
        return block

    def __len__(self) -> int:
        return self._num

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._num))]
        if index < 0:
            index += self._num
        if not 0 <= index < self._num:
            raise IndexError(f"block {index} is outside the pool's {self._num} blocks")
        if index >= len(self._made):
            self._queue.materialize(index)
        return self._made[index]

    def __iter__(self) -> Iterator[KVBlock]:
        return iter(list(self._made))


class BlockPool:
    """Fixed set of blocks; ref counts, prefix cache by chained hash, pins with leases.

    ``uncached_first``: a freed block that holds no hash (a partial last block, one never
    published) goes to the head of the free queue, to be reused before any cached block is evicted,
    as vLLM's block pool does since v0.11 (``free_blocks``: "LIFO reuse of non-cached blocks");
    without it every freed block joins the tail (the earlier v1 behaviour)."""

    def __init__(self, num_blocks: int, *, uncached_first: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self._num_blocks = num_blocks
        self.uncached_first = uncached_first
        self.blocks = _Blocks(num_blocks)
        self.free_block_queue = self.blocks._queue
        self.cached_block_hash_to_block: dict[BlockHash, KVBlock] = {}
        self._leases: dict[int, list[float]] = {}  # block_id -> expiry of each pin
        self.num_evictions = 0

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_num_used_blocks(self) -> int:
        return self.num_blocks - self.get_num_free_blocks()

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` from the free queue head, evicting their cached hashes."""
        if num_blocks > self.get_num_free_blocks():
            raise NoFreeBlocksError(f"asked for {num_blocks} blocks, {self.get_num_free_blocks()} free "
                                    f"of {self.num_blocks}: end or preempt a sequence first")
        out = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._maybe_evict_cached_block(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_block(self, block: KVBlock, block_hash: BlockHash) -> KVBlock:
        """Publish a just-filled block under its hash; returns the block now holding that hash.

        If another block already holds the same content, that one is returned (the caller should
        switch to it and free its copy); a block's hash is assigned only once.
        """
        assert block.block_hash is None, f"{block!r} already has a hash; hashes are assigned once"
        existing = self.cached_block_hash_to_block.get(block_hash)
        if existing is not None:
            return existing
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on each block (a prefix-cache hit); a free one leaves the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each; blocks reaching 0 join the queue tail in the order given
        (with ``uncached_first``, those without a hash join the head instead, in that order).

        Pass a sequence's blocks tail first, so its last blocks (least likely shared) go first.
        """
        first: list[KVBlock] = []
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"{block!r} freed more often than referenced")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if self.uncached_first and block.block_hash is None:
                    first.append(block)
                else:
                    self.free_block_queue.append(block)
        if first:
            self.free_block_queue.prepend(first)

    def pin(self, block: KVBlock, until_ns: float) -> None:
        """Hold ``block`` until ``until_ns`` (or :meth:`unpin`): it cannot be reused or evicted."""
        self.touch([block])
        self._leases.setdefault(block.block_id, []).append(until_ns)

    def unpin(self, block: KVBlock) -> None:
        """Release the pin with the earliest expiry."""
        leases = self._leases.get(block.block_id)
        if not leases:
            raise ValueError(f"{block!r} is not pinned")
        leases.remove(min(leases))
        if not leases:
            del self._leases[block.block_id]
        self.free_blocks([block])

    def is_pinned(self, block: KVBlock) -> bool:
        return bool(self._leases.get(block.block_id))

    def expire_leases(self, now_ns: float) -> int:
        """Release every pin whose lease ended at or before ``now_ns``; returns how many."""
        expired = 0
        for block_id in sorted(self._leases):
            for until in sorted(u for u in self._leases[block_id] if u <= now_ns):
                self.unpin(self.blocks[block_id])
                expired += 1
        return expired

    def _maybe_evict_cached_block(self, block: KVBlock) -> bool:
        if block.block_hash is None:
            return False
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
        self.num_evictions += 1
        return True
