"""Dynamic Capacity from the host side (driver/_cmd_dcd.py): the fabric manager offers, each
port's MemDev sees its own events and extents, accepts and releases; the access bitmaps follow;
a restart (serve again) keeps extents and bitmaps."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from driver import DcChainOpen, MailboxError, MemDev
from driver._cmd_events import EventRecord, decode_record
from driver._dc_rules import DcChain, offers_of
from emulator.commands.dcd import dc_record
from emulator.dcd import Extent
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


# Linux v11's host rules (driver/_dc_rules.py) --------------------------------------------------------
def test_an_offer_surfaces_only_when_its_more_chain_closes(hosts: tuple[MemDev, MemDev]) -> None:
    h0, h1 = hosts
    ranges = [(BASE + 2 * i * MB2, MB2) for i in range(20)]
    h0.fm_add(1, 0, ranges)
    first = h1.get_event_records("dcd")  # one Get Event Records answer holds 15 of the 20
    assert len(first.records) == 15 and first.records[-1].fields["flags"] == 1
    h1.clear_event_records("dcd", [r.handle for r in first.records])
    assert h1.dc_chain.feed(first.records) == [] and h1.dc_chain.is_open
    with pytest.raises(DcChainOpen, match="15 Add Capacity records read so far end with More set"):
        h1.accept(ranges)
    assert [e.pending for e in h0.fm_list()] == [True] * 20  # nothing answered
    surfaced = h1.dc_events()
    assert [r.handle for r in surfaced] == [r.handle for r in first.records] + list(range(16, 21))
    offers = h1.dc_offers(surfaced)
    assert [(o.region, o.tag, o.ranges, o.refused) for o in offers] == [(0, bytes(16), ranges, None)]
    assert h1.accept_offer(offers[0]) == ranges and not h1.dc_chain.is_open
    assert [(e.start_dpa, e.length) for e in h1.get_dc_extents().extents] == ranges


def test_a_second_extent_set_under_a_tag_in_use_in_its_region_is_declined(hosts: tuple[MemDev, MemDev]) -> None:
    h0, h1 = hosts
    h0.fm_add(1, 0, [(BASE, 2 * MB2)], tag="kv")
    (offer,) = h1.dc_offers()
    assert offer.refused is None and h1.accept_offer(offer) == [(BASE, 2 * MB2)]
    h0.fm_add(1, 0, [(BASE + 4 * MB2, MB2)], tag="kv")
    (again,) = h1.dc_offers()
    assert again.refused == "tag 'kv' is in use in region 0 already (Linux: -EBUSY)"
    assert h1.accept_offer(again) == []  # an empty Add DC Response: the offer is declined
    assert [e.pending for e in h0.fm_list()] == [False]
    assert [(e.start_dpa, e.length) for e in h1.get_dc_extents().extents] == [(BASE, 2 * MB2)]
    assert _bits(h1, 1)[:1] == b"\x03"
    # the tag in another region, and another host under the same tag (sharing), are taken
    h0.fm_add(1, 1, [(2 * M256, MB2)], tag="kv")
    (other,) = h1.dc_offers()
    assert other.refused is None and h1.accept_offer(other) == [(2 * M256, MB2)]
    h0.fm_add(0, 0, [(BASE, 2 * MB2)], tag="kv")
    (shared,) = h0.dc_offers()
    assert shared.refused is None and h0.accept_offer(shared) == [(BASE, 2 * MB2)]
    # untagged capacity has no tag to clash
    for block in (8, 10):
        h0.fm_add(1, 0, [(BASE + block * MB2, MB2)])
        (plain,) = h1.dc_offers()
        assert plain.refused is None and h1.accept_offer(plain) == [(BASE + block * MB2, MB2)]


def _records(extents: list[Extent], region: int = 0) -> list[EventRecord]:
    """The Add Capacity records of one chain, as the device lays them out, in the order given."""
    return [decode_record("dcd", dc_record(DcEventType.ADD_CAPACITY, 1, region, e, more=i < len(extents) - 1,
                                           extents_avail=512)) for i, e in enumerate(extents)]


def test_shared_extents_are_assembled_in_shared_seq_order() -> None:
    kv = b"kv".ljust(16, b"\0")
    chain = DcChain()
    records = _records([Extent(BASE + 8 * MB2, MB2, kv, 3), Extent(BASE, MB2, kv, 1), Extent(BASE + 4 * MB2, MB2, kv, 2)])
    assert chain.feed(records[:2]) == [] and chain.feed(records[2:]) == records
    (offer,) = offers_of(records, {})
    assert offer.ranges == [(BASE, MB2), (BASE + 4 * MB2, MB2), (BASE + 8 * MB2, MB2)] and offer.refused is None
    assert [e.shared_seq for e in offer.extents] == [1, 2, 3]
    untagged = _records([Extent(BASE + 8 * MB2, MB2), Extent(BASE, MB2)])
    assert offers_of(untagged, {})[0].ranges == [(BASE + 8 * MB2, MB2), (BASE, MB2)]  # as offered
    twice = _records([Extent(BASE, MB2, kv, 1), Extent(BASE + 4 * MB2, MB2, kv, 1)])
    assert offers_of(twice, {})[0].refused == "tag 'kv': two extents with one shared_seq (Linux: a collision in the tag group)"
    mixed = _records([Extent(BASE, MB2, kv, 1), Extent(BASE + 4 * MB2, MB2, TAG, 2)])
    assert offers_of(mixed, {})[0].refused == "one More chain carries one tag in one region (Linux: -EINVAL)"
    # two chains in one read under one tag: the second is the tag's second allocation
    both = offers_of(records + _records([Extent(BASE + 16 * MB2, MB2, kv, 1)]), {})
    assert [o.refused for o in both] == [None, "tag 'kv' is in use in region 0 already (Linux: -EBUSY)"]
