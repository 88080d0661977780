"""The shared KV pool from the host side (driver/pool.py): two processes on two host ports of
one `cxlemu serve --hosts 2`; publish, lookup and load across them, every load verified, no
ALLOC left by a failed publish, a torn block refused, a dead host's pins gone within 100 ms."""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest
from pool_support import FP, SLOT, HostProcess, block_hash, payload, pool_server

from driver import MemDev
from driver.pool import Fingerprint, KvPool, NoPool, PoolError, PoolRevoked
from emulator.device import DeviceConfig, serve
from firmware_model import kv_index as K

FPR = Fingerprint(*FP)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """One served device with a pool for the module's two-process tests (each uses its own keys)."""
    name = f"pool{os.getpid()}"
    with pool_server(name):
        yield name


@pytest.fixture(scope="module")
def two(server: str) -> Iterator[tuple[KvPool, HostProcess]]:
    """This process on host 0, a child on host 1 (the kill test, last, ends it)."""
    md = MemDev.open(server, host=0)
    pool = KvPool.open(md)
    child = HostProcess(server, 1)
    try:
        yield pool, child
    finally:
        child.close()
        pool.close()
        md.close()


def _kinds(pool: KvPool) -> list[int]:
    return [int(k) for k in pool.index.table_words[:, K.E_STATE] & np.uint64(0xF)]


def test_published_by_one_host_loaded_by_the_other(two: tuple[KvPool, HostProcess]) -> None:
    pool, child = two
    assert child.ask("publish", 1) is True and child.ask("publish", 1) is False  # present already
    assert pool.lookup(FPR, block_hash(1)) and not pool.lookup(FPR, block_hash(2))
    out = np.zeros(SLOT, np.uint8)
    assert pool.load(FPR, block_hash(1), out) and out.tobytes() == payload(1)
    other_model = Fingerprint("other", *FP[1:])
    assert not pool.lookup(other_model, block_hash(1)) and not pool.load(other_model, block_hash(1), out)
    assert pool.publish(FPR, block_hash(2), payload(2)) and child.ask("load", 2) is True
    assert pool.stats() == {"hits": 1, "misses": 1, "published": 1, "present": 0, "no_room": 0, "torn": 0,
                            "evicted_seen": 0, "pins_held": 0}
    assert child.ask("stats")["hits"] == 1


def test_loads_count_hits_and_cross_host_hits_in_the_host_table(two: tuple[KvPool, HostProcess]) -> None:
    """Every hit adds to the loader's record in the index's host table (the firmware publishes it);
    a hit on a block another host published adds to its cross-host hits too."""
    pool, child = two
    idx = pool.index

    def counts() -> list[tuple[int, int]]:
        return [(idx.host_field(h, K.HS_HITS), idx.host_field(h, K.HS_CROSS_HITS)) for h in (0, 1)]

    before = counts()
    assert child.ask("publish", 60) is True and pool.publish(FPR, block_hash(61), payload(61))
    out = np.zeros(SLOT, np.uint8)
    assert pool.load(FPR, block_hash(60), out) and pool.load(FPR, block_hash(61), out)
    assert child.ask("load", 61) is True and child.ask("load", 60) is True
    assert [(h - h0, c - c0) for (h, c), (h0, c0) in zip(counts(), before)] == [(2, 1), (2, 1)]


def test_a_torn_block_is_refused_and_counted(two: tuple[KvPool, HostProcess]) -> None:
    pool, child = two
    assert child.ask("publish", 3)
    slot, _ = pool.index.lookup(FPR.digest + block_hash(3))
    pool.md.write_untimed(pool.index.block_dpa(slot) + 100, b"\xff")  # behind the protocol's back
    assert not pool.load(FPR, block_hash(3), bytearray(SLOT))
    assert pool.stats()["torn"] == 1 and pool.stats()["pins_held"] == 0


def test_a_failed_publish_leaves_no_alloc(two: tuple[KvPool, HostProcess], monkeypatch: pytest.MonkeyPatch) -> None:
    pool, _ = two

    def broken(dpa: int, data: object) -> int:
        raise OSError("the transfer failed")
    monkeypatch.setattr(pool.md, "write", broken)
    with pytest.raises(OSError):
        pool.publish(FPR, block_hash(4), payload(4))
    assert K.ALLOC not in _kinds(pool) and not pool.lookup(FPR, block_hash(4))
    with pytest.raises(ValueError, match="1..4096 bytes"):
        pool.publish(FPR, block_hash(4), bytes(SLOT + 1))
    with pytest.raises(ValueError, match="32 bytes"):
        pool.publish(FPR, b"short", payload(4))


def test_kill_9_of_a_pin_holder_frees_its_pins_within_100_ms(two: tuple[KvPool, HostProcess]) -> None:
    pool, child = two
    for n in range(10, 13):
        assert pool.publish(FPR, block_hash(n), payload(n)) and child.ask("pin", n)
    pins = pool.index.table_words[:, K.E_PINS]
    assert int(np.count_nonzero(pins >> np.uint64(8))) == 3
    os.kill(child.proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    while np.count_nonzero(pins >> np.uint64(8)):
        assert time.monotonic() - t0 < 1.0
        time.sleep(0.001)
    elapsed_ms = (time.monotonic() - t0) * 1000
    assert elapsed_ms < 100, f"pins gone after {elapsed_ms:.0f} ms"
    assert pool.index.host_field(1, K.HS_STATE) >> 32 == K.IDLE


def test_no_pool_says_what_to_run(device_name: str) -> None:
    with serve(DeviceConfig(name=device_name, capacity=256 << 20, hosts=2, dc_regions=(256 << 20,))):
        with MemDev.open(device_name, host=1) as md:
            with pytest.raises(NoPool, match=f"cxlemu pool create {device_name} --size"):
                KvPool.open(md)
            assert issubclass(NoPool, PoolError)


def test_a_released_extent_revokes_the_host(device_name: str) -> None:
    with serve(DeviceConfig(name=device_name, capacity=256 << 20, hosts=2, dc_regions=(256 << 20,))):
        with MemDev.open(device_name, host=0) as md0, MemDev.open(device_name, host=1) as md1:
            dpa = md0.fm_create_pool(4 << 20, slot_bytes=SLOT)
            p0, p1 = KvPool.open(md0), KvPool.open(md1)
            assert p1.publish(FPR, block_hash(5), payload(5)) and p1.pin(FPR, block_hash(5)) is not None
            md0.fm_release(1, 0, [(dpa, 4 << 20)], "kv-index", forced=True)
            deadline = time.monotonic() + 2
            while p0.index.host_field(1, K.HS_STATE) >> 32 != K.IDLE:
                assert time.monotonic() < deadline
                time.sleep(0.005)
            with pytest.raises(PoolRevoked, match="open the pool again"):
                p1.publish(FPR, block_hash(6), payload(6))
            assert int(p0.index.table_words[:, K.E_PINS].max()) == 0
            assert p0.load(FPR, block_hash(5), bytearray(SLOT))  # host 0 goes on
            p1.close()
            p0.close()


def test_a_pinned_block_outlives_eviction_around_it(device_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The least recently used block is being read (pinned) when the pool passes its high mark:
    the firmware evicts the blocks after it in LRU order, never the pinned one, and the load
    verifies."""
    with serve(DeviceConfig(name=device_name, capacity=256 << 20, hosts=2, dc_regions=(256 << 20,))):
        with MemDev.open(device_name, host=0) as md:
            md.fm_create_pool(2 << 20, hosts=[0], slot_bytes=SLOT, quota=1 << 30)
            pool = KvPool.open(md)
            try:
                first, slots = 100, pool.index.slots  # 494: the high mark 432, the low 370
                assert pool.publish(FPR, block_hash(first), payload(first))
                keys = iter(range(1000, 10_000))
                published = 1
                while published < 420:
                    published += pool.publish(FPR, block_hash(next(keys)), payload(0))
                real = md.read_into

                def slow(dpa: int, out: object) -> int:
                    nonlocal published
                    while published < slots * 7 // 8 + 20:  # past the high mark while pinned
                        published += pool.publish(FPR, block_hash(next(keys)), payload(0))
                    time.sleep(0.1)  # five firmware passes
                    return real(dpa, out)
                monkeypatch.setattr(md, "read_into", slow)
                out = bytearray(SLOT)
                assert pool.load(FPR, block_hash(first), out) and bytes(out) == payload(first)
                assert int(pool.index.words[K.H_EVICTIONS]) >= published - int(slots * 3 / 4) - 1
            finally:
                pool.close()


def test_the_pool_survives_a_firmware_restart(device_name: str) -> None:
    """Sealed blocks live in the media: a restarted firmware serves them again, and the same
    process opens the pool again over its earlier (now stale) handle."""
    cfg = DeviceConfig(name=device_name, capacity=256 << 20, hosts=2, dc_regions=(256 << 20,))
    with serve(cfg, keep=True):
        md = MemDev.open(device_name, host=1)
        md.fm_create_pool(2 << 20, slot_bytes=SLOT)
        stale = KvPool.open(md)
        assert stale.publish(FPR, block_hash(7), payload(7))
        with pytest.raises(PoolError, match="open on host 1 already"):
            KvPool.open(md)
    with serve(cfg):
        with MemDev.open(device_name, host=1) as md2:
            pool = KvPool.open(md2)  # the stale handle, never closed, belongs to the last boot
            out = bytearray(SLOT)
            assert pool.load(FPR, block_hash(7), out) and bytes(out) == payload(7)
            assert pool.gen == 2
            pool.close()
        stale.close()
        md.close()


def test_a_second_process_on_one_port_is_refused(device_name: str) -> None:
    """A one-port device is open to every process; its pool's host record is not: the second
    process is told which pid holds it."""
    with serve(DeviceConfig(name=device_name, capacity=256 << 20, dc_regions=(256 << 20,))):
        with MemDev.open(device_name) as md:
            md.fm_create_pool(2 << 20, slot_bytes=SLOT)
            child = HostProcess(device_name, 0)
            try:
                with pytest.raises(PoolError, match=f"pid {child.proc.pid} uses the pool as host 0"):
                    KvPool.open(md)
            finally:
                child.close()
