"""The KV index's pure logic (firmware_model/kv_index.py) on a bytearray: the layout byte by byte,
the entry state machine, probing with tombstones, pins against eviction, reaping a host."""
from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from firmware_model import kv_index as K

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
