"""`cxlemu bench mailbox`: a cross-process soak of the mailbox, every answer checked.

The firmware runs in its own process (``cxlemu serve`` on a private device with a unique name),
N host processes (multiprocessing "spawn") each open it with ``MemDev.open`` and send their
share of the commands through the raw path ``md.send`` (a return code never raises), and
``--load-procs`` more processes run timed ``md.write`` / ``md.read_into`` at random DPAs until
the hosts are done, checking every block read back. The device is stopped (SIGTERM) and
destroyed at the end, also on failure or Ctrl-C.

Every command's correct answer is known exactly and differs from its neighbours', so a stale
answer (the firmware never ran the command and the host read the previous command's return code,
with its own input payload as "output" — what the mailbox did before register stores were single
stores) is caught whatever the previous command was. Each host picks its next command at random
(seeded per host), never the kind it just sent:

* ``identify``         Identify (0x0001): retcode 0, the payload read once before the hosts start;
* ``identify_memdev``  Identify Memory Device (0x4000): retcode 0, likewise constant;
* ``unsupported``      opcode 0x00FF (in no command table) with 100 random bytes: Unsupported, no output;
* ``get_lsa``          Get LSA of a random slice (>= 16 B) of the 1 KiB of the label storage area
                       the host wrote with its own random pattern (Set LSA) at start: that slice;
* ``get_timestamp``    Get Timestamp: 8 bytes, non-decreasing per host, and within the window the
                       one Set Timestamp before the run allows (the device counts on from it on
                       CLOCK_MONOTONIC, which every process shares).

Report: commands sent, wrong answers (total and per kind, the first few as opcode / expected /
got), data-path mismatches, wall seconds and commands/s. Exit 1 on any wrong answer, mismatch or
host error, else 0.

The server's command line is ``python -m tools.cli.main serve --name NAME --capacity CAP``. The
environment variable ``CXLEMU_BENCH_SERVER_ARGV`` (split like a shell line) replaces its prefix
``python -m tools.cli.main``: an experiment can run the firmware under a wrapper (e.g. one that
monkeypatches the register file back to an older version) without touching the tree. It is for
such experiments only; the report names the server command it used.
"""
from __future__ import annotations

import contextlib
import os
import queue
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SERVER_ARGV_ENV = "CXLEMU_BENCH_SERVER_ARGV"
KINDS = ("identify", "identify_memdev", "unsupported", "get_lsa", "get_timestamp")
OP_IDENTIFY, OP_GET_TIMESTAMP, OP_SET_TIMESTAMP = 0x0001, 0x0300, 0x0301
OP_IDENTIFY_MEMDEV, OP_GET_LSA, OP_SET_LSA = 0x4000, 0x4102, 0x4103
UNSUPPORTED_OPCODE = 0x00FF
UNSUPPORTED_PAYLOAD = 100
RC_SUCCESS, RC_UNSUPPORTED = 0x00, 0x03  # emulator.spec.retcodes.RetCode (checked in _setup)
LSA_REGION = 1024        # bytes of the label storage area each host owns (host i at i * LSA_REGION)
LSA_MIN_SLICE = 16       # never 8: a stale Get LSA "answers" its own 8-byte input
MAX_HOSTS = 64           # 64 KiB of the default 128 KiB LSA
MAX_SAMPLES = 5          # wrong answers recorded per process
PROGRESS_EVERY = 20_000  # a host reports its count this often
SERVER_START_S = 60.0
READY_TIMEOUT_S = 120.0  # spawned processes import numpy, cffi, ... on a busy 2-core host


class SoakError(Exception):
    """The soak could not run (the server did not come up, a process never got ready)."""


@dataclass
class SoakResult:
    requested: int
    commands: int                      # sent and answered
    hosts: int
    load_procs: int
    wrong: int
    wrong_by_kind: dict[str, int]
    commands_by_kind: dict[str, int]
    samples: list[dict[str, Any]]      # the first wrong answers: host, kind, opcode, expected, got
    data_ops: int                      # write + read-back pairs
    data_bytes: int                    # bytes written and read back (each)
    data_mismatches: int
    data_samples: list[dict[str, Any]]
    errors: list[str]                  # a process that failed (exception, died)
    wall_s: float
    commands_per_s: float
    seed: int
    server_argv: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (self.wrong == 0 and self.data_mismatches == 0 and not self.errors
                and self.commands == self.requested)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


# --- what each command must answer -----------------------------------------------------------
def _describe(rc: int, out: bytes) -> str:
    head = out[:24].hex()
    return f"rc {rc:#04x}, {len(out)} B" + (f" {head}{'...' if len(out) > 24 else ''}" if out else "")


def _host(index: int, name: str, count: int, seed: int, expected: dict[str, Any],
          start: Any, results: Any) -> None:
    """One host process: Set LSA its pattern, then ``count`` checked commands after ``start``."""
    try:
        _host_body(index, name, count, seed, expected, start, results)
    except KeyboardInterrupt:
        pass
    except BaseException as exc:  # a mailbox timeout, a dead firmware: reported, not hung on
        results.put(("error", "host", index, f"host {index}: {type(exc).__name__}: {exc}"))


def _host_body(index: int, name: str, count: int, seed: int, expected: dict[str, Any],
               start: Any, results: Any) -> None:
    from driver import MemDev
    from emulator.spec.payloads_memdev import GET_LSA, SET_LSA

    rng = random.Random(f"{seed}:host:{index}")
    base = index * LSA_REGION
    pattern = rng.randbytes(LSA_REGION)
    ident, ident_md = expected["identify"], expected["identify_memdev"]
    t0_ns, set_lo, set_hi = expected["timestamp"]
    sent = 0
    by_kind = dict.fromkeys(KINDS, 0)
    wrong = dict.fromkeys(KINDS, 0)
    samples: list[dict[str, Any]] = []
    with MemDev.open(name) as md:
        rc, out = md.send(OP_SET_LSA, SET_LSA.pack(offset=base) + pattern)
        if rc != 0:
            raise RuntimeError(f"Set LSA of [{base:#x}, +{LSA_REGION}) returned {rc:#04x}")
        rc, out = md.send(OP_GET_LSA, GET_LSA.pack(offset=base, length=LSA_REGION))
        if rc != 0 or out != pattern:
            raise RuntimeError(f"Get LSA after Set LSA: {_describe(rc, out)}")
        results.put(("ready", "host", index))
        start.wait()
        send = md.send
        last_ts = 0
        prev = None
        kinds = list(KINDS)
        t_start = time.perf_counter()
        for i in range(count):
            kind = rng.choice(kinds)
            while kind == prev:
                kind = rng.choice(kinds)
            prev = kind
            if kind == "identify":
                opcode, payload, want = OP_IDENTIFY, b"", ident
                rc, out = send(opcode, payload)
                bad = rc != RC_SUCCESS or out != want
            elif kind == "identify_memdev":
                opcode, payload, want = OP_IDENTIFY_MEMDEV, b"", ident_md
                rc, out = send(opcode, payload)
                bad = rc != RC_SUCCESS or out != want
            elif kind == "unsupported":
                opcode, payload, want = UNSUPPORTED_OPCODE, rng.randbytes(UNSUPPORTED_PAYLOAD), b""
                rc, out = send(opcode, payload)
                bad = rc != RC_UNSUPPORTED or out != b""
            elif kind == "get_lsa":
                off = rng.randrange(0, LSA_REGION - LSA_MIN_SLICE + 1)
                length = rng.randrange(LSA_MIN_SLICE, LSA_REGION - off + 1)
                opcode, payload, want = OP_GET_LSA, GET_LSA.pack(offset=base + off, length=length), \
                    pattern[off:off + length]
                rc, out = send(opcode, payload)
                bad = rc != RC_SUCCESS or out != want
            else:  # get_timestamp
                opcode, payload = OP_GET_TIMESTAMP, b""
                lo = time.monotonic_ns()
                rc, out = send(opcode, payload)
                hi = time.monotonic_ns()
                # device time = t0 + (now - when it took Set Timestamp), with now in [lo, hi]
                low, high = max(last_ts, t0_ns + lo - set_hi), t0_ns + hi - set_lo
                ts = int.from_bytes(out, "little") if len(out) == 8 else -1
                bad = rc != RC_SUCCESS or not low <= ts <= high
                want = f"rc 0x00, 8 B, t0 + [{low - t0_ns}, {high - t0_ns}] ns"
                if not bad:
                    last_ts = ts
            by_kind[kind] += 1
            sent += 1
            if bad:
                wrong[kind] += 1
                if len(samples) < MAX_SAMPLES:
                    samples.append({"host": index, "command": i, "kind": kind, "opcode": f"{opcode:#06x}",
                                    "expected": want if isinstance(want, str) else
                                    _describe(RC_UNSUPPORTED if kind == "unsupported" else RC_SUCCESS, want),
                                    "got": f"rc {rc:#04x}, 8 B, t0 + {ts - t0_ns} ns"
                                    if kind == "get_timestamp" and len(out) == 8 else _describe(rc, out)})
            if sent % PROGRESS_EVERY == 0:
                results.put(("progress", "host", index, sent))
        elapsed = time.perf_counter() - t_start
    results.put(("done", "host", index, {"sent": sent, "by_kind": by_kind, "wrong": wrong,
                                         "samples": samples, "elapsed_s": elapsed}))


def _load(index: int, name: str, lo: int, hi: int, block: int, seed: int,
          start: Any, stop: Any, results: Any) -> None:
    """One data-path process: timed write, timed read back, compare, until ``stop``."""
    try:
        _load_body(index, name, lo, hi, block, seed, start, stop, results)
    except KeyboardInterrupt:
        pass
    except BaseException as exc:
        results.put(("error", "load", index, f"load {index}: {type(exc).__name__}: {exc}"))


def _load_body(index: int, name: str, lo: int, hi: int, block: int, seed: int,
               start: Any, stop: Any, results: Any) -> None:
    import numpy as np

    from driver import MemDev

    rng = np.random.default_rng([seed, 0x10AD, index])
    blocks = [rng.integers(0, 256, block, dtype=np.uint8) for _ in range(8)]
    out = np.empty(block, dtype=np.uint8)
    slots = (hi - lo - block) // 64 + 1
    ops = mismatches = 0
    samples: list[dict[str, Any]] = []
    with MemDev.open(name) as md:
        results.put(("ready", "load", index))
        start.wait()
        while not stop.is_set():
            dpa = lo + 64 * int(rng.integers(0, slots))
            data = blocks[ops % len(blocks)]
            data[:8] = np.frombuffer(ops.to_bytes(8, "little"), dtype=np.uint8)  # no two writes alike
            md.write(dpa, data)
            out[:] = 0
            md.read_into(dpa, out)
            ops += 1
            if not np.array_equal(out, data):
                mismatches += 1
                if len(samples) < MAX_SAMPLES:
                    first = int(np.flatnonzero(out != data)[0])
                    samples.append({"load": index, "dpa": f"{dpa:#x}", "first_bad_byte": first,
                                    "expected": f"{int(data[first]):#04x}", "got": f"{int(out[first]):#04x}"})
    results.put(("done", "load", index, {"ops": ops, "mismatches": mismatches, "samples": samples}))


# --- the server ------------------------------------------------------------------------------
def server_argv(name: str, capacity: int, extra: tuple[str, ...] = ()) -> list[str]:
    """The server's command line (``CXLEMU_BENCH_SERVER_ARGV`` replaces its prefix); ``extra``:
    more ``serve`` arguments (``--hosts 3``)."""
    prefix = shlex.split(os.environ.get(SERVER_ARGV_ENV, "")) or [sys.executable, "-m", "tools.cli.main"]
    return [*prefix, "serve", "--name", name, "--capacity", f"{capacity >> 20}M", *extra]


def _source_env() -> dict[str, str]:
    """This process's environment, with the tree this module comes from first on the path (the
    server then runs the same code as the bench, installed or not)."""
    env = os.environ.copy()
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


@contextlib.contextmanager
def served_subprocess(name: str, capacity: int, extra: tuple[str, ...] = ()) -> Iterator[list[str]]:
    """``cxlemu serve`` in a subprocess until its mailbox answers; SIGTERM and destroy on exit
    (whatever happened in between)."""
    from driver import CxlemuError, MemDev
    from emulator.device import destroy, firmware_pid

    argv = server_argv(name, capacity, extra)
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=_source_env())
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if proc.poll() is not None:
                raise SoakError(f"the server exited with {proc.returncode} before serving {name}: "
                                f"{_tail(log)} (command: {shlex.join(argv)})")
            if firmware_pid(name) is not None:
                try:
                    with MemDev.open(name, ready_timeout_s=0.5):
                        break
                except CxlemuError:
                    pass
            if time.monotonic() > deadline:
                raise SoakError(f"the server did not serve {name} within {SERVER_START_S:g} s "
                                f"(command: {shlex.join(argv)}): {_tail(log)}")
            time.sleep(0.05)
        yield argv
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        with contextlib.suppress(Exception):  # never served, or already gone
            destroy(name)


def _tail(log: Any) -> str:
    log.flush()
    log.seek(0)
    lines = [ln for ln in log.read().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "(no output)"


# --- the run ---------------------------------------------------------------------------------
def _setup(name: str) -> dict[str, Any]:
    """Read the constant answers and set the device's clock, before any host starts."""
    import emulator.commands  # noqa: F401  (fills the command table)
    from driver import MemDev
    from emulator.mailbox import COMMANDS
    from emulator.spec.payloads import IDENTIFY
    from emulator.spec.payloads_memdev import IDENTIFY_MEMDEV, TIMESTAMP
    from emulator.spec.retcodes import RetCode

    assert UNSUPPORTED_OPCODE not in COMMANDS, f"{UNSUPPORTED_OPCODE:#06x} is a command now: pick another"
    assert (RC_SUCCESS, RC_UNSUPPORTED) == (RetCode.SUCCESS, RetCode.UNSUPPORTED)

    with MemDev.open(name) as md:
        rc, ident = md.send(OP_IDENTIFY)
        if rc != 0 or len(ident) != IDENTIFY.size:
            raise SoakError(f"Identify before the run: {_describe(rc, ident)}")
        rc, ident_md = md.send(OP_IDENTIFY_MEMDEV)
        if rc != 0 or len(ident_md) != IDENTIFY_MEMDEV.size:
            raise SoakError(f"Identify Memory Device before the run: {_describe(rc, ident_md)}")
        if md.config.lsa_size < MAX_HOSTS * LSA_REGION:
            raise SoakError(f"{name}'s LSA is {md.config.lsa_size} B: the soak needs {MAX_HOSTS * LSA_REGION}")
        t0 = time.time_ns()
        set_lo = time.monotonic_ns()
        rc, out = md.send(OP_SET_TIMESTAMP, TIMESTAMP.pack(timestamp=t0))
        set_hi = time.monotonic_ns()
        if rc != 0:
            raise SoakError(f"Set Timestamp before the run: {_describe(rc, out)}")
    return {"identify": ident, "identify_memdev": ident_md, "timestamp": (t0, set_lo, set_hi)}


def shares(commands: int, hosts: int) -> list[int]:
    """Each host's number of commands: as even as it goes, summing to ``commands``."""
    return [commands // hosts + (i < commands % hosts) for i in range(hosts)]


def validate(*, commands: int, hosts: int, load_procs: int, load_bytes: int, capacity: int) -> None:
    """The soak's argument checks (ValueError naming the flag): the command refuses bad
    arguments with these before it starts a server."""
    if commands < 1:
        raise ValueError(f"--commands must be >= 1, got {commands}")
    if not 1 <= hosts <= MAX_HOSTS:
        raise ValueError(f"--hosts must be between 1 and {MAX_HOSTS}, got {hosts}")
    if load_procs < 0:
        raise ValueError(f"--load-procs must be >= 0, got {load_procs}")
    if load_bytes < 64 or load_bytes % 64:
        raise ValueError(f"--load-bytes must be a positive multiple of 64, got {load_bytes}")
    if capacity <= 0 or capacity % (256 << 20):
        raise ValueError(f"--capacity must be a positive multiple of 256M, got {capacity}")
    if load_procs and capacity // load_procs < load_bytes:
        raise ValueError(f"--load-bytes {load_bytes} does not fit in {load_procs} load processes' shares "
                         f"of the {capacity >> 20} MiB device")


def run(*, commands: int = 1_000_000, hosts: int = 2, load_procs: int = 1, load_bytes: int = 64 << 10,
        capacity: int = 256 << 20, seed: int = 0,
        progress: Callable[[str], None] | None = None) -> SoakResult:
    """The soak (see the module docstring); raises ValueError on bad arguments, SoakError when it
    cannot run."""
    import multiprocessing as mp

    validate(commands=commands, hosts=hosts, load_procs=load_procs, load_bytes=load_bytes, capacity=capacity)
    say = progress or (lambda _msg: None)
    name = f"mbsoak-{os.getpid()}-{random.randrange(1 << 32):08x}"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    start, stop = ctx.Event(), ctx.Event()
    counts = shares(commands, hosts)
    host_keys = [("host", i) for i in range(hosts)]
    load_keys = [("load", i) for i in range(load_procs)]
    procs: dict[tuple[str, int], Any] = {}
    ready: set[tuple[str, int]] = set()
    done: dict[tuple[str, int], dict[str, Any]] = {}  # its report, or {} when it failed
    errors: list[str] = []
    sent = dict.fromkeys(range(hosts), 0)

    def handle(msg: tuple) -> None:
        what, role, idx = msg[:3]
        if what == "ready":
            ready.add((role, idx))
        elif what == "progress":
            sent[idx] = msg[3]
            say(f"{sum(sent.values()):,} of {commands:,} commands")
        elif what == "done":
            done[(role, idx)] = msg[3]
        elif what == "error":
            errors.append(msg[3])
            done[(role, idx)] = {}

    def pump(until: Callable[[], bool], deadline: float | None = None) -> None:
        """Handle the processes' messages until ``until()``; a process that exits without a
        report is an error (its last message may still be in the queue: drained first)."""
        while not until():
            try:
                handle(results.get(timeout=0.25))
                continue
            except queue.Empty:
                pass
            dead = [k for k, p in procs.items() if p.exitcode is not None and k not in done]
            if dead:
                with contextlib.suppress(queue.Empty):
                    while True:
                        handle(results.get(timeout=0.5))
                for k in dead:
                    if k not in done:
                        errors.append(f"{k[0]} {k[1]}: exited with {procs[k].exitcode} without a report")
                        done[k] = {}
            if deadline is not None and time.monotonic() > deadline:
                raise SoakError(f"processes not ready after {READY_TIMEOUT_S:g} s: "
                                f"{', '.join(f'{r} {i}' for r, i in sorted(set(procs) - ready))}")

    say(f"starting the firmware ({name})")
    try:
        with served_subprocess(name, capacity) as argv:
            expected = _setup(name)
            for i, n in enumerate(counts):
                procs[("host", i)] = ctx.Process(target=_host, name=f"mbsoak-host{i}",
                                                 args=(i, name, n, seed, expected, start, results))
            span = capacity // load_procs if load_procs else 0
            for i in range(load_procs):
                procs[("load", i)] = ctx.Process(target=_load, name=f"mbsoak-load{i}",
                                                 args=(i, name, i * span, (i + 1) * span, load_bytes, seed,
                                                       start, stop, results))
            say(f"starting {hosts} host and {load_procs} load processes")
            for p in procs.values():
                p.start()
            pump(lambda: len(ready) == len(procs) or bool(errors), time.monotonic() + READY_TIMEOUT_S)
            if errors:
                raise SoakError("; ".join(errors))
            say(f"{hosts} hosts x ~{counts[0]:,} commands, {load_procs} data-path load process(es)")
            t0 = time.perf_counter()
            start.set()
            pump(lambda: all(k in done for k in host_keys))
            wall = time.perf_counter() - t0
            stop.set()
            pump(lambda: all(k in done for k in load_keys))
            for p in procs.values():
                p.join(timeout=30)
    finally:
        stop.set()
        for p in procs.values():
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    hres = [done[k] for k in host_keys]
    lres = [done[k] for k in load_keys]
    by_kind = {k: sum(h.get("by_kind", {}).get(k, 0) for h in hres) for k in KINDS}
    wrong = {k: sum(h.get("wrong", {}).get(k, 0) for h in hres) for k in KINDS}
    total = sum(h.get("sent", 0) for h in hres)
    ops = sum(r.get("ops", 0) for r in lres)
    return SoakResult(requested=commands, commands=total, hosts=hosts, load_procs=load_procs,
                      wrong=sum(wrong.values()), wrong_by_kind=wrong, commands_by_kind=by_kind,
                      samples=[s for h in hres for s in h.get("samples", [])],
                      data_ops=ops, data_bytes=ops * load_bytes,
                      data_mismatches=sum(r.get("mismatches", 0) for r in lres),
                      data_samples=[s for r in lres for s in r.get("samples", [])],
                      errors=errors, wall_s=wall, commands_per_s=total / wall if wall > 0 else 0.0,
                      seed=seed, server_argv=argv)
