"""Dynamic Capacity payload layouts (CXL r3.1 §8.2.9.9.9), as QEMU lays them out
(hw/cxl/cxl-mailbox-utils.c, cmd_dcd_*); the team's reference is ../shared/reference/cxl.md.

DPA order: the static capacity, then the DC regions from ``dc_base`` (the capacity rounded up to
256 MiB), each region 256 MiB aligned, blocks of ``DC_BLOCK`` (QEMU's 2 MiB).
"""
from __future__ import annotations

import uuid
from enum import IntEnum

from emulator.spec.layout import Layout
from emulator.spec.payloads_memdev import CAPACITY_UNIT
from emulator.spec.registers import MAILBOX_PAYLOAD_SIZE

DC_BLOCK = 2 << 20          # every region's block size (QEMU's)
DC_MAX_REGIONS = 8          # §8.2.9.9.9.1: regions 0..7
DC_REGION_ALIGN = CAPACITY_UNIT
DC_MAX_EXTENTS = 512        # extents a port may hold (num_extents_supported)
DC_MAX_TAGS = 512           # tags (num_tags_supported)
DC_TAG_LEN = 16

# 4800h Get DC Configuration: input
GET_DC_CONFIG_IN = Layout("Get DC Configuration input", "8.2.9.9.9.1", 2, [
    ("region_cnt", "B"), ("start_region_id", "B")])
# output header, then per region DC_REGION_CONFIG, then DC_CONFIG_TAIL
GET_DC_CONFIG_OUT = Layout("Get DC Configuration output", "8.2.9.9.9.1", 8, [
    ("num_regions", "B"), ("regions_returned", "B"), ("rsvd", "6s")])
DC_REGION_CONFIG = Layout("DC region configuration", "8.2.9.9.9.1", 40, [
    ("base", "Q"), ("decode_len", "Q"),   # decode_len in 256 MiB units
    ("region_len", "Q"), ("block_size", "Q"),
    ("dsmadhandle", "I"), ("flags", "B"), ("rsvd", "3s")])
DC_CONFIG_TAIL = Layout("DC configuration extent and tag counts", "8.2.9.9.9.1", 16, [
    ("num_extents_supported", "I"), ("num_extents_available", "I"),
    ("num_tags_supported", "I"), ("num_tags_available", "I")])

# 4801h Get DC Extent List
GET_DC_EXTENTS_IN = Layout("Get DC Extent List input", "8.2.9.9.9.2", 8, [
    ("extent_cnt", "I"), ("start_extent_id", "I")])
GET_DC_EXTENTS_OUT = Layout("Get DC Extent List output", "8.2.9.9.9.2", 16, [
    ("count", "I"), ("total", "I"), ("generation", "I"), ("rsvd", "4s")])
DC_EXTENT = Layout("DC extent", "8.2.9.9.9.2", 40, [
    ("start_dpa", "Q"), ("len", "Q"), ("tag", "16s"), ("shared_seq", "H"), ("rsvd", "6s")])

# 4802h Add DC Response / 4803h Release DC: this header, then DC_EXTENT_ENTRY each
DC_RESPONSE = Layout("Add DC Response / Release DC", "8.2.9.9.9.3", 8, [
    ("updated_extent_list_size", "I"), ("flags", "B"), ("rsvd", "3s")])
DC_RESPONSE_MORE = 1 << 0
DC_EXTENT_ENTRY = Layout("DC extent list entry", "8.2.9.9.9.3", 24, [
    ("start_dpa", "Q"), ("len", "Q"), ("rsvd", "8s")])


def dc_base(capacity: int) -> int:
    """The DPA where region 0 starts: the static capacity rounded up to 256 MiB."""
    return -(-capacity // DC_REGION_ALIGN) * DC_REGION_ALIGN


def region_bases(capacity: int, regions: tuple[int, ...]) -> list[int]:
    """Each region's base DPA, regions back to back from ``dc_base``."""
    out, base = [], dc_base(capacity)
    for length in regions:
        out.append(base)
        base += length
    return out


# Dynamic Capacity Event Record (§8.2.9.2.1.6), QEMU's CXLEventDynamicCapacity after the common
# header (include/hw/cxl/cxl_events.h): type, validity flags, host id, region, flags (bit 0 More),
# the extent as Get DC Extent List lays it out, then the extents and tags still available.
DC_EVENT_UUID = uuid.UUID("ca95afa7-f183-4018-8c2f-95268e101a2a")
DC_EVENT = Layout("Dynamic Capacity Event Record data", "8.2.9.2.1.6", 0x50, [
    ("type", "B"),              # 30h DcEventType
    ("validity_flags", "B"),    # 31h
    ("host_id", "H"),           # 32h
    ("region", "B"),            # 34h updated region id
    ("flags", "B"),             # 35h bit 0: More (another record of this offer follows)
    ("rsvd", "2s"),             # 36h
    ("extent", "40s"),          # 38h DC_EXTENT
    ("rsvd2", "24s"),           # 60h
    ("extents_avail", "I"),     # 78h
    ("tags_avail", "I"),        # 7Ch
])
DC_EVENT_MORE = 1 << 0


class DcEventType(IntEnum):
    ADD_CAPACITY = 0x0
    RELEASE_CAPACITY = 0x1
    FORCED_CAPACITY_RELEASE = 0x2
    REGION_CONFIG_UPDATED = 0x3


# cxlemu's fabric-manager commands (vendor opcodes C000h-C002h), QMP's cxl-add-dynamic-capacity /
# cxl-release-dynamic-capacity arguments: this header, then `count` FM_EXTENT entries (offsets
# into the region). C002h (list) takes nothing and answers FM_LIST_OUT then FM_LIST_ENTRY each.
FM_DC_REQUEST = Layout("cxlemu FM add / release DC", "vendor", 24, [
    ("host", "B"), ("region", "B"), ("flags", "B"), ("rsvd", "B"),   # flags bit 0: forced (release)
    ("count", "I"), ("tag", "16s")])
FM_FORCED = 1 << 0
FM_EXTENT = Layout("cxlemu FM extent", "vendor", 16, [("offset", "Q"), ("len", "Q")])
FM_LIST_OUT = Layout("cxlemu FM list output", "vendor", 8, [("count", "I"), ("rsvd", "4s")])
FM_LIST_ENTRY = Layout("cxlemu FM list entry", "vendor", 48, [
    ("host", "B"), ("pending", "B"), ("rsvd", "2s"), ("generation", "I"),   # pending 1: offered, not accepted
    ("start_dpa", "Q"), ("len", "Q"), ("tag", "16s"), ("shared_seq", "H"), ("rsvd2", "6s")])

# C003h: create the shared KV pool (docs/pool-design.md section 3): the extent [region base +
# offset, + len) is offered to every host of the mask, tagged "kv-index", and formatted as an
# empty index of slot_bytes slots (quota 0: the data area divided by the device's hosts). After this
# header, optionally, the eviction policy's spec as UTF-8 (at most kv_index.POLICY_BYTES; none: lru).
FM_KV_POOL = Layout("cxlemu FM create KV pool", "vendor", 40, [
    ("region", "B"), ("hosts", "B"), ("rsvd", "6s"), ("offset", "Q"), ("len", "Q"), ("slot_bytes", "Q"),
    ("quota", "Q")])
