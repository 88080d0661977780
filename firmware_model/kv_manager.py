"""Sequences over the block pool: prefix sharing by chained hashes, forks, copy-on-write.

The API a scheduler calls (vLLM's ``KVCacheManager`` role); :mod:`firmware_model.block_pool` is
the mechanism. Full blocks are hashed and published for reuse; a sequence whose prompt starts with
cached blocks takes references on them instead of new blocks. A block shared by several sequences
(after a fork) is never written in place: appending to it first copies it (copy-on-write), and the
copy is reported in :attr:`KVCacheManager.copies` for the data mover.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from firmware_model.block_pool import (
    BlockHash,
    BlockPool,
    KVBlock,
    NoFreeBlocksError,
    hash_block_tokens,
)

__all__ = ["KVCacheManager", "SequenceState"]


@dataclass
class SequenceState:
    """A sequence's tokens and the blocks holding them (block i holds tokens [i*B, (i+1)*B))."""

    token_ids: list[int] = field(default_factory=list)
    blocks: list[KVBlock] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)  # of its full blocks


class KVCacheManager:
    """Allocates, shares and frees the blocks of sequences on one :class:`BlockPool`."""

    def __init__(self, pool: BlockPool, block_tokens: int) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.pool = pool
        self.block_tokens = block_tokens
        self.seqs: dict[Hashable, SequenceState] = {}
        self.copies: list[tuple[int, int]] = []  # (source block id, destination block id)
        self.prefix_hit_tokens = 0

    def add_sequence(self, seq_id: Hashable, token_ids: Sequence[int]) -> int:
        """Start ``seq_id`` with its prompt; returns how many prompt tokens were cached already."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} already exists; free it first")
        state = SequenceState()
        B = self.block_tokens
        parent: BlockHash | None = None
        hits: list[KVBlock] = []
        for i in range(len(token_ids) // B):
            h = hash_block_tokens(parent, token_ids[i * B:(i + 1) * B])
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
            state.block_hashes.append(h)
            parent = h
        self.pool.touch(hits)
        state.blocks, state.token_ids = list(hits), list(token_ids[:len(hits) * B])
        self.seqs[seq_id] = state
        try:
            self.append_tokens(seq_id, token_ids[len(hits) * B:])
        except NoFreeBlocksError:
            self.free(seq_id)
            raise
        self.prefix_hit_tokens += len(hits) * B
        return len(hits) * B

    def append_tokens(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        """Append tokens, allocating, copying-on-write and publishing full blocks as needed.

        All-or-nothing: if the pool runs out, the tokens appended so far stay (each fits a block)
        and ``NoFreeBlocksError`` tells the scheduler to preempt.
        """
        state = self._state(seq_id)
        for tok in token_ids:
            used = len(state.token_ids) % self.block_tokens
            if used == 0:
                state.blocks.extend(self.pool.get_new_blocks(1))
            elif state.blocks[-1].ref_cnt > 1:
                self._copy_on_write(state)
            state.token_ids.append(int(tok))
            if used + 1 == self.block_tokens:
                self._publish_last_block(state)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """``child_id`` starts as ``parent_id``'s copy, sharing every block (beam search, n > 1)."""
        parent = self._state(parent_id)
        if child_id in self.seqs:
            raise ValueError(f"sequence {child_id!r} already exists")
        self.pool.touch(parent.blocks)
        self.seqs[child_id] = SequenceState(list(parent.token_ids), list(parent.blocks),
                                            list(parent.block_hashes))

    def free(self, seq_id: Hashable) -> None:
        """End ``seq_id``: drop its references, last block first (the least shareable)."""
        state = self.seqs.pop(seq_id, None)
        if state is None:
            raise KeyError(f"no sequence {seq_id!r}")
        self.pool.free_blocks(reversed(state.blocks))

    def _state(self, seq_id: Hashable) -> SequenceState:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise KeyError(f"no sequence {seq_id!r}: add_sequence first") from None

    def _copy_on_write(self, state: SequenceState) -> None:
        shared = state.blocks[-1]
        (fresh,) = self.pool.get_new_blocks(1)
        self.copies.append((shared.block_id, fresh.block_id))
        self.pool.free_blocks([shared])
        state.blocks[-1] = fresh

    def _publish_last_block(self, state: SequenceState) -> None:
        B = self.block_tokens
        i = len(state.blocks) - 1
        parent = state.block_hashes[i - 1] if i else None
        h = hash_block_tokens(parent, state.token_ids[i * B:(i + 1) * B])
        state.block_hashes.append(h)
        own = state.blocks[i]
        holder = self.pool.cache_full_block(own, h)
        if holder is not own:  # identical content already cached: share it, drop our copy
            self.pool.touch([holder])
            self.pool.free_blocks([own])
            state.blocks[i] = holder
