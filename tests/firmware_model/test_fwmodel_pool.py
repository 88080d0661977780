"""Block pool: exact free-queue order, prefix cache by chained hash, deduplication, leases, and a
state machine of holders (sequences, prefix hits, pins) over it."""
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


def _publish(pool: BlockPool, blocks: list[KVBlock], tokens: list[int], block_tokens: int) -> list[object]:
    """Hash and publish each full block of ``tokens`` held in ``blocks`` (the chained hashes)."""
    hashes: list[object] = []
    parent = None
    for i in range(len(tokens) // block_tokens):
        parent = hash_block_tokens(parent, tokens[i * block_tokens:(i + 1) * block_tokens])
        assert pool.cache_full_block(blocks[i], parent) is blocks[i]
        hashes.append(parent)
    return hashes


def test_freed_sequences_queue_tail_first_and_prefix_hits_leave_the_queue() -> None:
    """vLLM's order: a sequence's blocks are freed last-first; a prefix hit takes its block back."""
    pool = BlockPool(10)
    a, b = pool.get_new_blocks(3), pool.get_new_blocks(2)  # blocks 0, 1, 2 and 3, 4
    hashes = _publish(pool, a, list(range(12)), 4)
    _publish(pool, b, [9] * 6, 4)
    pool.free_blocks(reversed(a))
    pool.free_blocks(reversed(b))
    assert _ids(pool) == [5, 6, 7, 8, 9, 2, 1, 0, 4, 3]
    hits = [pool.get_cached_block(h) for h in hashes[:2]]
    assert hits == pool.blocks[:2]
    pool.touch(hits)  # a prompt starting with a's first 8 tokens
    assert [blk.block_id for blk in pool.get_new_blocks(1)] == [5]  # and a new block for the rest
    assert _ids(pool) == [6, 7, 8, 9, 2, 4, 3]


def test_allocation_evicts_cached_hashes_lazily() -> None:
    """A freed block stays findable until the queue hands it out again."""
    pool = BlockPool(2)
    h = hash_block_tokens(None, [1, 2])
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, h)
    pool.free_blocks([block])
    assert pool.get_cached_block(h) is pool.blocks[0]
    assert [blk.block_id for blk in pool.get_new_blocks(2)] == [1, 0]  # block 0's hash is evicted
    assert pool.get_cached_block(h) is None and pool.num_evictions == 1


def test_chained_hash_depends_on_the_whole_prefix() -> None:
    """Same tokens after a different parent block: a different hash."""
    a, b = hash_block_tokens(None, [1, 2]), hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(a, [5, 6]) != hash_block_tokens(b, [5, 6])
    assert hash_block_tokens(a, [5, 6]) == hash_block_tokens(hash_block_tokens(None, [1, 2]), [5, 6])
    assert hash_block_tokens(None, [1, 2], ("lora-1",)) != a


def test_identical_full_blocks_are_deduplicated_on_publish() -> None:
    """A second block filled with cached content is told the holder, and keeps no hash."""
    pool = BlockPool(4)
    first, second = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [1, 2])
    assert pool.cache_full_block(first, h) is first
    assert pool.cache_full_block(second, h) is first and second.block_hash is None
    pool.touch([first])  # the second holder switches to it and frees its copy
    pool.free_blocks([second])
    assert first.ref_cnt == 2 and pool.get_num_free_blocks() == 3


def test_exhaustion_takes_nothing() -> None:
    """Not enough blocks: an error saying what to do, and nothing taken."""
    pool = BlockPool(2)
    with pytest.raises(NoFreeBlocksError, match="end or preempt a sequence"):
        pool.get_new_blocks(3)
    assert pool.get_num_free_blocks() == 2


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
    """Random holders (a sequence's blocks), published hashes, prefix hits, shares, pins and
    lease expiry over a small pool."""

    holders = Bundle("holders")

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(12)
        self.held: dict[int, list[KVBlock]] = {}  # holder id -> its blocks, one reference each
        self.now = 0
        self.pinned_hash: dict[int, object] = {}  # block id -> its hash when pinned
        self.next_id = 0

    def _hold(self, blocks: list[KVBlock]) -> int:
        self.next_id += 1
        self.held[self.next_id] = blocks
        return self.next_id

    @rule(target=holders, n=st.integers(1, 4))
    def allocate(self, n: int):
        try:
            return self._hold(self.pool.get_new_blocks(n))
        except NoFreeBlocksError:
            return multiple()  # nothing taken, nothing to add to the bundle

    @rule(hid=holders, key=st.integers(0, 3))
    def publish(self, hid: int, key: int) -> None:
        """The holder's first unhashed block is full: publish it, switching to a cached twin."""
        blocks = self.held.get(hid, [])
        i = next((i for i, b in enumerate(blocks) if b.block_hash is None), None)
        if i is None:
            return
        holder = self.pool.cache_full_block(blocks[i], hash_block_tokens(None, [key]))
        if holder is not blocks[i]:
            self.pool.touch([holder])
            self.pool.free_blocks([blocks[i]])
            blocks[i] = holder

    @rule(target=holders, key=st.integers(0, 3))
    def prefix_hit(self, key: int):
        block = self.pool.get_cached_block(hash_block_tokens(None, [key]))
        if block is None:
            return multiple()
        self.pool.touch([block])
        return self._hold([block])

    @rule(target=holders, hid=holders)
    def share(self, hid: int):
        if hid not in self.held:
            return multiple()
        self.pool.touch(self.held[hid])
        return self._hold(list(self.held[hid]))

    @rule(hid=consumes(holders))
    def end(self, hid: int) -> None:
        blocks = self.held.pop(hid, None)
        if blocks is not None:
            self.pool.free_blocks(reversed(blocks))

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
        for blocks in self.held.values():
            for b in blocks:
                expected[b.block_id] += 1
        assert [b.ref_cnt for b in self.pool.blocks] == expected
        assert all(c >= 0 for c in expected)

    @invariant()
    def pinned_blocks_are_never_evicted(self) -> None:
        for block_id, h in self.pinned_hash.items():
            block = self.pool.blocks[block_id]
            assert block.ref_cnt >= 1 and (h is None or block.block_hash == h)  # published since: fine

    @invariant()
    def cache_map_is_consistent(self) -> None:
        for h, b in self.pool.cached_block_hash_to_block.items():
            assert b.block_hash == h

    def teardown(self) -> None:
        for hid in list(self.held):
            self.pool.free_blocks(reversed(self.held.pop(hid)))
        self.pool.expire_leases(float("inf"))
        assert self.pool.get_num_free_blocks() == 12
        assert all(b.ref_cnt == 0 for b in self.pool.blocks)


PoolMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
test_pool_state_machine = PoolMachine.TestCase


def test_a_large_pool_creates_blocks_only_as_they_are_used() -> None:
    """A million-block pool costs nothing up front; blocks come out in id order, a look-up by id
    creates the blocks up to it in place, and freed blocks queue behind the never-used ones."""
    pool = BlockPool(1 << 20)
    assert pool.get_num_free_blocks() == 1 << 20 and pool.free_block_queue.created == 0
    a = pool.get_new_blocks(3)
    assert [b.block_id for b in a] == [0, 1, 2] and pool.free_block_queue.created == 3
    assert pool.blocks[5].block_id == 5 and pool.free_block_queue.created == 6
    pool.free_blocks([a[1]])
    assert [b.block_id for b in pool.get_new_blocks(4)] == [3, 4, 5, 6]
    assert pool.get_num_free_blocks() == (1 << 20) - 6
    assert [b.block_id for b in pool.blocks] == list(range(7))  # iteration: the blocks created
    small = BlockPool(4)
    small.get_new_blocks(1)[0]
    small.free_blocks([small.blocks[0]])
    assert _ids(small) == [1, 2, 3, 0]


def test_uncached_blocks_are_reused_first_when_asked():
    """vLLM >= 0.11: freed blocks without a hash go to the head, cached ones to the tail."""
    pool = BlockPool(6, uncached_first=True)
    a = pool.get_new_blocks(3)
    pool.cache_full_block(a[0], hash_block_tokens(None, [1, 2]))
    pool.cache_full_block(a[1], hash_block_tokens(a[0].block_hash, [3, 4]))
    pool.free_blocks(reversed(a))  # a[2] holds no hash: the next to be reused
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == [2, 3, 4, 5, 1, 0]
    assert pool.get_new_blocks(1)[0].block_id == 2
    assert pool.get_cached_block(a[0].block_hash) is a[0]
    plain = BlockPool(6)
    b = plain.get_new_blocks(3)
    plain.cache_full_block(b[0], hash_block_tokens(None, [1, 2]))
    plain.free_blocks(reversed(b))
    assert [x.block_id for x in plain.free_block_queue.get_all_free_blocks()] == [3, 4, 5, 2, 1, 0]
