"""Dynamic Capacity commands (CXL r3.1 §8.2.9.9.9, as QEMU's cmd_dcd_* answer them) and the
fabric manager's requests (cxlemu vendor opcodes C000h-C002h).

Host side, on the asking port (``fw.port``): Get DC Configuration, Get DC Extent List, Add DC
Response, Release DC. The fabric manager's commands travel in-band: any port's mailbox takes
them and names the target host in the payload (a separate FM mailbox is left for later). Add
queues an offer and logs one Add Capacity record per extent in the target port's DC event log,
the More flag on all but the last; release logs Release Capacity (the host answers with Release
DC); a forced release revokes at once and logs Forced Capacity Release. State: ``fw.dcd``
(`emulator.dcd.DcState`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from emulator.dcd import NO_TAG, Extent
from emulator.kv_pool import INDEX_TAG, POLICY
from firmware_model.kv_index import MAX_HOSTS, POLICY_BYTES, check_policy, layout_slots
from emulator.events import header
from emulator.mailbox import Effect, command
from emulator.spec import payloads_dcd as D
from emulator.spec.opcodes import Opcode
from emulator.spec.payloads_events import EVENT_LOG_SIZES, EventLog
from emulator.spec.payloads_memdev import CAPACITY_UNIT
from emulator.spec.retcodes import RetCode

if TYPE_CHECKING:
    from emulator.firmware import Firmware

_CHANGES = Effect.IMMEDIATE_CONFIG_CHANGE


@command(Opcode.GET_DC_CONFIG, "Get DC Configuration", in_len=D.GET_DC_CONFIG_IN.size)
def get_dc_config(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    req = D.GET_DC_CONFIG_IN.unpack(payload)
    regions = fw.dcd.regions
    if not regions:
        return RetCode.UNSUPPORTED, b""  # QEMU offers the DC commands only on a device with regions
    start = req["start_region_id"]
    if start >= len(regions):
        return RetCode.INVALID_INPUT, b""
    chosen = regions[start:start + req["region_cnt"]]
    out = [D.GET_DC_CONFIG_OUT.pack(num_regions=len(regions), regions_returned=len(chosen))]
    out += [D.DC_REGION_CONFIG.pack(base=base, decode_len=length // CAPACITY_UNIT, region_len=length,
                                    block_size=D.DC_BLOCK) for base, length in chosen]
    held = len(fw.dcd.ports[fw.port.host].accepted)
    out.append(D.DC_CONFIG_TAIL.pack(num_extents_supported=D.DC_MAX_EXTENTS,
                                     num_extents_available=D.DC_MAX_EXTENTS - held,
                                     num_tags_supported=D.DC_MAX_TAGS, num_tags_available=D.DC_MAX_TAGS))
    return RetCode.SUCCESS, b"".join(out)


def _extent_bytes(e: Extent) -> bytes:
    return D.DC_EXTENT.pack(start_dpa=e.start_dpa, len=e.length, tag=e.tag, shared_seq=e.shared_seq)


@command(Opcode.GET_DC_EXTENT_LIST, "Get DC Extent List", in_len=D.GET_DC_EXTENTS_IN.size)
def get_dc_extent_list(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    req = D.GET_DC_EXTENTS_IN.unpack(payload)
    port = fw.dcd.ports[fw.port.host]
    total, start = len(port.accepted), req["start_extent_id"]
    if start > total:
        return RetCode.INVALID_INPUT, b""
    fits = (D.MAILBOX_PAYLOAD_SIZE - D.GET_DC_EXTENTS_OUT.size) // D.DC_EXTENT.size
    chosen = port.accepted[start:start + min(req["extent_cnt"], fits)]
    head = D.GET_DC_EXTENTS_OUT.pack(count=len(chosen), total=total, generation=port.generation)
    return RetCode.SUCCESS, head + b"".join(map(_extent_bytes, chosen))


def _ranges(payload: memoryview) -> list[tuple[int, int]] | RetCode:
    """The extent list of Add DC Response / Release DC, or the code refusing its length."""
    count = D.DC_RESPONSE.unpack(payload)["updated_extent_list_size"]
    if len(payload) != D.DC_RESPONSE.size + count * D.DC_EXTENT_ENTRY.size:
        return RetCode.INVALID_PAYLOAD_LENGTH  # a 2 KiB payload holds 85 entries: the extent limit is DcState's
    entries = (D.DC_EXTENT_ENTRY.unpack(payload, D.DC_RESPONSE.size + i * D.DC_EXTENT_ENTRY.size)
               for i in range(count))
    return [(e["start_dpa"], e["len"]) for e in entries]


@command(Opcode.ADD_DC_RESPONSE, "Add DC Response", in_len=None, min_len=D.DC_RESPONSE.size, effects=_CHANGES,
         persistent=True)
def add_dc_response(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    ranges = _ranges(payload)
    return (ranges if isinstance(ranges, RetCode) else fw.dcd.accept(fw.port.host, ranges)), b""


@command(Opcode.RELEASE_DC, "Release DC", in_len=None, min_len=D.DC_RESPONSE.size, effects=_CHANGES,
         persistent=True)
def release_dc(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    ranges = _ranges(payload)  # the bits are cleared before the answer: the next transfer fails
    return (ranges if isinstance(ranges, RetCode) else fw.dcd.release(fw.port.host, ranges)), b""


# fabric manager ------------------------------------------------------------------------------------
def dc_record(kind: D.DcEventType, host: int, region: int, extent: Extent, *, more: bool,
              extents_avail: int) -> bytes:
    """A 128-B Dynamic Capacity event record (informational)."""
    return header(D.DC_EVENT_UUID.bytes, 0) + D.DC_EVENT.pack(
        type=kind, host_id=host, region=region, flags=D.DC_EVENT_MORE if more else 0,
        extent=_extent_bytes(extent), extents_avail=extents_avail, tags_avail=D.DC_MAX_TAGS)


def _fm_request(fw: Firmware, payload: memoryview) -> tuple[dict, list[Extent]] | RetCode:
    """The FM header and its extents as DPAs, or the code refusing them."""
    req = D.FM_DC_REQUEST.unpack(payload)
    if len(payload) != D.FM_DC_REQUEST.size + req["count"] * D.FM_EXTENT.size:
        return RetCode.INVALID_PAYLOAD_LENGTH
    if req["host"] >= len(fw.dcd.ports) or req["region"] >= len(fw.dcd.regions) or req["count"] == 0:
        return RetCode.INVALID_INPUT
    base, _ = fw.dcd.regions[req["region"]]
    items = [D.FM_EXTENT.unpack(payload, D.FM_DC_REQUEST.size + i * D.FM_EXTENT.size) for i in range(req["count"])]
    seq = 1 if req["tag"] != NO_TAG else 0  # shared extents are numbered in offer order
    extents = [Extent(base + it["offset"], it["len"], req["tag"], seq + i if seq else 0) for i, it in enumerate(items)]
    bad = fw.dcd.check_list([(e.start_dpa, e.length) for e in extents])
    if bad is not None or any(fw.dcd.region_of(e.start_dpa) != req["region"] for e in extents):
        return bad or RetCode.INVALID_PHYSICAL_ADDRESS
    return req, extents


def _log_room(fw: Firmware, hosts: list[int], records: int) -> bool:
    """Whether each host's DC event log has room for ``records`` more: an offer whose last record
    (the one that closes its More chain) would overflow the log could never surface to the host.
    cxlemu's own check (QEMU lets its 8-record log overflow); refused as Resources Exhausted."""
    size = EVENT_LOG_SIZES[EventLog.DYNAMIC_CAPACITY]
    return all(fw.ports[h].events.count(EventLog.DYNAMIC_CAPACITY) + records <= size for h in hosts)


def _log(fw: Firmware, kind: D.DcEventType, req: dict, extents: list[Extent]) -> None:
    host = req["host"]
    avail = D.DC_MAX_EXTENTS - len(fw.dcd.ports[host].accepted)
    for i, e in enumerate(extents):
        record = dc_record(kind, host, req["region"], e, more=i < len(extents) - 1, extents_avail=avail)
        fw.ports[host].events.add_own(EventLog.DYNAMIC_CAPACITY, record,
                                      f"DC {kind.name.lower()} {e.start_dpa:#x}+{e.length:#x}")


@command(Opcode.FM_ADD_DC, "FM Add Dynamic Capacity", in_len=None, min_len=D.FM_DC_REQUEST.size, effects=_CHANGES,
         persistent=True)
def fm_add_dc(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    parsed = _fm_request(fw, payload)
    if isinstance(parsed, RetCode):
        return parsed, b""
    req, extents = parsed
    rc = fw.dcd.offer(req["host"], extents)
    if rc == RetCode.SUCCESS and not _log_room(fw, [req["host"]], len(extents)):
        fw.dcd.ports[req["host"]].pending = []
        rc = RetCode.RESOURCES_EXHAUSTED
    if rc == RetCode.SUCCESS:
        _log(fw, D.DcEventType.ADD_CAPACITY, req, extents)
    return rc, b""


@command(Opcode.FM_RELEASE_DC, "FM Release Dynamic Capacity", in_len=None, min_len=D.FM_DC_REQUEST.size,
         effects=_CHANGES, persistent=True)
def fm_release_dc(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    parsed = _fm_request(fw, payload)
    if isinstance(parsed, RetCode):
        return parsed, b""
    req, extents = parsed
    port = fw.dcd.ports[req["host"]]
    if any(fw.dcd.held(port.accepted, e.start_dpa, e.length) < e.length for e in extents):
        return RetCode.INVALID_PHYSICAL_ADDRESS  # the host does not hold all of it
    if req["flags"] & D.FM_FORCED:
        rc = fw.dcd.revoke(req["host"], [(e.start_dpa, e.length) for e in extents])
        if rc != RetCode.SUCCESS:
            return rc, b""  # the cut would split past the extents a port can hold
        _log(fw, D.DcEventType.FORCED_CAPACITY_RELEASE, req, extents)
    else:
        _log(fw, D.DcEventType.RELEASE_CAPACITY, req, extents)
    return RetCode.SUCCESS, b""


@command(Opcode.FM_LIST_DC, "FM List Dynamic Capacity", in_len=0)
def fm_list_dc(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    rows = []
    for h, port in enumerate(fw.dcd.ports):
        for pending, extents in ((0, port.accepted), (1, port.pending)):
            rows += [D.FM_LIST_ENTRY.pack(host=h, pending=pending, generation=port.generation,
                                          start_dpa=e.start_dpa, len=e.length, tag=e.tag, shared_seq=e.shared_seq)
                     for e in extents]
    fits = (D.MAILBOX_PAYLOAD_SIZE - D.FM_LIST_OUT.size) // D.FM_LIST_ENTRY.size
    return RetCode.SUCCESS, D.FM_LIST_OUT.pack(count=min(len(rows), fits)) + b"".join(rows[:fits])


def _pool_policy(payload: memoryview) -> str | None:
    """The eviction policy the payload names after its header (none: ``POLICY``), or None when it
    is not one the firmware can evict with (``check_policy``)."""
    text = bytes(payload[D.FM_KV_POOL.size:]).rstrip(b"\0")
    try:
        return check_policy(text.decode()) if text else POLICY
    except (UnicodeDecodeError, ValueError):
        return None


@command(Opcode.FM_CREATE_KV_POOL, "FM Create KV Pool", in_len=None, min_len=D.FM_KV_POOL.size, effects=_CHANGES,
         persistent=True)
def fm_create_kv_pool(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    """Offer one extent tagged kv-index to every host of the mask and format the index in it
    (emulator/kv_pool.py), evicted by the policy named after the header. Invalid Input: no hosts,
    a pool already offered or held, a host with an offer pending, an extent too small for the
    slots, or a policy the firmware cannot build; the extent checks are Add's."""
    if len(payload) > D.FM_KV_POOL.size + POLICY_BYTES:
        return RetCode.INVALID_PAYLOAD_LENGTH, b""
    req = D.FM_KV_POOL.unpack(payload)
    policy = _pool_policy(payload)
    if policy is None:
        return RetCode.INVALID_INPUT, b""
    hosts = [h for h in range(len(fw.ports)) if req["hosts"] >> h & 1]
    if not hosts or req["hosts"] >> len(fw.ports) or len(fw.ports) > MAX_HOSTS or req["region"] >= len(fw.dcd.regions):
        return RetCode.INVALID_INPUT, b""
    if fw.kv_pool.find_extent() is not None or any(fw.dcd.ports[h].pending for h in hosts):
        return RetCode.INVALID_INPUT, b""
    base, _ = fw.dcd.regions[req["region"]]
    extent = Extent(base + req["offset"], req["len"], INDEX_TAG, 1)
    bad = fw.dcd.check_list([(extent.start_dpa, extent.length)])
    if bad is not None or fw.dcd.region_of(extent.start_dpa) != req["region"]:
        return bad or RetCode.INVALID_PHYSICAL_ADDRESS, b""
    try:
        layout_slots(extent.length, req["slot_bytes"])
    except ValueError:
        return RetCode.INVALID_INPUT, b""
    if not _log_room(fw, hosts, 1):
        return RetCode.RESOURCES_EXHAUSTED, b""
    for h in hosts:
        rc = fw.dcd.offer(h, [extent])
        if rc != RetCode.SUCCESS:  # another host's extents overlap it: no offer stays, nothing is formatted
            for p in hosts:
                fw.dcd.ports[p].pending = []
            return rc, b""
    fw.kv_pool.create(extent.start_dpa, extent.length, req["slot_bytes"], req["quota"], policy)
    for h in hosts:
        _log(fw, D.DcEventType.ADD_CAPACITY, {"host": h, "region": req["region"]}, [extent])
    return RetCode.SUCCESS, b""
