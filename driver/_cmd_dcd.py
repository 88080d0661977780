"""Typed wrappers of the Dynamic Capacity commands (CXL r3.1 §8.2.9.9.9) and cxlemu's
fabric-manager requests (vendor opcodes C000h-C002h, sent in-band on a port's mailbox).

    cfg = md.get_dc_config()                     # regions, extent and tag counts
    for offer in md.dc_offers():                 # closed More chains, judged by Linux's rules
        md.accept_offer(offer)                   # Add DC Response: its extents, or [] (declined)
    md.accept([(dpa, length)])                   # Add DC Response by hand; [] declines
    md.get_dc_extents()                          # this port's accepted extents
    md.release([(dpa, length)])                  # Release DC: access ends before it returns

    md.fm_add(host=1, region=0, extents=[(dpa, length)], tag=b"kv-index")   # the fabric manager
    md.fm_release(host=1, region=0, extents=[...], forced=True)
    md.fm_list()                                 # every port's extents and offers

Bad arguments raise ValueError before the device sees them; device refusals MailboxError.
"""
from __future__ import annotations

from dataclasses import dataclass

from driver._cmd_base import CommandMixin
from driver._cmd_events import EventRecord
from driver._dc_rules import DcChain, DcChainOpen, DcExtent, DcOffer, offers_of
from emulator.spec import payloads_dcd as D
from emulator.spec.opcodes import Opcode


@dataclass(frozen=True)
class DcRegion:
    base: int
    length: int
    block_size: int


@dataclass(frozen=True)
class DcConfig:
    regions: list[DcRegion]
    extents_supported: int
    extents_available: int
    tags_supported: int
    tags_available: int


@dataclass(frozen=True)
class DcExtentList:
    extents: list[DcExtent]
    generation: int


def tag_bytes(tag: bytes | str | None) -> bytes:
    """A 16-byte tag from bytes or text (NUL padded); None: no tag."""
    raw = b"" if tag is None else tag.encode() if isinstance(tag, str) else bytes(tag)
    if len(raw) > D.DC_TAG_LEN:
        raise ValueError(f"a DC tag is at most {D.DC_TAG_LEN} bytes, got {len(raw)}")
    return raw.ljust(D.DC_TAG_LEN, b"\0")


def _ranges(extents: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = [(int(dpa), int(length)) for dpa, length in extents]
    for dpa, length in out:
        if dpa < 0 or length <= 0 or dpa % D.DC_BLOCK or length % D.DC_BLOCK:
            raise ValueError(f"extent {dpa:#x}+{length:#x}: start and length must be multiples of "
                             f"{D.DC_BLOCK >> 20} MiB, the length positive")
    return out


class DcdCommands(CommandMixin):
    """Mixin: needs `call(opcode, payload) -> bytes` (MailboxClient) and `drain_events`."""

    def get_dc_config(self) -> DcConfig:
        """Get DC Configuration: every region (several calls if the answer is split)."""
        regions: list[DcRegion] = []
        while True:
            out = self.call(Opcode.GET_DC_CONFIG, D.GET_DC_CONFIG_IN.pack(region_cnt=D.DC_MAX_REGIONS,
                                                                         start_region_id=len(regions)))
            head = D.GET_DC_CONFIG_OUT.unpack(out)
            for i in range(head["regions_returned"]):
                r = D.DC_REGION_CONFIG.unpack(out, D.GET_DC_CONFIG_OUT.size + i * D.DC_REGION_CONFIG.size)
                regions.append(DcRegion(r["base"], r["region_len"], r["block_size"]))
            if len(regions) >= head["num_regions"] or head["regions_returned"] == 0:
                tail = D.DC_CONFIG_TAIL.unpack(out, len(out) - D.DC_CONFIG_TAIL.size)
                return DcConfig(regions, tail["num_extents_supported"], tail["num_extents_available"],
                                tail["num_tags_supported"], tail["num_tags_available"])

    def get_dc_extents(self) -> DcExtentList:
        """Get DC Extent List: this port's accepted extents, all of them."""
        extents: list[DcExtent] = []
        while True:
            out = self.call(Opcode.GET_DC_EXTENT_LIST, D.GET_DC_EXTENTS_IN.pack(extent_cnt=0xFFFFFFFF,
                                                                               start_extent_id=len(extents)))
            head = D.GET_DC_EXTENTS_OUT.unpack(out)
            for i in range(head["count"]):
                e = D.DC_EXTENT.unpack(out, D.GET_DC_EXTENTS_OUT.size + i * D.DC_EXTENT.size)
                extents.append(DcExtent(e["start_dpa"], e["len"], e["tag"], e["shared_seq"]))
            if len(extents) >= head["total"] or head["count"] == 0:
                return DcExtentList(extents, head["generation"])

    def _dc_list(self, opcode: int, extents: list[tuple[int, int]]) -> None:
        ranges = _ranges(extents)
        body = b"".join(D.DC_EXTENT_ENTRY.pack(start_dpa=dpa, len=n) for dpa, n in ranges)
        self.call(opcode, D.DC_RESPONSE.pack(updated_extent_list_size=len(ranges)) + body)

    def accept(self, extents: list[tuple[int, int]]) -> None:
        """Add DC Response: accept these (start_dpa, length) of the pending offer; [] declines it.
        The access bits are set when this returns. ``DcChainOpen`` while the offer's More chain
        has not closed in what ``dc_events`` read (Linux answers a chain only once it closes)."""
        if self.dc_chain.is_open:
            raise DcChainOpen(f"{len(self.dc_chain.held)} Add Capacity records read so far end with More set: "
                              "read dc_events() until the chain closes, then answer the offer")
        self._dc_list(Opcode.ADD_DC_RESPONSE, extents)

    def accept_offer(self, offer: DcOffer) -> list[tuple[int, int]]:
        """Answer a surfaced offer as Linux does: its extents (in their order) when the host's
        rules take it, else an empty Add DC Response, which declines it. Returns what was accepted."""
        taken = [] if offer.refused else offer.ranges
        self.accept(taken)
        return taken

    def release(self, extents: list[tuple[int, int]]) -> None:
        """Release DC: give back accepted capacity; the next transfer there fails (NoExtent)."""
        if not extents:
            raise ValueError("release needs at least one extent")
        self._dc_list(Opcode.RELEASE_DC, extents)

    @property
    def dc_chain(self) -> DcChain:
        """The Add Capacity records read but held: their More chain has not closed yet."""
        chain = self.__dict__.get("_dc_chain")
        if chain is None:
            chain = self.__dict__["_dc_chain"] = DcChain()
        return chain

    def dc_events(self) -> list[EventRecord]:
        """The DC event log's records, read and cleared (oldest first); Add Capacity records
        surface only once their More chain closes, the whole chain at once (Linux v11)."""
        records, _ = self.drain_events("dcd")  # type: ignore[attr-defined]
        return self.dc_chain.feed(records)

    def dc_offers(self, records: list[EventRecord] | None = None) -> list[DcOffer]:
        """The closed Add Capacity chains of ``records`` (default: ``dc_events()``, so other
        records read there are dropped) as offers, each judged by Linux's rules
        (driver/_dc_rules.py) against the tags this port holds per region."""
        records = self.dc_events() if records is None else records
        bases = D.region_bases(self.config.capacity, self.config.dc_regions)
        held: dict[int, set[bytes]] = {}
        for e in self.get_dc_extents().extents:
            region = max(i for i, base in enumerate(bases) if base <= e.start_dpa)
            if e.tag != bytes(D.DC_TAG_LEN):
                held.setdefault(region, set()).add(e.tag)
        return offers_of(records, held)

    # the fabric manager ------------------------------------------------------------------------
    def _fm(self, opcode: int, host: int, region: int, extents: list[tuple[int, int]], tag: bytes | str | None,
            flags: int) -> None:
        if not self.config.dc_regions:
            raise ValueError(f"{self.config.name} has no DC regions (serve it with --dc-region SIZE)")
        bases = D.region_bases(self.config.capacity, self.config.dc_regions)  # as Get DC Configuration says
        if not 0 <= region < len(bases):
            raise ValueError(f"region {region}: the device has regions 0..{len(bases) - 1}")
        if not extents:
            raise ValueError("give at least one extent")
        ranges, base = _ranges(extents), bases[region]
        if any(dpa < base for dpa, _ in ranges):
            raise ValueError(f"extents of region {region} start at DPA {base:#x} or later")
        head = D.FM_DC_REQUEST.pack(host=host, region=region, flags=flags, count=len(ranges), tag=tag_bytes(tag))
        self.call(opcode, head + b"".join(D.FM_EXTENT.pack(offset=dpa - base, len=n) for dpa, n in ranges))

    def fm_add(self, host: int, region: int, extents: list[tuple[int, int]], tag: bytes | str | None = None) -> None:
        """Offer (start_dpa, length) extents of ``region`` to ``host`` (QMP cxl-add-dynamic-capacity)."""
        self._fm(Opcode.FM_ADD_DC, host, region, extents, tag, 0)

    def fm_release(self, host: int, region: int, extents: list[tuple[int, int]], tag: bytes | str | None = None,
                   *, forced: bool = False) -> None:
        """Ask ``host`` to release extents (it answers with Release DC); ``forced``: revoke now."""
        self._fm(Opcode.FM_RELEASE_DC, host, region, extents, tag, D.FM_FORCED if forced else 0)

    def fm_list(self) -> list[DcExtent]:
        """Every port's accepted extents and pending offers."""
        out = self.call(Opcode.FM_LIST_DC)
        rows = (D.FM_LIST_ENTRY.unpack(out, D.FM_LIST_OUT.size + i * D.FM_LIST_ENTRY.size)
                for i in range(D.FM_LIST_OUT.unpack(out)["count"]))
        return [DcExtent(r["start_dpa"], r["len"], r["tag"], r["shared_seq"], r["host"], bool(r["pending"]))
                for r in rows]

    def fm_create_pool(self, size: int, *, hosts: list[int] | None = None, region: int = 0, offset: int = 0,
                       slot_bytes: int = 256 << 10, quota: int = 0, policy: str = "lru") -> int:
        """Create the shared KV pool (vendor C003h): an extent of ``size`` bytes at ``offset`` into
        ``region``, tagged kv-index, offered to ``hosts`` (default all) and formatted with slots of
        ``slot_bytes``, a per-host ``quota`` of unshared bytes (0: the data area / hosts) and the
        eviction ``policy`` the firmware runs (an online ``firmware_model.policies`` name or
        ``package.module:Class``, importable by the serving process too; kept with the pool). Each
        host accepts it when it opens the pool (``driver.pool.KvPool.open``). Returns its DPA."""
        from firmware_model.kv_index import MAX_HOSTS, check_policy

        check_policy(policy)

        hosts = list(range(self.config.hosts)) if hosts is None else hosts
        if self.config.hosts > MAX_HOSTS:
            raise ValueError(f"a KV pool serves devices of at most {MAX_HOSTS} host ports; this one has {self.config.hosts}")
        if not hosts or any(not 0 <= h < self.config.hosts for h in hosts):
            raise ValueError(f"hosts must be among 0..{self.config.hosts - 1}, got {hosts}")
        bases = D.region_bases(self.config.capacity, self.config.dc_regions) if self.config.dc_regions else []
        if not 0 <= region < len(bases):
            raise ValueError(f"{self.config.name} has no DC region {region} (serve it with --dc-region SIZE)")
        (dpa, length), = _ranges([(bases[region] + offset, size)])
        if slot_bytes <= 0 or slot_bytes % 64:
            raise ValueError(f"slot bytes must be a positive multiple of 64, got {slot_bytes}")
        self.call(Opcode.FM_CREATE_KV_POOL, D.FM_KV_POOL.pack(
            region=region, hosts=sum(1 << h for h in hosts), offset=offset, len=length, slot_bytes=slot_bytes,
            quota=quota) + policy.encode())
        return dpa
