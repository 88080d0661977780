"""The link's cost: one integer model that every timed transfer in cxlemu follows.

A transfer of ``n`` bytes at ``dpa`` in direction ``d`` (0 read: device → host, 1 write) is
charged the whole ``txn_bytes``-aligned transactions it touches, and::

    occ        = (charged * fs_per_byte[d] + 500_000) // 1_000_000     (ns, rounded half up)
    start      = max(now, link_free[d])          (now, unqueued, when occ == 0)
    link_free' = start + occ                      (unchanged when occ == 0)
    completion = start + occ + lat_ns[d]

so a direction's link is busy only for the bytes' occupancy and latency pipelines: two 64-B
reads at t=0 over 100 ns / 16 GB/s complete at 104 and 108 ns.

Several hosts on one device (docs/pool-design.md, section 1): each host has its own link, and
all share the device's media, a second resource per direction (:class:`MediaLink`, its
bandwidth ``media_fs_per_byte``).  A transfer holds both from one start::

    start      = max(now, link_free[d], media_free[d])   (a resource it does not occupy is no bound)
    link_free' = start + occ,  media_free' = start + occ_media
    completion = start + lat_ns[d] + max(occ, occ_media)

With no media limit (``media_fs_per_byte`` 0) ``occ_media`` is 0 and every time is the one-link
model's above. Times are integer nanoseconds,
bandwidths integer femtoseconds per byte, the time scale already applied; 0 means none (a 0
``fs_per_byte`` is an unthrottled direction). This is the C data path's arithmetic
(``emulator/timing/_datapath.c``: ``charged_bytes``, ``occupancy_ns``, ``reserve``,
``cxl_copy``); the Python twin and the firmware's DMA scheduling model take theirs from here,
and a differential test checks all three against each other.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["READ", "WRITE", "Link", "LinkParams", "MediaLink", "charged_bytes", "fs_per_byte",
           "occupancy_ns", "reserve", "reserve_shared"]

_T = TypeVar("_T", int, float)  # integer ns; simpy's clock may also be a float

READ, WRITE = 0, 1  # directions, as the data path numbers them

#: 1 GB/s (1e9 B/s) is 1 ns per byte = 1e6 femtoseconds per byte.
FS_PER_BYTE_AT_1GBPS = 1_000_000


def charged_bytes(dpa: int, n: int, txn_bytes: int) -> int:
    """Bytes of the whole ``txn_bytes``-aligned transactions that [dpa, dpa + n) touches."""
    mask = txn_bytes - 1
    return ((dpa + n + mask) & ~mask) - (dpa & ~mask)


def occupancy_ns(charged: int, fs_per_byte: int) -> int:
    """Link time of ``charged`` bytes, rounded half up."""
    return (charged * fs_per_byte + 500_000) // 1_000_000


def reserve(link_free: _T, now: _T, occ: int) -> _T:
    """When a transfer occupying the link ``occ`` ns, requested at ``now``, starts; the link is
    then free at ``start + occ`` (a transfer with no occupancy neither waits nor holds it)."""
    return now if occ == 0 else max(now, link_free)


def reserve_shared(link_free: _T, media_free: _T, now: _T, occ: int, occ_media: int) -> _T:
    """When a transfer holding the host's link ``occ`` ns and the shared media ``occ_media`` ns
    starts: the later of ``now`` and each resource it occupies being free."""
    start = reserve(link_free, now, occ)
    return start if occ_media == 0 else max(start, media_free)


def fs_per_byte(gbps: float, time_scale: float = 1.0) -> int:
    """Femtoseconds per byte of a bandwidth in GB/s, scaled; 0 GB/s is unthrottled (0). A
    configured bandwidth is a timed link however fast: from 1e6 GB/s up it is 1 fs/B."""
    return 0 if gbps == 0 else max(1, round(FS_PER_BYTE_AT_1GBPS * time_scale / gbps))


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        hint = " (0 = unthrottled)" if "bandwidth" in name else ""
        raise TypeError(f"{name} must be a number{hint}, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


@dataclass(frozen=True, kw_only=True)
class LinkParams:
    """A link's latency and bandwidth per direction, as integers (time scale applied)."""

    lat_ns: tuple[int, int] = (0, 0)        # read, write
    fs_per_byte: tuple[int, int] = (0, 0)   # read, write; 0 = unthrottled
    txn_bytes: int = 64
    media_fs_per_byte: tuple[int, int] = (0, 0)  # the shared media, read, write; 0 = no limit

    def __post_init__(self) -> None:
        for name in ("lat_ns", "fs_per_byte", "media_fs_per_byte"):
            pair = getattr(self, name)
            if len(pair) != 2 or any(isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0
                                     for v in pair):
                raise ValueError(f"{name} must be two integers >= 0 (read, write), got {pair!r}")
            object.__setattr__(self, name, (int(pair[0]), int(pair[1])))
        tb = self.txn_bytes
        if isinstance(tb, bool) or not isinstance(tb, numbers.Integral) or tb < 1 or tb & (tb - 1):
            raise ValueError(f"txn_bytes must be a power of two, got {tb!r}")

    @classmethod
    def from_rates(cls, *, read_latency_ns: float = 0, write_latency_ns: float = 0,
                   read_bandwidth_gbps: float = 0, write_bandwidth_gbps: float = 0,
                   time_scale: float = 1.0, txn_bytes: int = 64, media_read_bandwidth_gbps: float = 0,
                   media_write_bandwidth_gbps: float = 0) -> LinkParams:
        """From latencies in ns and bandwidths in GB/s (0 = unthrottled; the media's 0 = no
        shared media limit), times ``time_scale``."""
        for name, value in (("read_latency_ns", read_latency_ns), ("write_latency_ns", write_latency_ns),
                            ("read_bandwidth_gbps", read_bandwidth_gbps),
                            ("write_bandwidth_gbps", write_bandwidth_gbps), ("time_scale", time_scale),
                            ("media_read_bandwidth_gbps", media_read_bandwidth_gbps),
                            ("media_write_bandwidth_gbps", media_write_bandwidth_gbps)):
            _check_number(name, value)
        if not time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        k = time_scale
        return cls(lat_ns=(round(read_latency_ns * k), round(write_latency_ns * k)),
                   fs_per_byte=(fs_per_byte(read_bandwidth_gbps, k), fs_per_byte(write_bandwidth_gbps, k)),
                   txn_bytes=txn_bytes,
                   media_fs_per_byte=(fs_per_byte(media_read_bandwidth_gbps, k),
                                      fs_per_byte(media_write_bandwidth_gbps, k)))

    @property
    def untimed(self) -> bool:
        return self.lat_ns == (0, 0) and self.fs_per_byte == (0, 0) and not self.media_limited

    @property
    def media_limited(self) -> bool:
        """Whether the shared media limits some direction (a second resource to reserve)."""
        return self.media_fs_per_byte != (0, 0)

    def occupancy(self, d: int, dpa: int, n: int) -> int:
        """Link time (ns) of ``n`` bytes at ``dpa`` in direction ``d``."""
        return occupancy_ns(charged_bytes(dpa, n, self.txn_bytes), self.fs_per_byte[d])

    def media_occupancy(self, d: int, dpa: int, n: int) -> int:
        """Shared media time (ns) of the same transfer; 0 without a media limit."""
        return occupancy_ns(charged_bytes(dpa, n, self.txn_bytes), self.media_fs_per_byte[d])

    def duration_ns(self, d: int | str, n: int, dpa: int = 0) -> int:
        """Latency plus occupancy (the longer of link and media) of one transfer on an idle link."""
        i = _direction(d)
        return self.lat_ns[i] + max(self.occupancy(i, dpa, n), self.media_occupancy(i, dpa, n)) if n else 0

    def read_ns(self, n: int, dpa: int = 0) -> int:
        return self.duration_ns(READ, n, dpa)


def _direction(d: int | str) -> int:
    if d in (READ, "read"):
        return READ
    if d in (WRITE, "write"):
        return WRITE
    raise ValueError(f"direction must be 'read' (0) or 'write' (1), got {d!r}")


class MediaLink:
    """The device's media, shared by every host's :class:`Link`: when each direction is next free."""

    __slots__ = ("free",)

    def __init__(self) -> None:
        self.free: list[float] = [0, 0]  # media_free, read and write


class Link:
    """One host's link state (when each direction is next free) under :class:`LinkParams`, and
    the media it shares with other hosts' links (its own, when none is given)."""

    __slots__ = ("free", "media", "params")

    def __init__(self, params: LinkParams, media: MediaLink | None = None) -> None:
        self.params = params
        self.free: list[float] = [0, 0]  # link_free, read and write
        self.media = media if media is not None else MediaLink()

    def _hold(self, i: int, now: float, dpa: int, n: int) -> float:
        """Reserve direction ``i``'s link and media for the transfer; when both are released."""
        occ, occ_m = self.params.occupancy(i, dpa, n), self.params.media_occupancy(i, dpa, n)
        start = reserve_shared(self.free[i], self.media.free[i], now, occ, occ_m)
        if occ:
            self.free[i] = start + occ
        if occ_m:
            self.media.free[i] = start + occ_m
        return start + max(occ, occ_m)

    def transfer(self, d: int | str, now: float, n: int, dpa: int = 0) -> float:
        """Reserve the link for ``n`` bytes at ``dpa`` requested at ``now``; the completion
        (an integer for an integer ``now``: simpy's time may be either)."""
        i = _direction(d)
        if n == 0 or self.params.untimed:
            return now
        return self._hold(i, now, dpa, n) + self.params.lat_ns[i]

    def copy(self, src: int, dst: int, n: int, now: float) -> float:
        """A device-internal copy: it holds both directions for their occupancy and pays both
        latencies once after the later of them."""
        p = self.params
        if n == 0 or p.untimed:
            return now
        done = max(now, self._hold(READ, now, src, n), self._hold(WRITE, now, dst, n))
        return done + p.lat_ns[READ] + p.lat_ns[WRITE]
