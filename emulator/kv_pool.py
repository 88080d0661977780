"""The device's side of the shared KV pool (docs/pool-design.md section 3): the firmware creates
and formats the index, watches the hosts that use it, and alone evicts.

The index (``firmware_model.kv_index``) lives in the media, in the Dynamic Capacity extent tagged
``kv-index``; vendor command C003h (``create``) offers that extent to the chosen hosts and formats
it. Nothing about it is kept outside the media and the DC state, so a restarted firmware finds it
again (``_attach``) with every sealed block in place. Every ``INTERVAL_NS`` the service:

- **watches the hosts**: a host record LIVE whose process died (pid and start time in the record,
  as liveness checks firmware.pid) or whose port no longer holds the extent goes IDLE; a JOINING
  one is cleaned and admitted (LIVE); every IDLE host's ALLOC entries go to TOMB and its pin byte
  is cleared (a revoked host that is still running can leave no pin behind), and a LIVE host's
  ALLOC entries of an older generation are dropped;
- **evicts**: its ``firmware_model.policies`` policy keeps every sealed entry (synced from the
  table's rows that changed since the last pass); a host holding more unshared bytes than its
  quota's ``HIGH`` loses its own unpinned blocks down to ``LOW`` of it first (publish refuses past
  the quota itself), then the pool is brought below ``LOW`` of its slots once it passes ``HIGH``.
  Each victim goes SEALED -> EVICTING by CAS, then pins are checked;
- **sweeps**: tombstones that end a probe chain become FREE again (``KvIndex.sweep``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from emulator import liveness
from emulator.timing.linkstate import WordCas
from firmware_model import kv_index as K
from firmware_model.policies import EvictionPolicy, NoVictimError, make_policy

if TYPE_CHECKING:
    from emulator.firmware import Firmware

__all__ = ["HIGH", "INDEX_TAG", "INTERVAL_NS", "KvPoolService", "LOW", "POLICY"]

INDEX_TAG = K.INDEX_TAG.ljust(16, b"\0")  # as a DC extent's 16-byte tag
INTERVAL_NS = 20_000_000  # as liveness's watch: a dead host's pins are gone within 100 ms
HIGH, LOW = 7 / 8, 3 / 4  # evict once live entries pass HIGH of the slots, down to LOW
POLICY = "lru"
MAX_EVICT_PER_PASS = 512  # bounds one pass; the next one goes on


def _pkey(slot: int, word: int) -> int:
    """The policy's key of one life of a slot (a state word alone repeats across slots)."""
    return slot << 64 | word


class _Except:
    """``protected`` for a policy: every key but ``allowed``."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed

    def __contains__(self, key: object) -> bool:
        return key not in self.allowed


class KvPoolService:
    """``fw.kv_pool``: the index's extent, its host watch and its eviction (a firmware service)."""

    def __init__(self, fw: Firmware) -> None:
        self.fw = fw
        self.index: K.KvIndex | None = None
        self.extent: tuple[int, int] | None = None  # (dpa, length) of the index
        self._cas: WordCas | None = None
        self._next_ns = 0
        self._policy: EvictionPolicy | None = None
        self._resident: dict[int, int] = {}  # slot -> the sealed word the policy holds (its key: _pkey)
        self._prev: np.ndarray | None = None  # state and last_use columns of the last pass
        self._passes = 0

    # the extent -------------------------------------------------------------------------------------
    def find_extent(self) -> int | None:
        """DPA of the extent tagged kv-index that a port holds or is offered, or None."""
        for port in self.fw.dcd.ports:
            for e in port.accepted + port.pending:
                if e.tag == INDEX_TAG:
                    return e.start_dpa
        return None

    def holds(self, host: int) -> bool:
        """Whether ``host``'s port holds (accepted) the index's first block."""
        assert self.extent is not None
        return any(e.tag == INDEX_TAG and e.start_dpa <= self.extent[0] < e.end
                   for e in self.fw.dcd.ports[host].accepted)

    def create(self, dpa: int, length: int, slot_bytes: int, quota: int, policy: str = POLICY) -> None:
        """Format an empty index over [dpa, dpa + length) of the media, evicted by ``policy`` (kept
        in its header, so a restarted firmware evicts by it too); ValueError if it cannot hold one."""
        self.detach()
        view = self.fw.media[dpa:dpa + length]
        cas = WordCas(view)
        try:
            K.KvIndex.format(view, cas, base_dpa=dpa, slot_bytes=slot_bytes, hosts=len(self.fw.ports), quota=quota,
                             policy=policy)
        finally:
            cas.release()

    def _attach(self) -> K.KvIndex | None:
        dpa = self.find_extent()
        if dpa is None:
            self.detach()
            return None
        if self.index is not None and self.extent is not None and self.extent[0] == dpa:
            if int(self.index.words[K.H_MAGIC]) == K.MAGIC:
                return self.index
            self.detach()  # the media was erased under it (sanitize): no index there now
            return None
        self.detach()
        head = np.frombuffer(self.fw.media[dpa:dpa + K.HEADER_BYTES], dtype=np.uint64)
        if int(head[K.H_MAGIC]) != K.MAGIC:
            return None
        length = int(head[K.H_TOTAL])
        view = self.fw.media[dpa:dpa + length]
        self._cas = WordCas(view)
        try:
            self.index = K.KvIndex(view, self._cas)
        except K.IndexFormatError:
            self.detach()
            return None
        self.extent = (dpa, length)
        self._recover(self.index)
        return self.index

    def detach(self) -> None:
        self.index, self.extent, self._prev, self._policy = None, None, None, None
        self._resident = {}
        if self._cas is not None:
            self._cas.release()
            self._cas = None

    @staticmethod
    def _recover(idx: K.KvIndex) -> None:
        """Entries a killed firmware left EVICTING go back to SEALED (only the firmware evicts)."""
        states = idx.table_words[:, K.E_STATE]
        for s in np.flatnonzero(states & np.uint64(0xF) == K.EVICTING):
            w = int(states[s])
            idx.cas(idx._ew(int(s), K.E_STATE), w, (w & ~0xF) | K.SEALED)

    # the service -------------------------------------------------------------------------------------
    def __call__(self, now_ns: int) -> bool:
        if now_ns < self._next_ns:
            return False
        self._next_ns = now_ns + INTERVAL_NS
        idx = self._attach()
        if idx is None:
            return False
        self.watch_hosts(idx)
        self.evict(idx)
        idx.sweep()
        self._passes += 1
        idx.words[K.H_PASSES] = self._passes
        return False  # periodic work: the runner's naps stay as they are

    def _alive(self, idx: K.KvIndex, host: int) -> bool:
        pid, started = idx.host_field(host, K.HS_PID), idx.host_field(host, K.HS_START)
        return liveness.process_alive(pid, started if started < 1 << 62 else -1)

    def watch_hosts(self, idx: K.KvIndex) -> None:
        """Each host record's phase moved on as its process and its extent say; what a host no
        longer LIVE holds is dropped (see the module's docstring)."""
        for h in range(min(idx.hosts, len(self.fw.ports))):
            word = idx.host_field(h, K.HS_STATE)
            phase, gen = word >> 32, word & 0xFFFF_FFFF
            ok = phase != K.IDLE and self.holds(h) and self._alive(idx, h)
            if phase == K.JOINING:
                self._reap(idx, h, None)
                idx.cas_host_state(h, word, K.host_word(gen, K.LIVE if ok else K.IDLE))
            elif phase == K.LIVE and not ok:
                idx.cas_host_state(h, word, K.host_word(gen, K.IDLE))
                self._reap(idx, h, None)
            else:
                self._reap(idx, h, gen if phase == K.LIVE else None)

    @staticmethod
    def _reap(idx: K.KvIndex, host: int, keep_gen: int | None) -> None:
        allocs, pins = idx.reap(host, keep_gen)
        if allocs:
            idx.bump(K.H_REAPED_ALLOCS, allocs)
        if pins:
            idx.bump(K.H_CLEARED_PINS, pins)

    # eviction ------------------------------------------------------------------------------------------
    def _sync_policy(self, idx: K.KvIndex, cols: np.ndarray) -> EvictionPolicy:
        """The policy told of every row whose state or last use changed since the last pass."""
        if self._policy is None or self._prev is None:
            self._policy = self._make_policy(idx)
            self._prev = np.zeros_like(cols)
            self._resident = {}
        policy = self._policy
        changed = np.flatnonzero((cols != self._prev).any(axis=1))
        for s in map(int, changed[np.argsort(cols[changed, 1], kind="stable")]):  # in order of use
            word = int(cols[s, 0])
            old = self._resident.get(s)
            if old is not None and old != word:
                policy.remove(_pkey(s, old))
                del self._resident[s]
                old = None
            if K.kind_of(word) != K.SEALED:
                continue
            if old is None:
                policy.insert(_pkey(s, word), self._passes)
                self._resident[s] = word
            else:
                policy.touch(_pkey(s, word), self._passes)
        self._prev = cols
        return policy

    @staticmethod
    def _make_policy(idx: K.KvIndex) -> EvictionPolicy:
        """The policy the index names (an index of before the field: ``POLICY``). One that no longer
        imports here (a firmware restarted without its module on the path) falls back to ``POLICY``:
        the pool goes on evicting rather than filling up."""
        try:
            return make_policy(idx.policy or POLICY, idx.slots)
        except (ValueError, TypeError):
            return make_policy(POLICY, idx.slots)

    @property
    def policy(self) -> EvictionPolicy | None:
        """The eviction policy in use (built at the first pass over an index), or None."""
        return self._policy

    def evict(self, idx: K.KvIndex) -> None:
        tw = idx.table_words
        cols = np.stack([tw[:, K.E_STATE], tw[:, K.E_LAST_USE]], axis=1)
        policy = self._sync_policy(idx, cols)
        states = cols[:, 0]
        kinds, owners = states & np.uint64(0xF), (states >> np.uint64(4)) & np.uint64(0xF)
        sealed = kinds == K.SEALED
        unpinned = tw[:, K.E_PINS] == 0
        unshared = sealed & ((tw[:, K.E_READERS] & ~(np.uint64(1) << owners)) == 0)
        budget = MAX_EVICT_PER_PASS
        for h in range(idx.hosts):
            mine = unshared & (owners == h)
            held = int(tw[mine, K.E_LENGTH].sum())
            quota = idx.host_field(h, K.HS_QUOTA)
            over = held - int(LOW * quota) if held > HIGH * quota else 0
            if over > 0:
                freed, n = self._evict_from(idx, policy, np.flatnonzero(mine & unpinned), over, budget)
                held -= freed
                budget -= n
                idx.bump(K.H_QUOTA_EVICTIONS, n)
            idx.set_host_field(h, K.HS_UNSHARED, held)
        live = int(np.count_nonzero((kinds != K.FREE) & (kinds != K.TOMB)))
        if live > HIGH * idx.slots:
            _, n = self._evict_from(idx, policy, np.flatnonzero(sealed & unpinned), None,
                                    min(budget, live - int(LOW * idx.slots)))
            live -= n
        idx.words[K.H_LIVE_ENTRIES] = live

    def _evict_from(self, idx: K.KvIndex, policy: EvictionPolicy, rows: np.ndarray, free_bytes: int | None,
                    most: int) -> tuple[int, int]:
        """Evict the policy's victims among ``rows`` until ``free_bytes`` are freed (None: ``most``
        entries). Returns (bytes freed, entries evicted)."""
        allowed = {_pkey(int(s), self._resident[int(s)]) for s in rows if int(s) in self._resident}
        protected = _Except(allowed)
        freed = n = 0
        while n < most and (free_bytes is None or freed < free_bytes) and allowed:
            try:
                pkey = policy.evict(protected)
            except NoVictimError:
                break
            allowed.discard(pkey)
            slot, word = pkey >> 64, self._resident.pop(pkey >> 64)
            length = idx.word(slot, K.E_LENGTH)
            if not idx.try_evict(slot, word):
                if idx.word(slot) == word:  # pinned meanwhile: still resident
                    policy.insert(pkey, self._passes)
                    self._resident[slot] = word
                continue
            owner = (word >> 4) & 0xF
            idx.set_host_field(owner, K.HS_EVICTED, idx.host_field(owner, K.HS_EVICTED) + 1)
            idx.bump(K.H_EVICTIONS)
            freed += length
            n += 1
        return freed, n
