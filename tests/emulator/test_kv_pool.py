"""The firmware's side of the shared KV pool (emulator/kv_pool.py, vendor C003h): creating and
formatting the index, admitting and reaping hosts, evicting by policy under pins and quotas, and
what a restarted firmware finds."""
from __future__ import annotations

import os
import struct
import subprocess
import sys
from collections.abc import Iterator

import pytest
from mbox_support import firmware

from emulator.firmware import Firmware
from emulator.kv_pool import INTERVAL_NS, KvPoolService
from emulator.mailbox import dispatch
from emulator.spec import payloads_dcd as D
from emulator.spec.opcodes import Opcode
from emulator.spec.payloads_events import EventLog
from emulator.spec.retcodes import RetCode
from emulator.timing.linkstate import WordCas
from firmware_model import kv_index as K

M256 = 256 << 20
MB2 = 2 << 20
BASE = M256
SLOT = 4096


@pytest.fixture
def fw2(device_name: str) -> Iterator[Firmware]:
    with firmware(capacity=M256, name=device_name, hosts=2, dc_regions=(M256,)) as fw:
        yield fw


def _create(fw: Firmware, *, hosts: int = 0b11, length: int = MB2, slot: int = SLOT, quota: int = 0,
            offset: int = 0, policy: bytes = b"") -> RetCode:
    payload = D.FM_KV_POOL.pack(region=0, hosts=hosts, offset=offset, len=length, slot_bytes=slot, quota=quota)
    return dispatch(fw, Opcode.FM_CREATE_KV_POOL, payload + policy)[0]


def _accept(fw: Firmware, host: int) -> None:
    assert fw.dcd.accept(host, [(BASE, MB2)]) == RetCode.SUCCESS


def _index(fw: Firmware) -> tuple[K.KvIndex, WordCas]:
    view = fw.media[BASE:BASE + MB2]
    cas = WordCas(view)
    return K.KvIndex(view, cas), cas


def _pass(fw: Firmware) -> None:
    svc = fw.kv_pool
    svc(svc._next_ns)


def _join(idx: K.KvIndex, host: int, pid: int) -> None:
    idx.set_host_field(host, K.HS_PID, pid)
    idx.set_host_field(host, K.HS_START, (1 << 64) - 1)  # any start time
    assert idx.cas_host_state(host, 0, K.host_word(1, K.JOINING))


def _seal(idx: K.KvIndex, n: int, host: int = 0, length: int = SLOT, gen: int = 1) -> int:
    key = bytes(16) + n.to_bytes(8, "little") + bytes(24)
    status, slot, alloc = idx.reserve(key, host, gen)
    assert status == "ok"
    idx.fill(slot, key, length, 0)
    assert idx.seal(slot, alloc) is not None
    return slot


def test_create_payload_offers_and_formats(fw2: Firmware) -> None:
    assert D.FM_KV_POOL.size == 40 and D.FM_KV_POOL.offsets["offset"] == 8 and D.FM_KV_POOL.offsets["quota"] == 32
    assert _create(fw2, quota=12345) == RetCode.SUCCESS
    assert [(e.start_dpa, e.length, e.tag, e.shared_seq) for e in fw2.dcd.ports[1].pending] == [
        (BASE, MB2, b"kv-index".ljust(16, b"\0"), 1)]
    assert [fw2.ports[h].events.count(EventLog.DYNAMIC_CAPACITY) for h in (0, 1)] == [1, 1]  # Add Capacity each
    assert bytes(fw2.media[BASE:BASE + 8]) == b"CXLKVIX1"
    words = struct.unpack_from("<9Q", bytes(fw2.media[BASE + 8:BASE + 80]))
    assert words == (1, 494, SLOT, 4096, 69632, MB2, BASE, 32, 2)  # (2 MiB - 8 KiB) // (128 + 4 KiB) slots
    assert struct.unpack_from("<Q", bytes(fw2.media[BASE + 512 + 24:BASE + 512 + 32]))[0] == 12345


@pytest.mark.parametrize("kw", [dict(hosts=0), dict(hosts=0b100), dict(slot=100), dict(slot=64 << 20),
                                dict(offset=4096)])
def test_create_refusals(fw2: Firmware, kw: dict) -> None:
    assert _create(fw2, **kw) in (RetCode.INVALID_INPUT, RetCode.INVALID_EXTENT_LIST)
    assert fw2.dcd.ports[0].pending == [] and bytes(fw2.media[BASE:BASE + 8]) == bytes(8)


def test_one_pool_per_device(fw2: Firmware) -> None:
    assert _create(fw2) == RetCode.SUCCESS
    assert _create(fw2, offset=MB2) == RetCode.INVALID_INPUT


def test_join_is_admitted_and_a_dead_host_is_reaped(fw2: Firmware) -> None:
    _create(fw2)
    _accept(fw2, 0)
    _accept(fw2, 1)
    idx, cas = _index(fw2)
    try:
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True)
        _join(idx, 0, os.getpid())
        _pass(fw2)  # host 0 admitted
        _join(idx, 1, int(dead.stdout))
        assert idx.cas_host_state(1, K.host_word(1, K.JOINING), K.host_word(1, K.LIVE))  # admitted, then died
        slot = _seal(idx, 5, host=0)
        assert idx.pin(slot, idx.word(slot), 1) and idx.pin(slot, idx.word(slot), 0)
        _, aslot, _ = idx.reserve(bytes(16) + (9).to_bytes(8, "little") + bytes(24), 1, 1)
        _pass(fw2)
        assert idx.host_field(0, K.HS_STATE) == K.host_word(1, K.LIVE)
        assert idx.host_field(1, K.HS_STATE) == K.host_word(1, K.IDLE)  # its process is gone
        assert idx.word(slot, K.E_PINS) == 1  # host 1's pin byte cleared, host 0's kept
        assert K.kind_of(idx.word(aslot)) == K.FREE  # reaped to TOMB, then swept: the slot after it is FREE
        assert (int(idx.words[K.H_REAPED_ALLOCS]), int(idx.words[K.H_CLEARED_PINS])) == (1, 1)
    finally:
        del idx
        cas.release()


def test_a_released_extent_drops_its_host(fw2: Firmware) -> None:
    _create(fw2)
    _accept(fw2, 0)
    idx, cas = _index(fw2)
    try:
        _join(idx, 0, os.getpid())
        _pass(fw2)
        slot = _seal(idx, 3)
        assert idx.pin(slot, idx.word(slot), 0)
        assert fw2.dcd.release(0, [(BASE, MB2)]) == RetCode.SUCCESS
        _pass(fw2)
        assert idx.host_field(0, K.HS_STATE) >> 32 == K.IDLE and idx.word(slot, K.E_PINS) == 0
    finally:
        del idx
        cas.release()


def test_eviction_lru_order_skips_pins(fw2: Firmware) -> None:
    _create(fw2, quota=1 << 40)
    _accept(fw2, 0)
    idx, cas = _index(fw2)
    try:
        _join(idx, 0, os.getpid())
        _pass(fw2)
        slots = [_seal(idx, n) for n in range(440)]  # past 7/8 of 494 (432)
        for i, s in enumerate(slots):
            idx.touch(s, 0, 1000 + i)
        pinned = slots[0]
        assert idx.pin(pinned, idx.word(pinned), 0)
        _pass(fw2)
        kinds = [K.kind_of(idx.word(s)) for s in slots]
        evicted = [i for i, k in enumerate(kinds) if k == K.TOMB]
        assert evicted == list(range(1, 440 - 370 + 1))  # the least recently used, down to 3/4 (370)
        assert kinds[0] == K.SEALED and int(idx.words[K.H_LIVE_ENTRIES]) == 370
    finally:
        del idx
        cas.release()


def test_over_quota_host_loses_its_own_blocks_first(fw2: Firmware) -> None:
    _create(fw2, quota=100 * SLOT)
    _accept(fw2, 0)
    _accept(fw2, 1)
    idx, cas = _index(fw2)
    try:
        _join(idx, 0, os.getpid())
        _join(idx, 1, os.getpid())
        _pass(fw2)
        mine = [_seal(idx, n, host=1) for n in range(120)]
        other = [_seal(idx, 300 + n, host=0) for n in range(50)]
        shared = mine[0]
        idx.touch(shared, 0, 1)  # read by host 0: shared, not counted against host 1
        _pass(fw2)
        gone = sum(K.kind_of(idx.word(s)) == K.TOMB for s in mine)
        assert gone == 120 - 1 - 75 and K.kind_of(idx.word(shared)) == K.SEALED  # down to 3/4 of its quota
        assert all(K.kind_of(idx.word(s)) == K.SEALED for s in other)
        assert idx.host_field(1, K.HS_UNSHARED) == 75 * SLOT and int(idx.words[K.H_QUOTA_EVICTIONS]) == gone
    finally:
        del idx
        cas.release()


def test_a_restarted_firmware_finds_the_index(device_name: str) -> None:
    from emulator.device_dir import DeviceFiles
    with firmware(capacity=M256, name=device_name, hosts=2, dc_regions=(M256,)) as fw:
        _create(fw)
        _accept(fw, 0)
        fw.persist.save()
        idx, cas = _index(fw)
        slot = _seal(idx, 7)
        word = idx.word(slot)
        idx.cas(idx._ew(slot, K.E_STATE), word, (word & ~0xF) | K.EVICTING)  # killed mid-eviction
        del idx
        cas.release()
        fw2 = Firmware(DeviceFiles.open(device_name))
        try:
            _pass(fw2)
            idx, cas = _index(fw2)
            assert idx.word(slot) == word and idx.key_of(slot)[16:17] == b"\x07"
            del idx
            cas.release()
        finally:
            fw2.close()
        assert isinstance(fw.kv_pool, KvPoolService) and INTERVAL_NS == 20_000_000


def test_an_erased_index_is_let_go(fw2: Firmware) -> None:
    _create(fw2)
    _accept(fw2, 0)
    _pass(fw2)
    assert fw2.kv_pool.index is not None
    fw2.media[BASE:BASE + 8] = 0  # sanitize wiped the media
    _pass(fw2)
    assert fw2.kv_pool.index is None


# the eviction policy, chosen at create and kept in the index's header -------------------------------
def test_the_policy_is_kept_in_the_header(fw2: Firmware) -> None:
    assert _create(fw2, policy=b"lfu") == RetCode.SUCCESS
    assert bytes(fw2.media[BASE + 128:BASE + 132]) == b"lfu\0" and not fw2.media[BASE + 131:BASE + 384].any()
    idx, cas = _index(fw2)
    assert idx.policy == "lfu"
    del idx
    cas.release()


@pytest.mark.parametrize(("policy", "rc"), [
    (b"opt", RetCode.INVALID_INPUT),                 # offline: needs the future
    (b"nosuch", RetCode.INVALID_INPUT),
    (b"os:getcwd", RetCode.INVALID_INPUT),           # imports, but is no policy
    (b"\xff\xfe", RetCode.INVALID_INPUT),            # not UTF-8
    (b"l" * 257, RetCode.INVALID_PAYLOAD_LENGTH),    # past the header's 256 bytes
])
def test_a_policy_the_firmware_cannot_run_is_refused(fw2: Firmware, policy: bytes, rc: RetCode) -> None:
    assert _create(fw2, policy=policy) == rc
    assert fw2.dcd.ports[0].pending == [] and bytes(fw2.media[BASE:BASE + 8]) == bytes(8)


@pytest.mark.parametrize(("policy", "victims"), [
    # by recency: the 70 touched longest ago are 0..69 (their last touch came first)
    (b"lru", list(range(70))),
    # by count: the 40 just published (1 use each), then the oldest of the twice-used 70..399
    (b"lfu", list(range(70, 100)) + list(range(400, 440))),
])
def test_the_chosen_policy_picks_the_victims(fw2: Firmware, policy: bytes, victims: list[int]) -> None:
    _create(fw2, quota=1 << 40, policy=policy)
    _accept(fw2, 0)
    idx, cas = _index(fw2)
    try:
        _join(idx, 0, os.getpid())
        _pass(fw2)
        slots = [_seal(idx, n) for n in range(400)]
        for keys, at in ((range(400), 1000), (range(70), 2000), (range(70), 2500), (range(70, 400), 3000)):
            for n in keys:
                idx.touch(slots[n], 0, at + n)
            _pass(fw2)  # one pass each: 0..69 are used 3 times, 70..399 twice; nothing evicted yet
        slots += [_seal(idx, n) for n in range(400, 440)]  # past 7/8 of 494 slots: 70 go (down to 370)
        for n in range(400, 440):
            idx.touch(slots[n], 0, 4000 + n)
        _pass(fw2)
        kinds = [K.kind_of(idx.word(s)) for s in slots]  # evicted: TOMB, or FREE once swept (a chain's end)
        assert [n for n, k in enumerate(kinds) if k != K.SEALED] == victims
        assert fw2.kv_pool.policy is not None and fw2.kv_pool.policy.name == policy.decode()
    finally:
        del idx
        cas.release()


def test_a_restarted_firmware_evicts_by_the_pools_policy(device_name: str) -> None:
    from emulator.device_dir import DeviceFiles
    with firmware(capacity=M256, name=device_name, hosts=2, dc_regions=(M256,)) as fw:
        assert _create(fw, policy=b"firmware_model.policies.arc:ARCPolicy") == RetCode.SUCCESS
        _accept(fw, 0)
        fw.persist.save()
        fw2 = Firmware(DeviceFiles.open(device_name))
        try:
            _pass(fw2)
            assert fw2.kv_pool.policy is not None and fw2.kv_pool.policy.name == "arc"
        finally:
            fw2.close()


def test_the_telemetry_page_publishes_hosts_extents_and_the_pool_census(fw2: Firmware) -> None:
    """Layout 1.3's pool section in every port's BAR: per port its claimer and DC extents, per
    host what it holds in the index (sealed, shared, pins, allocations, quota, hits), and the
    firmware's totals."""
    from emulator.telemetry import PoolHost, TelemetryReader

    _create(fw2, quota=64 * SLOT)
    _accept(fw2, 0)
    idx, cas = _index(fw2)
    try:
        _join(idx, 0, os.getpid())
        _pass(fw2)
        a, b = _seal(idx, 1, host=0), _seal(idx, 2, host=0)
        c = _seal(idx, 3, host=1)
        idx.touch(a, 1, 5)  # read by host 1: shared
        assert idx.pin(a, idx.word(a), 1) and idx.pin(a, idx.word(a), 1) and idx.pin(c, idx.word(c), 0)
        assert idx.reserve(bytes(16) + (9).to_bytes(8, "little") + bytes(24), 0, 1)[0] == "ok"  # in flight
        idx.add_host_field(1, K.HS_HITS, 3)
        idx.add_host_field(1, K.HS_CROSS_HITS, 2)
        _pass(fw2)
        fw2.telemetry.publish(fw2.clock.now_ns())
        pools = [TelemetryReader(p.bar).snapshot().pool for p in fw2.ports]
    finally:
        del idx
        cas.release()
    pool = pools[1]
    assert pool is not None and pools[0] is not None and pools[0].host_rows == pool.host_rows
    assert (pool.hosts, pool.pool_hosts, pool.pool_slots, pool.pool_slot_bytes) == (2, 2, 494, SLOT)
    assert (pool.pool_used, pool.pool_sealed, pool.pool_shared, pool.pool_evictions) == (4, 3, 1, 0)
    assert pool.pool_cleared_pins == 1  # host 1 is not in the pool: the pass cleared its pin byte
    quota = 64 * SLOT
    assert pool.host_rows == [
        PoolHost(pid=0, pool_phase=K.LIVE, pool_pid=os.getpid(), extents=1, pending_extents=0, extent_bytes=MB2,
                 shared_extent_bytes=MB2, sealed=2, shared=1, unshared_bytes=SLOT, quota_bytes=quota, pins=1,
                 allocations=1),
        PoolHost(pending_extents=1, sealed=1, unshared_bytes=SLOT, quota_bytes=quota, pins=0, pool_hits=3,
                 cross_hits=2)]
