"""Dynamic Capacity from the host side (driver/_cmd_dcd.py): the fabric manager offers, each
port's MemDev sees its own events and extents, accepts and releases; the access bitmaps follow;
a restart (serve again) keeps extents and bitmaps."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from driver import MailboxError, MemDev
from emulator.device import DeviceConfig, serve
from emulator.spec.payloads_dcd import DcEventType

M256 = 256 << 20
MB2 = 2 << 20
BASE = M256
TAG = b"kv-index".ljust(16, b"\0")


def _config(name: str) -> DeviceConfig:
    return DeviceConfig(name=name, capacity=M256, hosts=2, dc_regions=(M256, M256))


@pytest.fixture
def hosts(device_name: str) -> Iterator[tuple[MemDev, MemDev]]:
    with serve(_config(device_name)), MemDev.open(device_name, host=0) as h0, MemDev.open(device_name, host=1) as h1:
        yield h0, h1


def _bits(md: MemDev, host: int) -> bytes:
    return (md.files.path / f"access.h{host}").read_bytes()


def test_dc_config_as_the_host_reads_it(hosts: tuple[MemDev, MemDev]) -> None:
    cfg = hosts[1].get_dc_config()
    assert [(r.base, r.length, r.block_size) for r in cfg.regions] == [(BASE, M256, MB2), (2 * M256, M256, MB2)]
    assert (cfg.extents_supported, cfg.extents_available, cfg.tags_supported) == (512, 512, 512)


def test_add_event_accept_list_release(hosts: tuple[MemDev, MemDev]) -> None:
    h0, h1 = hosts
    h0.fm_add(1, 0, [(BASE, 2 * MB2), (BASE + 4 * MB2, MB2)])
    assert h0.dc_events() == []  # the offer is host 1's
    events = h1.dc_events()
    assert [(e.fields["type"], e.fields["flags"]) for e in events] == [(DcEventType.ADD_CAPACITY, 1),
                                                                      (DcEventType.ADD_CAPACITY, 0)]
    h1.accept([(BASE, 2 * MB2), (BASE + 4 * MB2, MB2)])
    listed = h1.get_dc_extents()
    assert [(e.start_dpa, e.length) for e in listed.extents] == [(BASE, 2 * MB2), (BASE + 4 * MB2, MB2)]
    assert listed.generation == 1 and h0.get_dc_extents().extents == []
    assert _bits(h1, 1)[:1] == b"\x13" and _bits(h0, 0) == bytes(32)
    h0.fm_release(1, 0, [(BASE, 2 * MB2)])
    assert [e.fields["type"] for e in h1.dc_events()] == [DcEventType.RELEASE_CAPACITY]
    h1.release([(BASE, 2 * MB2)])
    assert _bits(h1, 1)[:1] == b"\x10"
    assert [(e.host, e.pending, e.start_dpa) for e in h0.fm_list()] == [(1, False, BASE + 4 * MB2)]
    with pytest.raises(MailboxError):
        h1.release([(BASE, 2 * MB2)])  # no longer held
    with pytest.raises(ValueError, match="multiples of 2 MiB"):
        h1.accept([(BASE + 4096, MB2)])


def test_shared_extent_sets_both_bitmaps_and_survives_a_restart(device_name: str) -> None:
    with serve(_config(device_name), keep=True):
        with MemDev.open(device_name, host=0) as h0, MemDev.open(device_name, host=1) as h1:
            for h, md in ((0, h0), (1, h1)):
                h0.fm_add(h, 1, [(2 * M256, 4 * MB2)], tag="kv-index")
                md.accept([(2 * M256, 4 * MB2)])
            assert h1.get_dc_extents().extents[0].tag == TAG
            assert _bits(h0, 0) == _bits(h1, 1) == bytes(16) + b"\x0f" + bytes(15)
    with serve(_config(device_name)):
        with MemDev.open(device_name, host=1) as h1:
            assert [(e.start_dpa, e.length, e.tag) for e in h1.get_dc_extents().extents] == [(2 * M256, 4 * MB2, TAG)]
            assert _bits(h1, 0) == _bits(h1, 1) == bytes(16) + b"\x0f" + bytes(15)
