"""The host's rules for Dynamic Capacity offers, as Linux's DCD series (v11) applies them
(drivers/cxl/core/mbox.c and extent.c; ../shared/reference/cxl.md, "Linux"):

- **An offer surfaces only when its More chain closes.** Add Capacity records are held
  (``DcChain``) until the record without the More flag arrives; then the whole chain surfaces at
  once (Linux's handle_add_event: "more bit set; delay the surfacing of extent").
- **One chain, one tag.** Every extent of a chain carries the chain's tag (Linux: a second tag in
  one group is -EINVAL).
- **A tag is unique per region.** A tagged chain whose tag this host already holds in that region
  is a second allocation under a tag in use (Linux: the tag group's registration is -EBUSY).
- **Shared extents are ordered by shared_seq.** A tagged chain's extents are assembled in
  ``shared_seq`` order, whatever order their records came in; two with one number are refused
  (Linux keys the group by the number: a duplicate is a collision).

A refused chain is not taken: Linux leaves refused extents out of its Add DC Response ("an empty
response means all are rejected"), so the host answers with an empty list, which declines the
offer. ``DcOffer.refused`` says why.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from emulator.spec import payloads_dcd as D

if TYPE_CHECKING:
    from driver._cmd_events import EventRecord

NO_TAG = bytes(D.DC_TAG_LEN)


@dataclass(frozen=True)
class DcExtent:
    """An extent as the device lists it; ``pending``/``host`` only in the fabric manager's list."""

    start_dpa: int
    length: int
    tag: bytes = bytes(D.DC_TAG_LEN)
    shared_seq: int = 0
    host: int | None = None
    pending: bool = False

    def to_json(self) -> dict[str, Any]:
        out = {"start_dpa": self.start_dpa, "length": self.length, "tag": self.tag.hex(), "shared_seq": self.shared_seq}
        return out if self.host is None else {"host": self.host, "pending": self.pending, **out}


class DcChainOpen(ValueError):
    """An Add Capacity chain is still open (its last record said More): the offer has not surfaced."""


@dataclass(frozen=True)
class DcOffer:
    """One closed Add Capacity chain: its region, tag and extents (in ``shared_seq`` order when
    tagged, else in the order offered); ``refused`` is why the host's rules turn it down, or None."""

    region: int
    tag: bytes
    extents: tuple[DcExtent, ...]
    refused: str | None = None

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(e.start_dpa, e.length) for e in self.extents]


def _is_add(record: EventRecord) -> bool:
    return record.kind == "dynamic_capacity" and record.fields["type"] == D.DcEventType.ADD_CAPACITY


@dataclass
class DcChain:
    """Add Capacity records held until their More chain closes; every other record passes."""

    held: list[EventRecord] = field(default_factory=list)

    @property
    def is_open(self) -> bool:
        return bool(self.held)

    def feed(self, records: list[EventRecord]) -> list[EventRecord]:
        """The records that surface now, in order: an Add Capacity record waits for the one
        without More that closes its chain, then the chain surfaces whole."""
        out: list[EventRecord] = []
        for r in records:
            if not _is_add(r):
                out.append(r)
                continue
            self.held.append(r)
            if not r.fields["flags"] & D.DC_EVENT_MORE:
                out += self.held
                self.held = []
        return out


def _extent_of(record: EventRecord) -> DcExtent:
    e = D.DC_EXTENT.unpack(bytes.fromhex(record.fields["extent"]))
    return DcExtent(e["start_dpa"], e["len"], e["tag"], e["shared_seq"])


def _chains(records: list[EventRecord]) -> list[list[EventRecord]]:
    """The closed Add Capacity chains among surfaced ``records``."""
    chains, current = [], []
    for r in filter(_is_add, records):
        current.append(r)
        if not r.fields["flags"] & D.DC_EVENT_MORE:
            chains.append(current)
            current = []
    return chains


def offers_of(records: list[EventRecord], held: dict[int, set[bytes]]) -> list[DcOffer]:
    """Each closed Add Capacity chain of ``records`` as a ``DcOffer``, judged by the rules above;
    ``held``: region -> the tags this host already holds there (a chain accepted here adds its tag,
    so a later chain in the same answer with that tag is refused too)."""
    out = []
    for chain in _chains(records):
        extents = [_extent_of(r) for r in chain]
        region, tag = chain[0].fields["region"], extents[0].tag
        refused = None
        if any(e.tag != tag for e in extents) or any(r.fields["region"] != region for r in chain):
            refused = "one More chain carries one tag in one region (Linux: -EINVAL)"
        elif tag != NO_TAG:
            extents.sort(key=lambda e: e.shared_seq)
            seqs = [e.shared_seq for e in extents]
            label = tag.rstrip(b"\0").decode("utf-8", "replace")
            if len(set(seqs)) != len(seqs):
                refused = f"tag {label!r}: two extents with one shared_seq (Linux: a collision in the tag group)"
            elif tag in held.get(region, set()):
                refused = f"tag {label!r} is in use in region {region} already (Linux: -EBUSY)"
        if refused is None and tag != NO_TAG:
            held.setdefault(region, set()).add(tag)
        out.append(DcOffer(region, tag, tuple(extents), refused))
    return out
