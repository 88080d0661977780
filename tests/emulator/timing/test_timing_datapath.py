"""The timed data path: exact completion times on a simulated clock, C and Python twins
identical, poison and range errors typed and side-effect free, threads sharing one link."""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emulator.spec.errors import ConfigError, PoisonError
from emulator.timing import DataPath, ManualClock, TimingConfig, c_available, linkstate

MEDIA = 1 << 16


def _ensure_extension() -> None:
    """A source checkout may not have run `pip install -e .`: build the core in place."""
    if not c_available():
        from emulator.timing._build import build_in_place

        build_in_place()


_ensure_extension()
IMPLS = ["c", "py"]


def make(impl: str, config: TimingConfig, *, clock=None, size: int = MEDIA, seed: int = 7):
    """A DataPath over fresh buffers: media filled with a seeded pattern, no poison."""
    media = bytearray(np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes())
    poison = bytearray(-(-size // 512))
    link = bytearray(4096)
    return DataPath(media, poison, link, config, impl=impl, clock=clock), media, poison, link


def poison_line(poison: bytearray, dpa: int) -> None:
    line = dpa >> 6
    poison[line >> 3] |= 1 << (line & 7)


QEMU = TimingConfig(read_latency_ns=150, write_latency_ns=250,
                    read_bandwidth_gbps=16, write_bandwidth_gbps=16)


@pytest.mark.parametrize("impl", IMPLS)
def test_completion_follows_link_model(impl):
    """4 KiB at 16 GB/s occupies 256 ns; a second read at the same instant queues behind it."""
    clock = ManualClock(1000)
    dp, *_ = make(impl, QEMU, clock=clock)
    assert dp.read(0, bytearray(4096)) == 1000 + 256 + 150
    assert dp.read(4096, bytearray(4096)) == 1256 + 256 + 150
    assert dp.counters()["read_link_free_ns"] == 1512
    assert dp.write(0, bytes(4096)) == 1000 + 256 + 250  # the write direction is free


@pytest.mark.parametrize("impl", IMPLS)
def test_idle_link_starts_at_now(impl):
    """A request after the link went idle starts at its own time."""
    clock = ManualClock(0)
    dp, *_ = make(impl, QEMU, clock=clock)
    dp.read(0, bytearray(64))
    clock.advance(10_000)
    assert dp.read(0, bytearray(64)) == 10_000 + 4 + 150


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("dpa", "n", "txn", "charged"), [
    (0, 1, 64, 64), (63, 2, 64, 128), (0, 64, 64, 64), (100, 4000, 4096, 8192), (4096, 4096, 4096, 4096)])
def test_whole_transactions_are_charged(impl, dpa, n, txn, charged):
    """Bandwidth is charged per aligned transaction touched (1 GB/s: 1 ns per byte)."""
    cfg = TimingConfig(read_bandwidth_gbps=1, transaction_bytes=txn)
    dp, *_ = make(impl, cfg, clock=ManualClock(0))
    assert dp.read(dpa, bytearray(n)) == charged


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("gbps", "scale", "n"), [(0.001, 1000, 32 << 20), (0.001, 1000, 4096),
                                                  (3.0, 1, 64)])
def test_link_time_is_exact_past_64_bits(impl, gbps, scale, n):
    """bytes x fs/B past 2**64 (32 MiB at 1 MB/s x 1000: 3.4e19 fs) takes the 128-bit
    arithmetic, the rest the 64-bit one; both round half up to the ns."""
    cfg = TimingConfig(read_bandwidth_gbps=gbps, time_scale=scale)
    dp, *_ = make(impl, cfg, clock=ManualClock(0), size=max(MEDIA, n))
    fs = cfg.link_params().fs_per_byte[0]
    assert dp.read(0, bytearray(n)) == (n * fs + 500_000) // 1_000_000


def test_compensation_reaches_the_core_in_picoseconds(monkeypatch):
    """A fraction of a ns is 1 % of a 100-ns latency: the override and the core keep it."""
    from emulator.timing import calibration

    monkeypatch.setenv("CXLEMU_TIMING_COMP_NS", "12.345,20")
    calibration.calibrated_comp_ns.cache_clear()
    try:
        assert calibration.calibrated_comp_ns() == (12.345, 20.0)
        dp, *_ = make("c", QEMU)
        assert list(dp._core.dp.comp_ps) == [12345, 20000]
        dp.close()
        monkeypatch.setenv("CXLEMU_TIMING_COMP_NS", "fast")
        calibration.calibrated_comp_ns.cache_clear()
        with pytest.raises(ValueError, match="CXLEMU_TIMING_COMP_NS must be one or two numbers"):
            calibration.calibrated_comp_ns()
    finally:
        calibration.calibrated_comp_ns.cache_clear()


def test_calibrations_combine_to_the_lower_quartile():
    """Contention only ever inflates a calibration: the least of a few, the lower quartile of more."""
    from emulator.timing.calibration import combine_calibrations

    assert combine_calibrations([21.0]) == 21.0
    assert combine_calibrations([21.0, 14.9, 15.2]) == 14.9
    assert combine_calibrations([15.0, 15.2, 21.0, 14.8, 15.1, 20.4, 15.0, 14.9]) == 14.925


def test_calibration_history_per_host(monkeypatch, tmp_path):
    from emulator.timing import calibration

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("CXLEMU_TIMING_CALIBRATION_CACHE", raising=False)
    path = tmp_path / "cxlemu" / "timing-calibration.json"
    t0 = 1_000_000.0
    assert calibration.remembered_comp_ns(21.0, now=t0) == 21.0  # a first process has only its own
    assert calibration.remembered_comp_ns(15.0, now=t0 + 1) == 15.0  # the spell is outvoted
    for i in range(20):
        calibration.remembered_comp_ns(15.0 + 0.01 * i, now=t0 + 2 + i)
    kept = json.loads(path.read_text())["calibrations"]
    assert len(kept) == 16 and kept[-1] == [t0 + 21, pytest.approx(15.19)]  # the newest 16
    # a week later the old ones no longer count
    assert calibration.remembered_comp_ns(17.5, now=t0 + 8 * 24 * 3600) == 17.5
    # another host or method (its key differs): the history starts over
    data = json.loads(path.read_text())
    path.write_text(json.dumps({"key": "another-host", "calibrations": data["calibrations"]}))
    assert calibration.remembered_comp_ns(16.0, now=t0 + 8 * 24 * 3600) == 16.0
    path.write_text("{not json")  # a damaged file is replaced, not fatal
    assert calibration.remembered_comp_ns(16.5, now=t0) == 16.5
    monkeypatch.setenv("CXLEMU_TIMING_CALIBRATION_CACHE", "0")
    before = path.read_text()
    assert calibration.remembered_comp_ns(30.0, now=t0) == 30.0 and path.read_text() == before


@pytest.mark.parametrize("impl", IMPLS)
def test_time_scale_multiplies_every_device_time(impl):
    cfg = TimingConfig(read_latency_ns=100, read_bandwidth_gbps=8, time_scale=2.5)
    dp, *_ = make(impl, cfg, clock=ManualClock(0))
    assert dp.read(0, bytearray(768)) == round(100 * 2.5) + round(768 / 8 * 2.5)


@pytest.mark.parametrize("impl", IMPLS)
def test_copy_holds_both_directions(impl):
    """A device-internal copy pays both latencies once, after the slower direction drains."""
    cfg = TimingConfig(read_latency_ns=100, write_latency_ns=200,
                       read_bandwidth_gbps=2, write_bandwidth_gbps=1)
    dp, media, *_ = make(impl, cfg, clock=ManualClock(0))
    expect = bytes(media[0:1024])
    assert dp.copy(0, 8192, 1024) == 1024 + 300
    assert bytes(media[8192:9216]) == expect
    c = dp.counters()
    assert (c["read_link_free_ns"], c["write_link_free_ns"]) == (512, 1024)
    assert (c["copy_bytes"], c["copy_transfers"], c["read_bytes"]) == (1024, 1, 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_counters_and_histogram(impl):
    dp, *_ = make(impl, QEMU, clock=ManualClock(0))
    dp.read(0, bytearray(64))        # 4 + 150 = 154 ns -> bucket 7 (128..255)
    dp.read(64, bytearray(64))       # queues 4 ns: 158 ns
    dp.write(0, bytes(128))          # 8 + 250 = 258 ns -> bucket 8
    c = dp.counters()
    assert (c["read_bytes"], c["read_transfers"], c["read_busy_ns"]) == (128, 2, 8)
    assert (c["read_latency_ns"], c["read_hist_07"]) == (154 + 158, 2)
    assert (c["write_bytes"], c["write_hist_08"], c["write_latency_ns"]) == (128, 1, 258)


@pytest.mark.parametrize("impl", IMPLS)
def test_untimed_config_counts_without_a_clock(impl):
    dp, *_ = make(impl, TimingConfig(), clock=ManualClock(42))
    assert dp.read(0, bytearray(100)) == 42
    c = dp.counters()
    assert (c["read_bytes"], c["read_transfers"], c["read_latency_ns"]) == (100, 1, 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_data_round_trips_through_numpy_and_bytes(impl):
    dp, media, *_ = make(impl, QEMU, clock=ManualClock(0))
    src = np.arange(1000, dtype=np.uint32)
    dp.write(4000, src)
    out = np.zeros(1000, dtype=np.uint32)
    dp.read(4000, out)
    assert np.array_equal(out, src)
    assert bytes(media[4000:8000]) == src.tobytes()
    got = bytearray(16)
    dp.read_untimed(4000, got)
    assert got == src.tobytes()[:16]


# -- poison and range ---------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("clock", [None, ManualClock(0)], ids=["real", "sim"])
def test_poisoned_read_fails_before_copying(impl, clock):
    dp, _media, poison, _ = make(impl, QEMU, clock=clock)
    poison_line(poison, 0x1C0)
    out = bytearray(b"\xaa" * 1024)
    with pytest.raises(PoisonError) as exc:
        dp.read(0, out)
    assert exc.value.dpa == 0x1C0
    assert out == b"\xaa" * 1024
    with pytest.raises(PoisonError):
        dp.read_untimed(0x1C0 + 63, bytearray(1))
    dp.read(0x200, bytearray(64))  # the next line is fine
    assert dp.counters()["read_errors"] == 2 and dp.counters()["read_transfers"] == 1


@pytest.mark.parametrize("impl", IMPLS)
def test_write_to_poisoned_line_is_allowed(impl):
    dp, media, poison, _ = make(impl, QEMU, clock=ManualClock(0))
    poison_line(poison, 0)
    dp.write(0, b"\x01" * 64)
    assert bytes(media[:64]) == b"\x01" * 64


@pytest.mark.parametrize("impl", IMPLS)
def test_copy_from_poison_fails_and_leaves_destination(impl):
    dp, media, poison, _ = make(impl, QEMU, clock=ManualClock(0))
    poison_line(poison, 0x4000 + 128)
    before = bytes(media[0x8000:0x9000])
    with pytest.raises(PoisonError) as exc:
        dp.copy(0x4000, 0x8000, 0x1000)
    assert exc.value.dpa == 0x4080 and bytes(media[0x8000:0x9000]) == before


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", ["read", "write", "copy_src", "copy_dst", "untimed"])
def test_out_of_range_names_the_bound_and_touches_nothing(impl, op):
    dp, media, _, _ = make(impl, QEMU, clock=ManualClock(0))
    before = bytes(media)
    out = bytearray(b"\x55" * 128)
    call = {"read": lambda: dp.read(MEDIA - 64, out),
            "write": lambda: dp.write(MEDIA - 64, bytes(128)),
            "copy_src": lambda: dp.copy(MEDIA - 64, 0, 128),
            "copy_dst": lambda: dp.copy(0, MEDIA - 64, 128),
            "untimed": lambda: dp.write_untimed(MEDIA + 1, b"x")}[op]
    with pytest.raises(ValueError, match=f"{MEDIA:#x}"):
        call()
    assert bytes(media) == before and out == b"\x55" * 128
    assert dp.counters()["read_transfers"] + dp.counters()["write_transfers"] == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_negative_dpa_and_bad_buffers_are_refused(impl):
    dp, *_ = make(impl, QEMU, clock=ManualClock(0))
    with pytest.raises(ValueError, match="DPA must be an int >= 0"):
        dp.read(-64, bytearray(64))
    with pytest.raises(ValueError, match="read-only"):
        dp.read(0, b"immutable")
    with pytest.raises(ValueError, match="C-contiguous"):
        dp.read(0, np.zeros((8, 8), dtype=np.uint8)[:, ::2])
    with pytest.raises(TypeError, match="buffer protocol"):
        dp.write(0, "text")


# -- configuration --------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"read_latency_ns": -1}, "read_latency_ns must be >= 0"),
    ({"write_bandwidth_gbps": -2}, "write_bandwidth_gbps must be at least 0.001 GB/s"),
    ({"read_bandwidth_gbps": 0}, "leave it unset \\(None\\) for an unthrottled link"),
    ({"read_bandwidth_gbps": 1e-6}, "at least 0.001 GB/s"),
    ({"transaction_bytes": 96}, "power of two from 64 to 4096"),
    ({"transaction_bytes": 8192}, "power of two from 64 to 4096"),
    ({"time_scale": 0}, "time_scale must be > 0"),
    ({"read_latency_ns": float("nan")}, "finite number"),
])
def test_bad_config_is_refused_at_construction(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TimingConfig(**kwargs)


def test_bad_datapath_arguments():
    with pytest.raises(ConfigError, match="impl must be one of"):
        DataPath(bytearray(4096), None, bytearray(4096), QEMU, impl="fortran")
    with pytest.raises(ConfigError, match="needs 8"):
        DataPath(bytearray(4096), bytearray(1), bytearray(4096), QEMU)
    with pytest.raises(ConfigError, match="must be a TimingConfig"):
        DataPath(bytearray(4096), None, bytearray(4096), {"read_latency_ns": 1})
    with pytest.raises(ValueError, match="not a cxlemu link page"):
        DataPath(bytearray(4096), None, bytearray(b"\x01" * 4096), QEMU)
    with pytest.raises(ConfigError, match="from_dict|unknown timing field"):
        TimingConfig.from_dict({"latency": 5})


def test_link_layout_matches_the_c_header():
    from emulator.timing._cdatapath import lib

    assert lib.CXL_LS_COPY_WORD == linkstate.COPY_WORD
    assert lib.CXL_LS_HIST == linkstate.HIST and lib.CXL_LS_HIST_BUCKETS == linkstate.HIST_BUCKETS
    assert lib.CXL_SHORT_BYTES == linkstate.SHORT_BYTES
    assert (lib.CXL_LS_FREE, lib.CXL_LS_BYTES, lib.CXL_LS_TRANSFERS, lib.CXL_LS_BUSY_NS,
            lib.CXL_LS_LATENCY_NS, lib.CXL_LS_ERRORS) == (0, 1, 2, 3, 4, 5)


# -- differential: C vs Python ------------------------------------------------------------
_ops = st.lists(st.tuples(
    st.sampled_from(["read", "write", "copy", "advance"]),
    st.integers(0, MEDIA + 256), st.integers(0, MEDIA), st.integers(0, 9000)), max_size=40)
_cfgs = st.builds(TimingConfig,
                  read_latency_ns=st.sampled_from([0, 1, 150, 999.6]),
                  write_latency_ns=st.sampled_from([0, 250, 31.4]),
                  read_bandwidth_gbps=st.sampled_from([None, 0.7, 16, 64]),
                  write_bandwidth_gbps=st.sampled_from([None, 3, 16]),
                  transaction_bytes=st.sampled_from([64, 256, 4096]),
                  time_scale=st.sampled_from([1, 0.5, 3.3]))


def _run(impl, cfg, ops, poisoned):
    clock = ManualClock(5)
    dp, media, poison, _link = make(impl, cfg, clock=clock)
    for dpa in poisoned:
        poison_line(poison, dpa)
    results = []
    for op, a, b, n in ops:
        try:
            if op == "read":
                out = bytearray(n)
                results.append((dp.read(a, out), bytes(out)))
            elif op == "write":
                results.append(dp.write(a, bytes([n & 255]) * n))
            elif op == "copy":
                results.append(dp.copy(a, b, n))
            else:
                results.append(clock.advance(n))
        except (PoisonError, ValueError) as exc:
            results.append((type(exc).__name__, str(exc)))
    return results, bytes(media), dp.counters()


@settings(max_examples=60, deadline=None)
@given(cfg=_cfgs, ops=_ops, poisoned=st.lists(st.integers(0, MEDIA - 1), max_size=4))
def test_c_and_python_twins_agree(cfg, ops, poisoned):
    """Same operations on the same state: same completions, bytes, errors and counters."""
    assert _run("c", cfg, ops, poisoned) == _run("py", cfg, ops, poisoned)


# -- real time, threads -----------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_four_threads_share_one_link(impl):
    """Each thread writes and reads back its own stripe; every byte survives and the link's
    accounting equals the sum of what the threads moved."""
    cfg = TimingConfig(read_latency_ns=50, write_latency_ns=50,
                       read_bandwidth_gbps=40, write_bandwidth_gbps=40)
    dp, _media, *_ = make(impl, cfg, size=1 << 20)
    chunk, rounds = 4096, 16
    errors: list[str] = []

    def worker(t: int) -> None:
        rng = np.random.default_rng(t)
        for r in range(rounds):
            data = rng.integers(0, 256, chunk, dtype=np.uint8)
            dpa = (t * rounds + r) * chunk
            dp.write(dpa, data)
            out = np.empty(chunk, dtype=np.uint8)
            dp.read(dpa, out)
            if not np.array_equal(out, data):
                errors.append(f"thread {t} round {r}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    c = dp.counters()
    moved = 4 * rounds * chunk
    per_transfer_ns = round(chunk / 40)  # 102.4 -> 102 ns
    assert (c["read_bytes"], c["write_bytes"]) == (moved, moved)
    assert (c["read_transfers"], c["write_transfers"]) == (64, 64)
    assert (c["read_busy_ns"], c["write_busy_ns"]) == (64 * per_transfer_ns, 64 * per_transfer_ns)
    assert sum(c[f"read_hist_{k:02d}"] for k in range(linkstate.HIST_BUCKETS)) == 64


@pytest.mark.parametrize("impl", IMPLS)
def test_real_time_read_returns_after_completion(impl):
    """Ordering, not speed: the call returns no earlier than the completion it reports."""
    import time

    dp, *_ = make(impl, TimingConfig(read_latency_ns=20_000))
    done = dp.read(0, bytearray(64))
    assert time.monotonic_ns() >= done - 1000  # the C core may deduct its own measured cost
    later = dp.read(0, bytearray(64), wait=False)
    dp.wait_until(later)
    assert time.monotonic_ns() >= later


def test_a_long_real_time_transfer_is_stamped_before_its_validation(monkeypatch):
    """As the C core does: a real-time transfer longer than the short path is requested when
    the call begins, so its validation (a poison scan: 7-8 us for 2 MiB on a cold bitmap) runs
    inside its link time; a short one is requested after it. The twin, on a clock that each
    reading moves on by 1 us."""
    from emulator.timing import _pyimpl

    readings = iter(range(0, 10**9, 1000))
    monkeypatch.setattr(_pyimpl.time, "monotonic_ns", lambda: next(readings))
    dp, *_ = make("py", TimingConfig(read_latency_ns=100, read_bandwidth_gbps=1), size=1 << 20)
    real_validate = dp._core._validate
    monkeypatch.setattr(dp._core, "_validate", lambda *a, **k: next(readings) and real_validate(*a, **k))
    # 64 KiB at 1 GB/s: 65,536 ns of link; stamped at 0, then validated at 1000
    assert dp.read(0, bytearray(64 << 10), wait=False) == 0 + 65_536 + 100
    # 4 KiB, the short path: validated at 2000, stamped after it at 3000; the link is still busy
    # until 65,536
    assert dp.read(0, bytearray(4096), wait=False) == 65_536 + 4096 + 100


@pytest.mark.parametrize("impl", IMPLS)
def test_registered_host_buffers_move_the_same_bytes(impl):
    dp, media, *_ = make(impl, QEMU, clock=ManualClock(0))
    out = np.zeros(4096, np.uint8)
    with dp.register(out) as reg:
        assert dp.read(0x100, reg) == 256 + 150
        assert bytes(out) == bytes(media[0x100:0x1100])
        src = dp.register(np.full(64, 7, np.uint8), writable=False)
        dp.write(0, src)
        assert bytes(media[:64]) == b"\x07" * 64
    dp.read(0, reg)  # released: falls back to a per-call view of the same buffer
    with pytest.raises(ValueError, match="read-only"):
        dp.register(b"bytes are read-only")


def _hammer(name: str, rounds: int) -> None:
    """A separate process writing and reading through the device's own link page."""
    from emulator.device import DeviceFiles

    files = DeviceFiles.open(name)
    dp = DataPath.for_device(files, impl="c")
    try:
        for _ in range(rounds):
            dp.write(0, bytes(4096))
            dp.read(4096, bytearray(4096))
    finally:
        dp.close()
        files.close()


def test_processes_share_one_link_page(served):
    """Two processes and this one on one device: the link's counters add up exactly (the C
    core's atomic updates in the BAR's shared page)."""
    import multiprocessing as mp

    from emulator.device import DeviceFiles

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_hammer, args=(served.name, 200)) for _ in range(2)]
    for p in procs:
        p.start()
    files = DeviceFiles.open(served.name)
    dp = DataPath.for_device(files, config=TimingConfig(read_bandwidth_gbps=64), impl="c")
    for _ in range(200):
        dp.read(0, bytearray(4096))
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    c = dp.counters()
    dp.close()
    files.close()
    assert (c["read_transfers"], c["read_bytes"]) == (600, 600 * 4096)
    assert (c["write_transfers"], c["write_bytes"]) == (400, 400 * 4096)


# -- host buffers straight to the C core (_fastcall) ------------------------------------------
def test_the_c_core_takes_plain_buffers_in_one_call():
    """On 3.11+ the extension carries _fastcall (buffer protocol, no ffi.from_buffer per call)."""
    import sys

    from emulator.timing import cimpl

    expected = sys.version_info >= (3, 11)
    assert (cimpl.fast_transfer is not None) == expected
    assert (cimpl.fast_issue is not None) == (cimpl.handle_base is not None) == expected


@pytest.mark.parametrize("clock", [None, ManualClock(500)], ids=["real", "sim"])
def test_every_buffer_kind_moves_the_same_bytes_on_both_twins(clock):
    """numpy arrays of any dtype, bytearray, memoryview slices, array.array; reads never touch
    a byte outside the view they were given."""
    import array

    outs = {}
    for impl in IMPLS:
        dp, media, *_ = make(impl, QEMU, clock=clock)
        dp.write(0x100, np.arange(64, dtype=np.uint16))          # 128 B
        dp.write(0x200, array.array("i", range(8)))              # 32 B
        dp.write(0x300, memoryview(b"\x07" * 96)[16:48])         # 32 B of a read-only view
        host = bytearray(b"\xee" * 256)
        dp.read(0x100, memoryview(host)[64:192])                 # a slice: only [64, 192) written
        arr = np.zeros((4, 8), dtype=np.float32)
        dp.read(0x200, arr)
        counters = dp.counters() if clock is not None else None  # real time: clock values differ
        outs[impl] = (bytes(media[:0x400]), bytes(host), arr.tobytes(), counters)
        assert host[:64] == b"\xee" * 64 and host[192:] == b"\xee" * 64
        assert bytes(host[64:192]) == np.arange(64, dtype=np.uint16).tobytes()
    assert outs["c"] == outs["py"]


@pytest.mark.parametrize("impl", IMPLS)
def test_unusable_buffers_are_refused_at_real_time_and_nothing_moves(impl):
    dp, media, *_ = make(impl, QEMU)
    before = bytes(media)
    frozen = np.zeros(64, np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        dp.read(0, frozen)
    with pytest.raises(ValueError, match="read-only"):
        dp.read(0, b"bytes are immutable")
    with pytest.raises(ValueError, match="C-contiguous"):
        dp.read(0, np.zeros((8, 8), np.uint8, order="F"))
    with pytest.raises(ValueError, match="C-contiguous"):
        dp.write(0, np.arange(64, dtype=np.uint8)[::2])
    with pytest.raises(TypeError, match="buffer protocol"):
        dp.read(0, [0] * 64)
    assert not frozen.any() and bytes(media) == before
    c = dp.counters()
    assert c["read_transfers"] + c["write_transfers"] + c["read_errors"] + c["write_errors"] == 0
    dp.write(0, frozen)  # a read-only buffer is a fine source
    assert bytes(media[:64]) == bytes(64)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_closed_data_path_refuses_transfers(impl):
    """After close() the core's buffers are released: every path says so, none touches them."""
    from emulator.dma import Descriptor, DmaEngine

    dp, *_ = make(impl, QEMU)
    out = np.zeros(64, np.uint8)
    reg = dp.register(out)
    desc = Descriptor("read", 0, out, 0, 64)
    with DmaEngine(dp, channels=1) as eng:
        eng.submit([desc]).check(10)  # builds the descriptor: the next goes the one-call way
        dp.close()
        for call in (lambda: dp.read(0, out), lambda: dp.write(0, out), lambda: dp.read(0, reg),
                     lambda: dp.copy(0, 64, 64), lambda: eng.submit([desc])):
            with pytest.raises(RuntimeError, match="DataPath is closed"):
                call()
    dp.close()  # idempotent
