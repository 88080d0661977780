"""Block pool and KV manager: exact free-queue order, prefix sharing, COW, leases, and a state machine."""
from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    rule,
)

from firmware_model.block_pool import (
    BlockPool,
    FreeBlockQueue,
    KVBlock,
    NoFreeBlocksError,
    hash_block_tokens,
)
from firmware_model.kv_manager import KVCacheManager


def _ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def test_free_queue_removes_from_the_middle_and_appends_at_the_tail() -> None:
    """The intrusive list keeps order across popleft / remove / append."""
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.popleft() is blocks[0]
    q.remove(blocks[2])
    q.append(blocks[0])
    assert [b.block_id for b in q.get_all_free_blocks()] == [1, 3, 4, 0]
    assert q.num_free_blocks == 4
    with pytest.raises(ValueError, match="already in the free queue"):
        q.append(blocks[1])
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(blocks[2])


def test_freed_sequences_queue_tail_first_and_prefix_hits_leave_the_queue() -> None:
    """vLLM's order: a sequence's blocks are freed last-first; a prefix hit takes its block back."""
    pool = BlockPool(10)
    m = KVCacheManager(pool, block_tokens=4)
    assert m.add_sequence("a", list(range(12))) == 0  # blocks 0, 1, 2 (all full)
    assert m.add_sequence("b", [9] * 6) == 0  # blocks 3, 4
    m.free("a")
    m.free("b")
    assert _ids(pool) == [5, 6, 7, 8, 9, 2, 1, 0, 4, 3]
    assert m.add_sequence("c", list(range(8)) + [7]) == 8  # blocks 0 and 1 by hash, new one for the rest
    assert _ids(pool) == [6, 7, 8, 9, 2, 4, 3]
    assert [b.block_id for b in m.seqs["c"].blocks] == [0, 1, 5]


def test_allocation_evicts_cached_hashes_lazily() -> None:
    """A freed block stays findable until the queue hands it out again."""
    pool = BlockPool(2)
    m = KVCacheManager(pool, block_tokens=2)
    m.add_sequence("a", [1, 2])
    h = hash_block_tokens(None, [1, 2])
    m.free("a")
    assert pool.get_cached_block(h) is pool.blocks[0]
    m.add_sequence("b", [3, 4, 5, 6])  # takes blocks 1 then 0: block 0's hash is evicted
    assert pool.get_cached_block(h) is None and pool.num_evictions == 1


def test_chained_hash_depends_on_the_whole_prefix() -> None:
    """Same tokens after a different parent block: a different hash."""
    a, b = hash_block_tokens(None, [1, 2]), hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(a, [5, 6]) != hash_block_tokens(b, [5, 6])
    assert hash_block_tokens(a, [5, 6]) == hash_block_tokens(hash_block_tokens(None, [1, 2]), [5, 6])
    assert hash_block_tokens(None, [1, 2], ("lora-1",)) != a


def test_fork_then_append_copies_the_shared_partial_block() -> None:
    """Copy-on-write: the child gets a fresh last block, the parent keeps its own."""
    pool = BlockPool(6)
    m = KVCacheManager(pool, block_tokens=4)
    m.add_sequence("p", [1, 2, 3, 4, 5])  # blocks 0 (full), 1 (1 token)
    m.fork("p", "c")
    assert [b.ref_cnt for b in pool.blocks[:2]] == [2, 2]
    m.append_tokens("c", [6])
    assert m.copies == [(1, 2)]
    assert [b.block_id for b in m.seqs["c"].blocks] == [0, 2]
    assert [b.ref_cnt for b in pool.blocks[:3]] == [2, 1, 1]
    m.append_tokens("p", [7])  # the parent's block is no longer shared: written in place
    assert m.copies == [(1, 2)]


def test_identical_full_blocks_are_deduplicated_on_publish() -> None:
    """Two sequences filling the same content end up on one block."""
    pool = BlockPool(4)
    m = KVCacheManager(pool, block_tokens=2)
    m.add_sequence("a", [1])
    m.add_sequence("b", [1])
    m.append_tokens("a", [2])
    m.append_tokens("b", [2])
    assert m.seqs["a"].blocks[0] is m.seqs["b"].blocks[0] is pool.blocks[0]
    assert pool.get_num_free_blocks() == 3


def test_exhaustion_rolls_back_a_new_sequence() -> None:
    """Not enough blocks for a prompt: error saying what to do, and nothing held."""
    pool = BlockPool(2)
    m = KVCacheManager(pool, block_tokens=2)
    with pytest.raises(NoFreeBlocksError, match="end or preempt a sequence"):
        m.add_sequence("a", [1, 2, 3, 4, 5])
    assert pool.get_num_free_blocks() == 2 and "a" not in m.seqs


def test_pins_hold_blocks_until_their_lease_ends() -> None:
    """A pinned block is not handed out; at expiry it returns to the queue."""
    pool = BlockPool(3)
    pool.pin(pool.blocks[0], until_ns=1000)
    pool.pin(pool.blocks[0], until_ns=3000)
    assert [b.block_id for b in pool.get_new_blocks(2)] == [1, 2]
    with pytest.raises(NoFreeBlocksError):
        pool.get_new_blocks(1)
    assert pool.expire_leases(999) == 0
    assert pool.expire_leases(1000) == 1 and pool.blocks[0].ref_cnt == 1
    assert pool.expire_leases(5000) == 1 and _ids(pool) == [0]
    with pytest.raises(ValueError, match="not pinned"):
        pool.unpin(pool.blocks[0])


def test_double_free_is_refused() -> None:
    """Counts never go negative."""
    pool = BlockPool(1)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(ValueError, match="freed more often than referenced"):
        pool.free_blocks([b])


class PoolMachine(RuleBasedStateMachine):
    """Random sequences, forks, appends, pins and lease expiry over a small pool."""

    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(12)
        self.m = KVCacheManager(self.pool, block_tokens=2)
        self.now = 0
        self.pinned_hash: dict[int, object] = {}  # block id -> its hash when pinned
        self.next_id = 0

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    @rule(target=seqs, tokens=st.lists(st.integers(0, 2), min_size=1, max_size=7))
    def add(self, tokens: list[int]):
        sid = self._new_id()
        try:
            self.m.add_sequence(sid, tokens)
        except NoFreeBlocksError:
            return multiple()  # nothing allocated, nothing to add to the bundle
        return sid

    @rule(sid=seqs, tokens=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def append(self, sid, tokens: list[int]) -> None:
        if sid in self.m.seqs:
            try:
                self.m.append_tokens(sid, tokens)
            except NoFreeBlocksError:
                pass

    @rule(target=seqs, sid=seqs)
    def fork(self, sid):
        if sid not in self.m.seqs:
            return sid
        child = self._new_id()
        self.m.fork(sid, child)
        return child

    @rule(sid=consumes(seqs))
    def end(self, sid) -> None:
        if sid in self.m.seqs:
            self.m.free(sid)

    @rule(index=st.integers(0, 11), lease=st.integers(1, 50))
    def pin(self, index: int, lease: int) -> None:
        block = self.pool.blocks[index]
        if block.ref_cnt > 0 or block.block_hash is not None:
            self.pool.pin(block, self.now + lease)
            self.pinned_hash[block.block_id] = block.block_hash

    @rule(dt=st.integers(0, 30))
    def advance(self, dt: int) -> None:
        self.now += dt
        self.pool.expire_leases(self.now)
        self.pinned_hash = {i: h for i, h in self.pinned_hash.items() if self.pool.is_pinned(self.pool.blocks[i])}

    @invariant()
    def free_plus_used_is_total(self) -> None:
        free = self.pool.free_block_queue.get_all_free_blocks()
        assert len(free) == self.pool.get_num_free_blocks()
        assert self.pool.get_num_free_blocks() + self.pool.get_num_used_blocks() == 12
        assert {b.block_id for b in free} == {b.block_id for b in self.pool.blocks if b.ref_cnt == 0}

    @invariant()
    def counts_match_holders(self) -> None:
        expected = [len(self.pool._leases.get(b.block_id, [])) for b in self.pool.blocks]
        for state in self.m.seqs.values():
            for b in state.blocks:
                expected[b.block_id] += 1
        assert [b.ref_cnt for b in self.pool.blocks] == expected
        assert all(c >= 0 for c in expected)

    @invariant()
    def pinned_blocks_are_never_evicted(self) -> None:
        for block_id, h in self.pinned_hash.items():
            block = self.pool.blocks[block_id]
            assert block.ref_cnt >= 1 and block.block_hash == h

    @invariant()
    def cache_map_is_consistent(self) -> None:
        for h, b in self.pool.cached_block_hash_to_block.items():
            assert b.block_hash == h

    def teardown(self) -> None:
        for sid in list(self.m.seqs):
            self.m.free(sid)
        self.pool.expire_leases(float("inf"))
        assert self.pool.get_num_free_blocks() == 12
        assert all(b.ref_cnt == 0 for b in self.pool.blocks)


PoolMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
test_pool_state_machine = PoolMachine.TestCase
