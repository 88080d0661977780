"""`cxlemu bench pool --races`: several hosts race on the shared KV pool, every load checked.

The firmware runs in its own process (``cxlemu serve --hosts P+1 --dc-region 256M`` on a private
device); port P is the fabric manager's, which creates the pool (``fm_create_pool``: an index of
``--pool-size`` bytes, 4 KiB slots) and offers it to ports 0..P-1. P host processes (multiprocessing
"spawn") each open their port and the pool and run their share of the operations, choosing at
random (seeded per host): publish 30 %, lookup 20 %, load 50 %, of a key drawn 70 % of the time
from a hot set of half the slots and otherwise from four times the slots, so the firmware evicts
all run long (eviction pressure) and per-host quotas bite.

Every key's payload is derived from it: its first 8 bytes are the key's number, the rest a
blake2b stream of it, its length one of 8 sizes. So every load the pool reports a hit for is
checked here too, independently of the pool's own crc: a block of another key is **stale**, the
right key with wrong bytes is **torn** (the pool's own refusals of a mismatch count as torn as
well: a reader must never see anything but a sealed, immutable entry).

Half-way through (by the hosts' progress), the fabric manager force-releases the last host's
kv-index extent and offers it again: that host's operations fail with ``PoolRevoked`` (not
counted as operations), it opens the pool again (accepting the new offer) and goes on.

At the end, after the hosts closed the pool and one firmware interval more, the index is audited
through the fabric manager's mapping of the media: every entry ALLOC or EVICTING, every pin
left, every host record not IDLE is a **leaked allocation**, and every sealed entry's payload is
checked against its crc (a mismatch is torn). Reported: ``{ops, stale, torn, leaked_allocations,
wall_s}`` and the counts behind them. Not measured: vLLM (``cxlemu bench pool`` without
``--races``), timing of the media (payloads go by the timed data path, but the figure is the
operations' correctness, not their speed).
"""
from __future__ import annotations

import hashlib
import os
import queue
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from tools.bench.mailbox import SoakError, served_subprocess

__all__ = ["RacesResult", "payload", "run_races", "validate"]

SLOT_BYTES = 4096
BENCH_FP = ("bench-pool", "uint8", 16, 1, 1, 64)  # a Fingerprint's fields
MAX_PROCESSES = 7  # + the fabric manager's port: the index serves 8 hosts
READY_TIMEOUT_S = 120.0
REJOIN_TIMEOUT_S = 30.0
PUBLISH, LOOKUP = 0.3, 0.5  # cumulative shares of the operations; the rest are loads
HOT_SHARE = 0.7


def block_hash(k: int) -> bytes:
    return hashlib.sha256(b"races %d" % k).digest()


def payload(k: int) -> bytes:
    """Key ``k``'s block: its number, then a stream only it has; 512..3648 bytes."""
    size = 512 + (k % 8) * 448
    stream = hashlib.blake2b(k.to_bytes(8, "little"), digest_size=64).digest() * (size // 64 + 1)
    return (k.to_bytes(8, "little") + stream)[:size]


def classify(k: int, got: bytes) -> str:
    """"ok", "stale" (another key's block) or "torn" (the key's block, bytes wrong)."""
    want = payload(k)
    if got[:len(want)] == want:
        return "ok"
    return "torn" if got[:8] == want[:8] else "stale"


@dataclass
class RacesResult:
    ops: int
    stale: int
    torn: int
    leaked_allocations: int
    wall_s: float
    processes: int
    loads_checked: int = 0
    published: int = 0
    hits: int = 0
    misses: int = 0
    pool_torn: int = 0
    evicted_seen: int = 0  # loads that found their entry evicted between lookup and pin
    present: int = 0  # publishes refused: the key was there already
    no_room: int = 0  # publishes refused: no free slot near the key's home, or over the host's quota
    revocations: int = 0
    evictions: int = 0
    quota_evictions: int = 0
    reaped_allocations: int = 0
    cleared_pins: int = 0
    sealed_audited: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.stale or self.torn or self.leaked_allocations or self.errors)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def validate(*, processes: int, ops: int, pool_size: int) -> None:
    if not 1 <= processes <= MAX_PROCESSES:
        raise ValueError(f"--processes must be 1..{MAX_PROCESSES}, got {processes}")
    if ops < processes:
        raise ValueError(f"--ops must be at least --processes ({processes}), got {ops}")
    if pool_size < 2 << 20 or pool_size % (2 << 20) or pool_size > 256 << 20:
        raise ValueError(f"--pool-size must be a multiple of 2 MiB up to 256 MiB, got {pool_size}")


# --- a host process ---------------------------------------------------------------------------
def _rejoin(md: Any, pool: Any) -> Any:
    """The pool again after a revocation: wait for the new offer and accept it."""
    from driver.pool import KvPool, NoPool

    pool.close()
    deadline = time.monotonic() + REJOIN_TIMEOUT_S
    while True:
        try:
            return KvPool.open(md)
        except NoPool:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def _host(host: int, name: str, ops: int, seed: int, start: Any, results: Any) -> None:
    try:
        import numpy as np

        from driver import MemDev
        from driver.pool import Fingerprint, KvPool, PoolRevoked

        md = MemDev.open(name, host=host)
        pool = KvPool.open(md)
        slots = pool.index.slots
        hot, keys = slots // 2, 4 * slots
        rng = random.Random(seed * 1000 + host)
        fp = Fingerprint(*BENCH_FP)
        out = np.zeros(SLOT_BYTES, np.uint8)
        c: Counter[str] = Counter()
        every = max(100, ops // 20)
        results.put(("ready", host))
        start.wait()
        done = 0
        while done < ops:
            k = rng.randrange(hot) if rng.random() < HOT_SHARE else rng.randrange(keys)
            r = rng.random()
            try:
                if r < PUBLISH:
                    pool.publish(fp, block_hash(k), payload(k))
                elif r < LOOKUP:
                    pool.lookup(fp, block_hash(k))
                elif pool.load(fp, block_hash(k), out):
                    c[classify(k, out.tobytes())] += 1
            except PoolRevoked:
                c["revoked"] += 1
                c.update({f"pool_{k}": v for k, v in pool.stats().items()})  # the next handle counts anew
                pool = _rejoin(md, pool)
                continue
            done += 1
            if done % every == 0:
                results.put(("progress", host, done))
        c.update({f"pool_{k}": v for k, v in pool.stats().items()})
        pool.close()
        md.close()
        results.put(("done", host, {"ops": done, **dict(c)}))
    except Exception as exc:  # reported to the parent, which fails the run with it
        results.put(("error", host, f"host {host}: {type(exc).__name__}: {exc}"))


# --- the audit --------------------------------------------------------------------------------
def _audit(md: Any, dpa: int) -> dict[str, int]:
    """Leaks and sealed payloads, read through the media mapping (no host holds the index now)."""
    import numpy as np

    from emulator.timing.linkstate import WordCas
    from firmware_model import kv_index as K

    head = np.frombuffer(md.media[dpa:dpa + K.HEADER_BYTES], dtype=np.uint64)
    view = md.media[dpa:dpa + int(head[K.H_TOTAL])]
    cas = WordCas(view)
    idx = None
    try:
        idx = K.KvIndex(view, cas)
        tw = idx.table_words
        kinds = tw[:, K.E_STATE] & np.uint64(0xF)
        leaked = int(np.count_nonzero((kinds == K.ALLOC) | (kinds == K.EVICTING)))
        leaked += int(np.count_nonzero(tw[:, K.E_PINS]))
        leaked += sum(idx.host_field(h, K.HS_STATE) >> 32 != K.IDLE for h in range(idx.hosts))
        bad = 0
        sealed = np.flatnonzero(kinds == K.SEALED)
        for s in map(int, sealed):
            start, n = idx.block_dpa(s), idx.word(s, K.E_LENGTH)
            bad += K.checksum(md.media[start:start + n]) != idx.word(s, K.E_CRC)
        w = idx.words
        return {"leaked": leaked, "sealed_bad": bad, "sealed_audited": len(sealed),
                "evictions": int(w[K.H_EVICTIONS]), "quota_evictions": int(w[K.H_QUOTA_EVICTIONS]),
                "reaped_allocations": int(w[K.H_REAPED_ALLOCS]), "cleared_pins": int(w[K.H_CLEARED_PINS])}
    finally:
        del idx
        cas.release()


# --- the run ----------------------------------------------------------------------------------
def run_races(*, processes: int = 3, ops: int = 1_000_000, pool_size: int = 16 << 20, seed: int = 0,
              release: bool = True, progress: Callable[[str], None] | None = None) -> RacesResult:
    """The race bench (see the module docstring); ValueError on bad arguments, SoakError when it
    cannot run."""
    import multiprocessing as mp

    from driver import MemDev
    from firmware_model.kv_index import INDEX_TAG

    validate(processes=processes, ops=ops, pool_size=pool_size)
    say = progress or (lambda _msg: None)
    name = f"poolrace-{os.getpid()}-{random.randrange(1 << 32):08x}"
    ctx = mp.get_context("spawn")
    results, start = ctx.Queue(), ctx.Event()
    shares = [ops // processes + (i < ops % processes) for i in range(processes)]
    procs: dict[int, Any] = {}
    state: dict[str, Any] = {"ready": set(), "done": {}, "errors": [], "sent": dict.fromkeys(range(processes), 0)}

    def pump(until: Callable[[], bool], deadline: float) -> None:
        while not until():
            try:
                msg = results.get(timeout=0.05)
            except queue.Empty:
                msg = None
            if msg is not None:
                what, host = msg[:2]
                if what == "ready":
                    state["ready"].add(host)
                elif what == "progress":
                    state["sent"][host] = msg[2]
                elif what == "done":
                    state["done"][host] = msg[2]
                else:
                    state["errors"].append(msg[2])
                    state["done"][host] = {}
            for h, p in procs.items():
                if p.exitcode is not None and h not in state["done"] and msg is None:
                    state["errors"].append(f"host {h}: exited with {p.exitcode} without a report")
                    state["done"][h] = {}
            if time.monotonic() > deadline:
                raise SoakError(f"the race bench stalled: {len(state['done'])} of {processes} hosts done")

    fm_port = processes
    say(f"starting the firmware ({name}, {processes + 1} ports)")
    try:
        with served_subprocess(name, 256 << 20, ("--hosts", str(processes + 1), "--dc-region", "256M")):
            with MemDev.open(name, host=fm_port) as fm:
                dpa = fm.fm_create_pool(pool_size, hosts=list(range(processes)), slot_bytes=SLOT_BYTES)
                for h in range(processes):
                    procs[h] = ctx.Process(target=_host, name=f"poolrace-host{h}",
                                           args=(h, name, shares[h], seed, start, results))
                    procs[h].start()
                pump(lambda: len(state["ready"]) == processes or bool(state["errors"]),
                     time.monotonic() + READY_TIMEOUT_S)
                if state["errors"]:
                    raise SoakError("; ".join(state["errors"]))
                say(f"{processes} hosts x ~{shares[0]:,} operations")
                t0 = time.perf_counter()
                start.set()
                if release:
                    pump(lambda: sum(state["sent"].values()) >= ops // 2 or len(state["done"]) == processes,
                         time.monotonic() + 3600)
                    victim = processes - 1
                    say(f"releasing host {victim}'s kv-index extent and offering it again")
                    fm.fm_release(victim, 0, [(dpa, pool_size)], INDEX_TAG, forced=True)
                    time.sleep(0.05)
                    fm.fm_add(victim, 0, [(dpa, pool_size)], INDEX_TAG)
                pump(lambda: len(state["done"]) == processes, time.monotonic() + 3600)
                wall = time.perf_counter() - t0
                time.sleep(0.1)  # one firmware interval and more: what it reaps is part of the protocol
                audit = _audit(fm, dpa)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.terminate()
            p.join(timeout=10)
    return _result(processes, wall, state, audit)


def _result(processes: int, wall: float, state: dict[str, Any], audit: dict[str, int]) -> RacesResult:
    done = state["done"].values()
    total = Counter()
    for d in done:
        total.update(d)
    return RacesResult(ops=total["ops"], stale=total["stale"], torn=total["torn"] + total["pool_torn"] + audit["sealed_bad"],
                       leaked_allocations=audit["leaked"], wall_s=round(wall, 3), processes=processes,
                       loads_checked=total["ok"] + total["stale"] + total["torn"], published=total["pool_published"],
                       hits=total["pool_hits"], misses=total["pool_misses"], pool_torn=total["pool_torn"],
                       evicted_seen=total["pool_evicted_seen"], present=total["pool_present"],
                       no_room=total["pool_no_room"],
                       revocations=total["revoked"], evictions=audit["evictions"],
                       quota_evictions=audit["quota_evictions"], reaped_allocations=audit["reaped_allocations"],
                       cleared_pins=audit["cleared_pins"], sealed_audited=audit["sealed_audited"],
                       errors=state["errors"])
