"""A content-addressed KV block index that several hosts share in one memory extent (issue 25).

Pure logic over a writable buffer (the extent tagged ``kv-index``, as the firmware and every host
map it). Every word that two parties race on is a u64 changed only through the compare-and-swap
callable passed in (``cas(word_index, expect, value) -> bool``, word indexes from the start of
the buffer): the emulator and the driver pass the C core's atomic CAS over the mapped media, a
test a plain one. Fields that only the owner of an ALLOC entry writes are plain stores.

    byte 0      header (HEADER_BYTES): magic, version, slots, slot bytes, offsets, counters,
    byte 512      the host table: per host a state word (generation, phase), pid, start time,
                  quota, the unshared bytes it holds and its evictions (firmware-written), its
                  loads that hit and those of them another host published (the host's, atomic adds)
    byte 4096   the slot table: ``slots`` entries of ENTRY_BYTES, open addressing, linear probing
    data_offset the data area: slot i's block at data_offset + i * slot_bytes (fixed per slot)

An entry's state word: bits 0-3 kind (FREE, ALLOC, SEALED, EVICTING, TOMB), 4-7 the owner host,
8-39 the owner's host generation, 40-63 a sequence number raised at every allocation, so a word
names one life of the slot (no ABA: a reader that pinned a word reads that word's block or none).

    FREE/TOMB --publisher CAS--> ALLOC --fill, then CAS--> SEALED --firmware CAS--> EVICTING
        ^          (owner only)    |  abort / host reaped         ^   pins != 0: back |
        +--------------------------+------------------------------+--- pins == 0 -----+--> TOMB

Readers act on SEALED words only, and a sealed entry never changes; a reader pins (its host's
byte of ``pins``) and then checks that the state word is still the one it looked up; the firmware
moves SEALED to EVICTING and then checks ``pins`` — with both CASes sequentially consistent, one
of the two sees the other.
"""
from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["ALLOC", "ENTRY", "ENTRY_BYTES", "EVICTING", "FREE", "Fingerprint", "HEADER", "HEADER_BYTES", "HOST",
           "INDEX_TAG", "KEY_BYTES", "KvIndex", "LIVE", "MAX_HOSTS", "SEALED", "TOMB", "Cas", "IDLE", "JOINING",
           "IndexFormatError", "check_policy", "checksum", "entry_word", "host_word", "kind_of", "layout_slots"]

Cas = Callable[[int, int, int], bool]

MAGIC = int.from_bytes(b"CXLKVIX1", "little")
VERSION = 1
INDEX_TAG = b"kv-index"  # the DC tag of the extent holding the index
HEADER_BYTES = 4096
ENTRY_BYTES = 128
MAX_HOSTS = 8  # pins: 8 bits per host in one u64
HOST_TABLE = 512
HOST_BYTES = 64
MAX_PROBE = 32  # a key lives within this many slots of its home, so a miss costs at most this many reads
FP_BYTES, HASH_BYTES = 16, 32
KEY_BYTES = FP_BYTES + HASH_BYTES

# header: u64 words at byte 0 (HEADER), then one HOST record per host at HOST_TABLE
HEADER = struct.Struct("<8s15Q")
H_MAGIC, H_VERSION, H_SLOTS, H_SLOT_BYTES, H_TABLE, H_DATA, H_TOTAL, H_BASE_DPA, H_PROBE, H_HOSTS = range(10)
H_EVICTIONS, H_REAPED_ALLOCS, H_CLEARED_PINS, H_PASSES, H_LIVE_ENTRIES, H_QUOTA_EVICTIONS = range(10, 16)
POLICY_AT, POLICY_BYTES = HEADER.size, 256  # the eviction policy's spec, UTF-8, NUL padded ("": the default)
HOST = struct.Struct("<8Q")
HS_STATE, HS_PID, HS_START, HS_QUOTA, HS_UNSHARED, HS_EVICTED, HS_HITS, HS_CROSS_HITS = range(8)
# an entry: u64 words
ENTRY = struct.Struct("<2Q16s32s6Q")
E_STATE, E_PINS, E_DPA, E_LENGTH, E_CRC, E_LAST_USE, E_READERS = 0, 1, 8, 9, 10, 11, 12
ENTRY_WORDS = ENTRY_BYTES // 8
assert HEADER.size == 128 and HOST.size == HOST_BYTES and ENTRY.size == 112 <= ENTRY_BYTES
assert HOST_TABLE + MAX_HOSTS * HOST_BYTES <= HEADER_BYTES and POLICY_AT + POLICY_BYTES <= HOST_TABLE

FREE, ALLOC, SEALED, EVICTING, TOMB = 0, 1, 2, 3, 4
KIND_NAMES = ("FREE", "ALLOC", "SEALED", "EVICTING", "TOMB")
# a host record's state word: bits 0-31 its generation, bits 32-33 the phase
IDLE, JOINING, LIVE = 0, 1, 2
_SEQ_MASK = (1 << 24) - 1


class IndexFormatError(ValueError):
    """The buffer holds no index of this version, or one that does not fit it."""


def entry_word(kind: int, host: int = 0, gen: int = 0, seq: int = 0) -> int:
    return kind | (host & 0xF) << 4 | (gen & 0xFFFF_FFFF) << 8 | (seq & _SEQ_MASK) << 40


def kind_of(word: int) -> int:
    return word & 0xF


def owner_of(word: int) -> tuple[int, int]:
    """(host, host generation) of an entry's state word."""
    return (word >> 4) & 0xF, (word >> 8) & 0xFFFF_FFFF


def seq_of(word: int) -> int:
    return word >> 40


def host_word(gen: int, phase: int) -> int:
    return (gen & 0xFFFF_FFFF) | phase << 32


def checksum(data: object) -> int:
    """The payload checksum an entry keeps (crc32, as zlib computes it)."""
    return zlib.crc32(memoryview(data).cast("B"))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Fingerprint:
    """What a KV block's layout depends on: two models (or TP ranks) never match each other's
    blocks. ``digest`` is blake2b-128 of the fields in this order, text encoded as UTF-8."""

    model: str
    dtype: str
    block_tokens: int
    layers: int
    kv_heads: int
    head_dim: int
    tp_rank: int = 0

    @property
    def digest(self) -> bytes:
        text = "\0".join(map(str, (self.model, self.dtype, self.block_tokens, self.layers, self.kv_heads,
                                   self.head_dim, self.tp_rank)))
        return hashlib.blake2b(text.encode(), digest_size=FP_BYTES).digest()


def check_policy(spec: str) -> str:
    """``spec`` when the firmware can evict the index with it: an online ``firmware_model.policies``
    name or ``package.module:Class`` that fits the protocol (built once to check it), at most
    ``POLICY_BYTES`` of UTF-8. Raises ValueError saying what to change."""
    from firmware_model.policies import ONLINE_POLICY_NAMES, make_policy

    if len(spec.encode()) > POLICY_BYTES:
        raise ValueError(f"an index keeps a policy spec of at most {POLICY_BYTES} bytes, got {len(spec.encode())}")
    if spec == "opt" or not spec:
        raise ValueError(f"the pool's policy must run online: one of {', '.join(ONLINE_POLICY_NAMES)}, "
                         "or 'package.module:Class'")
    try:
        make_policy(spec, MAX_PROBE)  # resolves it, builds one and checks it against the protocol
    except TypeError as exc:  # PolicyProtocolError is one too; a constructor that refuses f(capacity)
        raise ValueError(str(exc)) from None
    return spec


def layout_slots(total: int, slot_bytes: int) -> tuple[int, int]:
    """(slots, data offset) of an index in ``total`` bytes: the header, the table, then the data
    area page-aligned, as many slots as fit."""
    if slot_bytes <= 0 or slot_bytes % 64:
        raise ValueError(f"slot bytes must be a positive multiple of 64, got {slot_bytes}")
    slots = max(0, (total - 2 * HEADER_BYTES) // (ENTRY_BYTES + slot_bytes))
    data = -(-(HEADER_BYTES + slots * ENTRY_BYTES) // HEADER_BYTES) * HEADER_BYTES
    while slots and data + slots * slot_bytes > total:
        slots -= 1
        data = -(-(HEADER_BYTES + slots * ENTRY_BYTES) // HEADER_BYTES) * HEADER_BYTES
    if slots < MAX_PROBE:
        raise ValueError(f"{total} bytes hold {slots} slots of {slot_bytes} bytes; an index needs at least {MAX_PROBE}")
    return slots, data


class KvIndex:
    """The index in ``buf`` (its header already written: ``KvIndex.format``)."""

    def __init__(self, buf: object, cas: Cas) -> None:
        self.buf = memoryview(buf).cast("B")  # type: ignore[arg-type]
        if len(self.buf) < HEADER_BYTES:
            raise IndexFormatError(f"an index needs at least {HEADER_BYTES} bytes, got {len(self.buf)}")
        self.words = np.frombuffer(self.buf, dtype=np.uint64)
        self.cas = cas
        w = self.words
        if int(w[H_MAGIC]) != MAGIC or int(w[H_VERSION]) != VERSION:
            raise IndexFormatError(f"no KV index here (magic {int(w[H_MAGIC]):#x}, version {int(w[H_VERSION])})")
        self.slots, self.slot_bytes = int(w[H_SLOTS]), int(w[H_SLOT_BYTES])
        self.table, self.data = int(w[H_TABLE]), int(w[H_DATA])
        self.base_dpa, self.hosts, self.max_probe = int(w[H_BASE_DPA]), int(w[H_HOSTS]), int(w[H_PROBE])
        if int(w[H_TOTAL]) > len(self.buf) or self.data + self.slots * self.slot_bytes > int(w[H_TOTAL]):
            raise IndexFormatError(f"the index claims {int(w[H_TOTAL])} bytes; {len(self.buf)} are mapped")
        self.table_words = w[self.table // 8:(self.table + self.slots * ENTRY_BYTES) // 8].reshape(
            self.slots, ENTRY_WORDS)

    @classmethod
    def format(cls, buf: object, cas: Cas, *, base_dpa: int, slot_bytes: int, hosts: int,
               quota: int = 0, policy: str = "") -> "KvIndex":
        """Write an empty index over all of ``buf`` (zeroing it); ``quota``: the unshared bytes each
        host may hold (0: the data area divided by ``hosts``); ``policy``: the firmware's eviction
        policy, kept in the header (``check_policy``; "" leaves the firmware's default)."""
        mv = memoryview(buf).cast("B")  # type: ignore[arg-type]
        if not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"an index serves 1..{MAX_HOSTS} hosts, got {hosts}")
        text = check_policy(policy).encode() if policy else b""
        slots, data = layout_slots(len(mv), slot_bytes)
        mv[:data] = bytes(data)
        mv[POLICY_AT:POLICY_AT + len(text)] = text
        quota = quota or slots * slot_bytes // hosts
        words = np.frombuffer(mv, dtype=np.uint64)
        for i, v in ((H_VERSION, VERSION), (H_SLOTS, slots), (H_SLOT_BYTES, slot_bytes), (H_TABLE, HEADER_BYTES),
                     (H_DATA, data), (H_TOTAL, len(mv)), (H_BASE_DPA, base_dpa), (H_PROBE, MAX_PROBE),
                     (H_HOSTS, hosts)):
            words[i] = v
        for h in range(hosts):
            words[(HOST_TABLE + h * HOST_BYTES) // 8 + HS_QUOTA] = quota
        words[H_MAGIC] = MAGIC  # last: an index is valid once its magic is there
        return cls(buf, cas)

    @property
    def policy(self) -> str:
        """The eviction policy's spec the index was formatted with ("": the firmware's default)."""
        return bytes(self.buf[POLICY_AT:POLICY_AT + POLICY_BYTES]).rstrip(b"\0").decode("utf-8", "replace")

    # words ----------------------------------------------------------------------------------------
    def _ew(self, slot: int, field: int) -> int:
        return self.table // 8 + slot * ENTRY_WORDS + field

    def word(self, slot: int, field: int = E_STATE) -> int:
        return int(self.words[self._ew(slot, field)])

    def _hw(self, host: int, field: int) -> int:
        return (HOST_TABLE + host * HOST_BYTES) // 8 + field

    def host_field(self, host: int, field: int) -> int:
        return int(self.words[self._hw(host, field)])

    def set_host_field(self, host: int, field: int, value: int) -> None:
        """A plain store of a field one party alone writes (pid and start: the host; the usage: the firmware)."""
        self.words[self._hw(host, field)] = value

    def add_host_field(self, host: int, field: int, by: int = 1) -> None:
        """Add to a counter of the host record by CAS (the host's hit counts: the firmware and
        monitors read them while the host adds)."""
        at = self._hw(host, field)
        while True:
            v = int(self.words[at])
            if self.cas(at, v, (v + by) & (1 << 64) - 1):
                return

    def cas_host_state(self, host: int, expect: int, value: int) -> bool:
        return self.cas(self._hw(host, HS_STATE), expect, value)

    def bump(self, counter: int, by: int = 1) -> None:
        """Add to a header counter (the firmware's alone)."""
        self.words[counter] = int(self.words[counter]) + by

    def key_of(self, slot: int) -> bytes:
        off = self.table + slot * ENTRY_BYTES + 16
        return bytes(self.buf[off:off + KEY_BYTES])

    def block_dpa(self, slot: int) -> int:
        return self.base_dpa + self.data + slot * self.slot_bytes

    # probing ----------------------------------------------------------------------------------------
    def home(self, key: bytes) -> int:
        return int.from_bytes(key[FP_BYTES:FP_BYTES + 8], "little") ^ int.from_bytes(key[:8], "little")

    def probe(self, key: bytes) -> range:
        """The slots (mod ``slots``) a key may live in, in order."""
        start = self.home(key) % self.slots
        return range(start, start + self.max_probe)

    def lookup(self, key: bytes) -> tuple[int, int] | None:
        """(slot, state word) of a SEALED entry holding ``key``; stops at the first FREE slot."""
        for i in self.probe(key):
            slot = i % self.slots
            w = self.word(slot)
            kind = kind_of(w)
            if kind == FREE:
                return None
            if kind == SEALED and self.key_of(slot) == key and self.word(slot) == w:
                return slot, w
        return None

    def reserve(self, key: bytes, host: int, gen: int) -> tuple[str, int, int]:
        """Claim a slot for publishing ``key``: ("ok", slot, ALLOC word), ("present", slot, word)
        when a sealed or allocated entry holds it, ("full", -1, 0) when no slot of its window is free."""
        for _ in range(4):  # a lost CAS race rescans
            candidate, cword = -1, 0
            for i in self.probe(key):
                slot = i % self.slots
                w = self.word(slot)
                kind = kind_of(w)
                if kind in (SEALED, ALLOC) and self.key_of(slot) == key:
                    return "present", slot, w
                if kind in (FREE, TOMB) and candidate < 0:
                    candidate, cword = slot, w
                if kind == FREE:
                    break
            if candidate < 0:
                return "full", -1, 0
            alloc = entry_word(ALLOC, host, gen, seq_of(cword) + 1)
            if self.cas(self._ew(candidate, E_STATE), cword, alloc):
                return "ok", candidate, alloc
        return "full", -1, 0

    # publish ----------------------------------------------------------------------------------------
    def fill(self, slot: int, key: bytes, length: int, crc: int) -> None:
        """The owner of an ALLOC entry writes its key and fields (no one else writes them now)."""
        off = self.table + slot * ENTRY_BYTES
        self.buf[off + 16:off + 16 + KEY_BYTES] = key
        for field, v in ((E_DPA, self.block_dpa(slot)), (E_LENGTH, length), (E_CRC, crc), (E_LAST_USE, 0),
                         (E_READERS, 0)):
            self.words[self._ew(slot, field)] = v

    def seal(self, slot: int, alloc: int) -> int | None:
        """ALLOC -> SEALED: the one store that makes the entry visible. The sealed word, or None
        when the entry is no longer this allocation (its host was reaped)."""
        sealed = (alloc & ~0xF) | SEALED
        return sealed if self.cas(self._ew(slot, E_STATE), alloc, sealed) else None

    def abort(self, slot: int, alloc: int) -> bool:
        """ALLOC -> TOMB: give up a publish (never leave an ALLOC behind)."""
        return self.cas(self._ew(slot, E_STATE), alloc, (alloc & ~0xF) | TOMB)

    # readers ------------------------------------------------------------------------------------------
    def pin(self, slot: int, sealed: int, host: int) -> bool:
        """Add one to ``host``'s pin byte, then check the entry is still ``sealed``; False (and no
        pin) when it is not, or the byte is full."""
        at, shift = self._ew(slot, E_PINS), 8 * host
        while True:
            p = int(self.words[at])
            if (p >> shift) & 0xFF == 0xFF:
                return False
            if self.cas(at, p, p + (1 << shift)):
                break
        if self.word(slot) == sealed:
            return True
        self.unpin(slot, host)
        return False

    def unpin(self, slot: int, host: int) -> bool:
        """Take one from ``host``'s pin byte; False when it was already 0 (the firmware cleared it)."""
        at, shift = self._ew(slot, E_PINS), 8 * host
        while True:
            p = int(self.words[at])
            if (p >> shift) & 0xFF == 0:
                return False
            if self.cas(at, p, p - (1 << shift)):
                return True

    def entry_matches(self, slot: int, sealed: int, key: bytes, length: int, crc: int) -> bool:
        """Whether the pinned entry still is ``sealed`` and holds this key, length and checksum."""
        return (self.word(slot) == sealed and self.key_of(slot) == key and self.word(slot, E_LENGTH) == length
                and self.word(slot, E_CRC) == crc and self.word(slot, E_DPA) == self.block_dpa(slot))

    def touch(self, slot: int, host: int, now: int) -> None:
        """Note a use: ``last_use`` raised to ``now``, ``host`` added to the readers."""
        for field, f in ((E_LAST_USE, lambda v: max(v, now)), (E_READERS, lambda v: v | 1 << host)):
            at = self._ew(slot, field)
            for _ in range(8):  # a lost race to another reader's touch is worth a few retries, no more
                v = int(self.words[at])
                if f(v) == v or self.cas(at, v, f(v)):
                    break

    # the firmware ---------------------------------------------------------------------------------------
    def try_evict(self, slot: int, sealed: int) -> bool:
        """SEALED -> EVICTING, then pins checked: 0 -> TOMB (True), else back to SEALED."""
        at = self._ew(slot, E_STATE)
        evicting = (sealed & ~0xF) | EVICTING
        if not self.cas(at, sealed, evicting):
            return False
        if int(self.words[self._ew(slot, E_PINS)]) != 0:
            self.cas(at, evicting, sealed)
            return False
        return self.cas(at, evicting, (sealed & ~0xF) | TOMB)

    def sweep(self) -> int:
        """Tombstones that end a probe chain become FREE again (a TOMB followed by a FREE slot, then
        the TOMBs before it), so misses stop early: a FREE slot after them means no entry's chain
        runs through them. Returns the slots freed."""
        states = self.table_words[:, E_STATE]
        kinds = states & 0xF
        ends = np.flatnonzero((kinds == TOMB) & (np.roll(kinds, -1) == FREE))
        freed = 0
        for end in map(int, ends):
            i = end
            for _ in range(self.slots - 1):
                w = int(states[i])
                if kind_of(w) != TOMB or not self.cas(self._ew(i, E_STATE), w, (w & ~0xF) | FREE):
                    break
                freed += 1
                i = (i - 1) % self.slots
        return freed

    def reap(self, host: int, keep_gen: int | None = None) -> tuple[int, int]:
        """Drop what ``host`` holds: its ALLOC entries (those of generations other than
        ``keep_gen``) go to TOMB, and (``keep_gen`` None) its pin byte is cleared everywhere.
        Returns (allocations dropped, pin bytes cleared)."""
        states = self.table_words[:, E_STATE]
        kinds, owners, gens = states & 0xF, (states >> 4) & 0xF, (states >> 8) & 0xFFFF_FFFF
        mine = (kinds == ALLOC) & (owners == host)
        if keep_gen is not None:
            mine &= gens != keep_gen
        allocs = sum(self.abort(int(s), int(states[s])) for s in np.flatnonzero(mine))
        cleared = 0
        if keep_gen is None:
            shift = np.uint64(8 * host)
            for s in np.flatnonzero((self.table_words[:, E_PINS] >> shift) & np.uint64(0xFF)):
                at = self._ew(int(s), E_PINS)
                while True:
                    p = int(self.words[at])
                    if self.cas(at, p, p & ~(0xFF << 8 * host)):
                        break
                cleared += 1
        return allocs, cleared
