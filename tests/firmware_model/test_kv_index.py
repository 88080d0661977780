"""The KV index's pure logic (firmware_model/kv_index.py) on a bytearray: the layout byte by byte,
the entry state machine, probing with tombstones, pins against eviction, reaping a host."""
from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from firmware_model import kv_index as K
from firmware_model.kv_census import HostCensus, census

SLOT = 256
TOTAL = 64 * 1024


def _cas_over(buf: bytearray) -> K.Cas:
    words = np.frombuffer(buf, dtype=np.uint64)

    def cas(i: int, expect: int, value: int) -> bool:
        if int(words[i]) != expect:
            return False
        words[i] = value
        return True
    return cas


def _index(total: int = TOTAL, hosts: int = 2, quota: int = 0) -> tuple[bytearray, K.KvIndex]:
    buf = bytearray(total)
    return buf, K.KvIndex.format(buf, _cas_over(buf), base_dpa=0x1000_0000, slot_bytes=SLOT, hosts=hosts, quota=quota)


def _key(n: int, fp: bytes = bytes(16)) -> bytes:
    return fp + n.to_bytes(8, "little") + bytes(24)  # home slot n (fingerprint 0)


def test_layout_exact_bytes() -> None:
    buf, idx = _index()
    slots, data = K.layout_slots(TOTAL, SLOT)
    assert (slots, data) == (149, 24576)  # (64 KiB - 8 KiB) // (128 + 256); the table ends in page 6
    assert buf[0:8] == b"CXLKVIX1"
    assert struct.unpack_from("<9Q", buf, 8) == (1, 149, 256, 4096, 24576, TOTAL, 0x1000_0000, 32, 2)
    quota = 149 * 256 // 2
    assert struct.unpack_from("<8Q", buf, 512) == (0, 0, 0, quota, 0, 0, 0, 0)
    assert struct.unpack_from("<8Q", buf, 576)[3] == quota and buf[640:4096] == bytes(3456)
    assert idx.block_dpa(3) == 0x1000_0000 + 24576 + 3 * 256


def test_entry_bytes_after_publish() -> None:
    buf, idx = _index()
    key = _key(5)
    status, slot, alloc = idx.reserve(key, host=1, gen=7)
    assert (status, slot, alloc) == ("ok", 5, K.entry_word(K.ALLOC, 1, 7, 1))
    assert struct.unpack_from("<Q", buf, 4096 + 5 * 128)[0] == 0x01_0000_0007_1_1
    idx.fill(slot, key, 200, 0xDEADBEEF)
    sealed = idx.seal(slot, alloc)
    assert sealed == K.entry_word(K.SEALED, 1, 7, 1)
    off = 4096 + 5 * 128
    assert struct.unpack_from("<2Q", buf, off) == (sealed, 0)
    assert buf[off + 16:off + 64] == key
    assert struct.unpack_from("<5Q", buf, off + 64) == (idx.block_dpa(5), 200, 0xDEADBEEF, 0, 0)


def test_fingerprint_digest_and_difference() -> None:
    a = K.Fingerprint("llama", "bfloat16", 16, 2, 4, 64)
    assert a.digest == K.Fingerprint("llama", "bfloat16", 16, 2, 4, 64, 0).digest and len(a.digest) == 16
    assert a.digest != K.Fingerprint("llama", "bfloat16", 16, 2, 4, 64, tp_rank=1).digest
    assert a.digest != K.Fingerprint("qwen", "bfloat16", 16, 2, 4, 64).digest


def test_probe_skips_tombstones_and_stops_at_free() -> None:
    _, idx = _index()
    k5, k5b, k5c = _key(5), _key(5, b"\0" * 8 + b"\1" + b"\0" * 7), _key(5, b"\0" * 8 + b"\2" + b"\0" * 7)
    slots = []
    for k in (k5, k5b, k5c):
        _, s, a = idx.reserve(k, 0, 1)
        idx.fill(s, k, 64, 1)
        idx.seal(s, a)
        slots.append(s)
    assert slots == [5, 6, 7]  # one home, linear probing
    assert idx.try_evict(6, idx.word(6))
    assert K.kind_of(idx.word(6)) == K.TOMB
    assert idx.lookup(k5c) == (7, idx.word(7))  # found past the tombstone
    assert idx.lookup(k5b) is None
    status, s, _ = idx.reserve(k5b, 1, 1)
    assert (status, s) == ("ok", 6)  # the tombstone is reused
    assert idx.reserve(k5c, 1, 1)[0] == "present"


def test_full_window() -> None:
    _, idx = _index()
    for i in range(K.MAX_PROBE):
        fp = i.to_bytes(8, "little") * 2
        key = fp + (5 ^ i).to_bytes(8, "little") + bytes(24)  # every one homes at slot 5
        assert idx.reserve(key, 0, 1)[0] == "ok"
    late = (99).to_bytes(8, "little") * 2 + (5 ^ 99).to_bytes(8, "little") + bytes(24)
    assert idx.home(late) % idx.slots == 5 and idx.reserve(late, 0, 1) == ("full", -1, 0)


def test_pin_blocks_eviction_and_unpin_allows_it() -> None:
    _, idx = _index()
    _, s, a = idx.reserve(_key(9), 0, 1)
    idx.fill(s, _key(9), 64, 3)
    sealed = idx.seal(s, a)
    assert idx.pin(s, sealed, host=1)
    assert idx.word(s, K.E_PINS) == 1 << 8
    assert not idx.try_evict(s, sealed) and idx.word(s) == sealed  # back to SEALED
    assert idx.unpin(s, 1) and idx.try_evict(s, sealed)
    assert not idx.pin(s, sealed, 1) and idx.word(s, K.E_PINS) == 0  # a dead word pins nothing


def test_pin_on_evicting_fails_and_leaves_no_pin() -> None:
    _, idx = _index()
    _, s, a = idx.reserve(_key(2), 0, 1)
    sealed = idx.seal(s, a)
    assert idx.cas(idx._ew(s, K.E_STATE), sealed, (sealed & ~0xF) | K.EVICTING)
    assert not idx.pin(s, sealed, 0) and idx.word(s, K.E_PINS) == 0


def test_seal_fails_after_reap_and_abort_leaves_tomb() -> None:
    _, idx = _index()
    _, s, a = idx.reserve(_key(3), 1, 4)
    _, s2, a2 = idx.reserve(_key(4), 1, 5)
    assert idx.reap(1, keep_gen=5) == (1, 0)  # the older generation's allocation only
    assert idx.seal(s, a) is None and K.kind_of(idx.word(s)) == K.TOMB
    assert idx.abort(s2, a2) and K.kind_of(idx.word(s2)) == K.TOMB


def test_reap_clears_the_pin_byte_of_that_host_only() -> None:
    _, idx = _index()
    pinned = []
    for n in (10, 11):
        _, s, a = idx.reserve(_key(n), 0, 1)
        sealed = idx.seal(s, a)
        assert idx.pin(s, sealed, 1) and idx.pin(s, sealed, 1) and idx.pin(s, sealed, 0)
        pinned.append(s)
    assert idx.reap(1) == (0, 2)
    assert [idx.word(s, K.E_PINS) for s in pinned] == [1, 1]


def test_touch_and_readers() -> None:
    _, idx = _index()
    _, s, a = idx.reserve(_key(1), 0, 1)
    idx.fill(s, _key(1), 64, 0)
    idx.seal(s, a)
    idx.touch(s, 1, 50)
    idx.touch(s, 0, 40)
    assert (idx.word(s, K.E_LAST_USE), idx.word(s, K.E_READERS)) == (50, 0b11)


def test_format_refusals() -> None:
    with pytest.raises(ValueError, match="at least 32"):
        K.layout_slots(16 * 1024, 4096)
    with pytest.raises(K.IndexFormatError, match="no KV index"):
        K.KvIndex(bytearray(8192), _cas_over(bytearray(8192)))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["pin", "unpin", "evict"]), st.integers(0, 1)), max_size=30))
def test_interleavings_never_evict_a_pinned_entry(ops: list[tuple[str, int]]) -> None:
    """Any order of two hosts' pins and unpins and the firmware's evictions: an entry with pins
    is never gone, and a pin only succeeds on the live word."""
    _, idx = _index()
    _, s, a = idx.reserve(_key(7), 0, 1)
    sealed = idx.seal(s, a)
    held = [0, 0]
    for op, host in ops:
        if op == "pin" and idx.pin(s, sealed, host):
            held[host] += 1
        elif op == "unpin" and held[host]:
            assert idx.unpin(s, host)
            held[host] -= 1
        elif op == "evict":
            gone = idx.try_evict(s, sealed)
            assert not (gone and any(held))
        alive = idx.word(s) == sealed
        assert alive or not any(held)
        assert idx.word(s, K.E_PINS) == held[0] | held[1] << 8


_OPS = st.lists(st.tuples(st.sampled_from(["reserve", "reserve", "seal", "seal", "abort", "pin", "unpin", "evict",
                                           "reap", "sweep"]),
                          st.integers(0, 1), st.integers(0, 5)), max_size=60)


@settings(max_examples=100, deadline=None)
@given(_OPS)
@example([("reserve", 0, 0), ("seal", 0, 0), ("reserve", 0, 1), ("seal", 0, 0), ("evict", 0, 0), ("sweep", 0, 0)])
def test_any_sequence_keeps_the_invariants(ops: list[tuple[str, int, int]]) -> None:
    """Two hosts publishing, pinning and unpinning six keys that share one home, the firmware
    evicting, reaping and sweeping, in any order: a lookup finds only a SEALED entry of its own key
    and finds every one, every key is in at most one SEALED entry, no ALLOC outlives its publisher,
    pins equal what is held."""
    _, idx = _index()
    keys = [bytes([n + 1]) + bytes(7) + bytes(8) + (n + 1).to_bytes(8, "little") + bytes(24) for n in range(6)]
    allocs: dict[int, tuple[int, int, int]] = {}  # slot -> (host, key, alloc word)
    held: dict[tuple[int, int], int] = {}  # (slot, host) -> pins
    for op, host, k in ops:
        if op == "reserve":
            status, slot, alloc = idx.reserve(keys[k], host, 1)
            if status == "ok":
                idx.fill(slot, keys[k], 64, k)
                allocs[slot] = (host, k, alloc)
        elif op in ("seal", "abort") and allocs:
            slot = sorted(allocs)[k % len(allocs)]
            _, _, alloc = allocs.pop(slot)
            assert (idx.seal(slot, alloc) is not None) if op == "seal" else idx.abort(slot, alloc)
        elif op == "pin":
            found = idx.lookup(keys[k])
            if found and idx.pin(found[0], found[1], host):
                held[found[0], host] = held.get((found[0], host), 0) + 1
        elif op == "unpin":
            mine = sorted(s for (s, h), n in held.items() if h == host and n)
            if mine:
                slot = mine[k % len(mine)]
                assert idx.unpin(slot, host)
                held[slot, host] -= 1
        elif op == "evict":
            slot = (idx.home(keys[k]) + k) % idx.slots
            word = idx.word(slot)
            if K.kind_of(word) == K.SEALED:
                gone = idx.try_evict(slot, word)
                assert not (gone and any(n for (s, _), n in held.items() if s == slot))
        elif op == "sweep":
            idx.sweep()
        elif op == "reap":  # host died: the firmware drops its allocations and pins
            idx.reap(host)
            allocs = {s: a for s, a in allocs.items() if a[0] != host}
            held = {key: n for key, n in held.items() if key[1] != host}
        sealed = [s for s in range(idx.slots) if K.kind_of(idx.word(s)) == K.SEALED]
        assert len({idx.key_of(s) for s in sealed}) == len(sealed)  # one sealed entry per key
        assert all(idx.lookup(idx.key_of(s)) == (s, idx.word(s)) for s in sealed)  # none hidden by a sweep
        for n, key in enumerate(keys):
            found = idx.lookup(key)
            assert found is None or (idx.key_of(found[0]) == key and K.kind_of(found[1]) == K.SEALED
                                     and idx.word(found[0], K.E_CRC) == n)
        assert {s for s in range(idx.slots) if K.kind_of(idx.word(s)) == K.ALLOC} == set(allocs)
        for s in {s for s, _ in held} | set(sealed):
            assert idx.word(s, K.E_PINS) == held.get((s, 0), 0) | held.get((s, 1), 0) << 8


def test_sweep_frees_the_tombstones_that_end_a_chain() -> None:
    _, idx = _index()
    words = {}
    for n in (5, 6, 7, 9):  # 5, 6, 7 one run, then 9 alone
        _, s, a = idx.reserve(_key(n), 0, 1)
        idx.fill(s, _key(n), 64, n)
        words[s] = idx.seal(s, a)
    assert idx.try_evict(7, words[7]) and idx.try_evict(6, words[6]) and idx.try_evict(9, words[9])
    _, s, a = idx.reserve(_key(12), 0, 1)
    idx.seal(s, a)
    assert idx.abort(*idx.reserve(_key(11), 0, 1)[1:])  # 11: TOMB before SEALED 12
    assert idx.sweep() == 3  # 6 and 7 (8 is FREE), and 9 (10 is FREE); 11 stays: 12 is sealed
    assert [K.kind_of(idx.word(s)) for s in range(5, 13)] == [K.SEALED, K.FREE, K.FREE, K.FREE, K.FREE,
                                                               K.FREE, K.TOMB, K.SEALED]
    assert K.seq_of(idx.word(7)) == 1  # the sequence goes on from the freed slot's last life
    assert idx.lookup(_key(5)) == (5, words[5])


# the census (firmware_model/kv_census.py): what the telemetry page's pool section publishes
def _sealed(idx: K.KvIndex, n: int, host: int) -> tuple[int, int]:
    key = _key(n)
    _, slot, alloc = idx.reserve(key, host, 1)
    idx.fill(slot, key, SLOT, 0)
    sealed = idx.seal(slot, alloc)
    assert sealed is not None
    return slot, sealed


def test_census_counts_each_hosts_entries_pins_and_hits() -> None:
    """Host 0 publishes 3 blocks (one read by host 2, one evicted), host 1 holds an allocation in
    flight and pins one of host 0's twice; evicting leaves a TOMB, which is not used."""
    _, idx = _index(hosts=3, quota=1000)
    (a, wa), (b, wb), (c, wc) = (_sealed(idx, n, 0) for n in (1, 2, 3))
    idx.touch(a, 2, 7)
    assert idx.pin(b, wb, 1) and idx.pin(b, wb, 1) and idx.pin(a, wa, 2)
    assert idx.reserve(_key(9), 1, 1)[0] == "ok"
    assert idx.try_evict(c, wc)
    idx.bump(K.H_EVICTIONS)
    idx.set_host_field(0, K.HS_EVICTED, 1)
    idx.add_host_field(2, K.HS_HITS, 5)
    idx.add_host_field(2, K.HS_CROSS_HITS, 4)
    assert idx.cas_host_state(2, 0, K.host_word(3, K.LIVE))
    idx.set_host_field(2, K.HS_PID, 4242)
    got = census(idx)
    assert (got.slots, got.slot_bytes, got.used, got.sealed, got.shared, got.evictions) == (
        idx.slots, SLOT, 3, 2, 1, 1)
    assert got.hosts == (
        HostCensus(phase=K.IDLE, pid=0, sealed=2, shared=1, pins=0, allocations=0, unshared_bytes=0,
                   quota_bytes=1000, hits=0, cross_hits=0, evicted=1),
        HostCensus(phase=K.IDLE, pid=0, sealed=0, shared=0, pins=2, allocations=1, unshared_bytes=0,
                   quota_bytes=1000, hits=0, cross_hits=0, evicted=0),
        HostCensus(phase=K.LIVE, pid=4242, sealed=0, shared=0, pins=1, allocations=0, unshared_bytes=0,
                   quota_bytes=1000, hits=5, cross_hits=4, evicted=0))
