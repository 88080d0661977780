"""A device across stops, restarts, SIGKILL and sanitize: it keeps what was written to it, and
hosts learn at once when its firmware is gone or its media disabled (issue 12)."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from cli_support import cxlemu, serve_process

from driver import DeviceGone, MediaDisabled, MemDev
from emulator import liveness
from emulator.device import DeviceConfig, Served, destroy, device_path, device_state, serve
from emulator.fwslots import build_image
from emulator.spec.errors import ConfigError
from emulator.timing import TimingConfig

MiB = 1 << 20


@pytest.fixture
def server(device_name: str) -> Iterator[tuple[str, list[subprocess.Popen[str]]]]:
    """A device served by `cxlemu serve` subprocesses; every one is stopped and the device
    destroyed at the end."""
    procs: list[subprocess.Popen[str]] = []
    try:
        yield device_name, procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
        if (device_path(device_name) / "config.json").exists():
            destroy(device_name)


def test_the_state_word_layout_matches_the_c_core() -> None:
    from emulator.timing.cimpl import lib

    assert (liveness.STATE_WORD, liveness.GEN_MASK, liveness.UP, liveness.MEDIA) == \
        (lib.CXL_LS_STATE_WORD, lib.CXL_ST_GEN_MASK, lib.CXL_ST_UP, lib.CXL_ST_MEDIA)


def test_serving_again_keeps_media_lsa_poison_and_firmware_slots(device_name: str) -> None:
    config = DeviceConfig(name=device_name, capacity=256 * MiB, lsa_size=4096)
    with serve(config, keep=True):
        with MemDev.open(device_name) as md:
            md.write(0x10_0000, b"kept across a power cycle")
            md.set_lsa(64, b"label!")
            md.inject_poison(0x20_0000)
            md.update_firmware(build_image("cxlemu-9.9.9"), slot=2)
            md.activate_firmware(2, online=True)
    assert device_state(device_name) == "stopped"
    with serve(config) as served:
        assert served.firmware.generation == 2
        with MemDev.open(device_name) as md:
            assert md.read(0x10_0000, 25) == b"kept across a power cycle"
            assert md.get_lsa(64, 6) == b"label!"
            assert [(r.dpa, r.length) for r in md.get_poison_list().records] == [(0x20_0000, 64)]
            info = md.fw_info()
            assert (info.active_slot, info.revisions[:2]) == (2, ("cxlemu-0.1.0", "cxlemu-9.9.9"))


def test_a_different_configuration_is_refused_naming_it_unless_reconfigure(device_name: str) -> None:
    config = DeviceConfig(name=device_name, capacity=256 * MiB)
    with serve(config, keep=True):
        with MemDev.open(device_name) as md:
            md.write(0, b"abc")
    bigger = config.with_(capacity=512 * MiB, timing=TimingConfig(read_latency_ns=300))
    with pytest.raises(ConfigError, match=r"capacity: 268435456 \(256 MiB\) -> 536870912 \(512 MiB\); "
                                          r"timing.read_latency_ns: 0.0 -> 300\): .*--reconfigure"):
        Served(bigger)
    assert (device_path(device_name) / "media").stat().st_size == 256 * MiB  # untouched
    with serve(bigger, keep=True, reconfigure=True):
        with MemDev.open(device_name) as md:
            assert md.config.capacity == 512 * MiB and md.read(0, 3) == b"abc"
    with serve(bigger, fresh=True):
        with MemDev.open(device_name) as md:
            assert md.read(0, 3) == bytes(3)


def test_handles_of_an_earlier_boot_are_gone(device_name: str) -> None:
    config = DeviceConfig(name=device_name, capacity=256 * MiB)
    with serve(config, keep=True):
        old = MemDev.open(device_name)
        old.write(0, b"x")
    with serve(config):
        try:
            with pytest.raises(DeviceGone, match="restarted since this handle was opened"):
                old.read(0, 1)
            with pytest.raises(DeviceGone, match="restarted since this handle was opened"):
                old.send(0x0001)
            with MemDev.open(device_name) as md:
                assert md.read(0, 1) == b"x"
        finally:
            old.close()


def test_kill_9_keeps_completed_writes_and_hosts_learn_within_100_ms(server) -> None:
    name, procs = server
    procs.append(serve_process(name, "--capacity", "256M"))
    pattern = np.random.default_rng(12).integers(0, 256, 1 * MiB, dtype=np.uint8)
    md = MemDev.open(name)
    try:
        md.write(0x40_0000, pattern)
        md.set_lsa(0, b"lsa survives")
        procs[0].send_signal(signal.SIGKILL)  # not reaped: a zombie until the fixture waits
        killed = time.monotonic()
        with pytest.raises(DeviceGone):
            while True:
                md.read(0x40_0000, 64)
        read_ms = (time.monotonic() - killed) * 1000
        assert read_ms < 100, read_ms
        t0 = time.monotonic()
        with pytest.raises(DeviceGone):
            md.send(0x0001)
        assert (time.monotonic() - t0) * 1000 < 100
        assert device_state(name) == "stopped"  # a zombie is not served
        t0 = time.monotonic()
        with pytest.raises(DeviceGone, match="zombie"):
            MemDev.open(name)
        assert (time.monotonic() - t0) * 1000 < 100
    finally:
        md.close()
    procs.append(serve_process(name))
    with MemDev.open(name) as md:
        got = np.empty_like(pattern)
        md.read_into(0x40_0000, got)
        assert np.array_equal(got, pattern)
        assert md.get_lsa(0, 12) == b"lsa survives"


def test_send_on_a_killed_firmware_mid_wait_fails_fast(server) -> None:
    """A command in flight when the firmware dies: DeviceGone in well under the 2-s timeout."""
    name, procs = server
    procs.append(serve_process(name, "--capacity", "256M"))
    with MemDev.open(name) as md:
        os.kill(procs[0].pid, signal.SIGSTOP)  # the doorbell will not clear
        threading.Timer(0.05, os.kill, (procs[0].pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(DeviceGone):
            md.send(0x0001)
        assert time.monotonic() - t0 < 0.05 + 0.1


@pytest.mark.slow
def test_cli_serve_again_is_refused_on_a_difference_and_fresh_starts_empty(server) -> None:
    name, procs = server
    procs.append(serve_process(name, "--capacity", "256M"))
    with MemDev.open(name) as md:
        md.write(0, b"persist")
    procs[0].send_signal(signal.SIGTERM)
    assert procs[0].wait(timeout=30) == 0
    refused = cxlemu("serve", "--name", name, "--capacity", "512M")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "capacity: 268435456 (256 MiB) -> 536870912 (512 MiB)" in refused.stderr
    procs.append(serve_process(name, "--capacity", "0x10000000"))  # the same size, in hex
    with MemDev.open(name) as md:
        assert md.read(0, 7) == b"persist"
    procs[1].send_signal(signal.SIGTERM)
    procs[1].wait(timeout=30)
    procs.append(serve_process(name, "--fresh"))
    with MemDev.open(name) as md:
        assert md.read(0, 7) == bytes(7) and md.config.capacity == 1 << 30


@pytest.mark.slow
def test_a_serve_the_host_cannot_back_changes_nothing(server, runtime_dir: str) -> None:
    name, procs = server
    procs.append(serve_process(name, "--capacity", "256M"))
    with MemDev.open(name) as md:
        md.write(0, b"still here")
    procs[0].send_signal(signal.SIGTERM)
    procs[0].wait(timeout=30)
    before = sorted(os.listdir(runtime_dir))
    for size in ("32T", "1000000T"):
        for target in (name, f"{name}-new"):
            out = cxlemu("serve", "--name", target, "--capacity", size, "--reconfigure" if target == name else "--fresh")
            assert out.returncode == 2, out.stderr
            assert out.stderr.startswith("cxlemu: error: capacity") and out.stderr.count("\n") == 1
            assert "cannot be backed" in out.stderr
    assert sorted(os.listdir(runtime_dir)) == before
    procs.append(serve_process(name))
    with MemDev.open(name) as md:
        assert md.config.capacity == 256 * MiB and md.read(0, 10) == b"still here"


def test_every_read_during_a_sanitize_raises_and_the_media_is_zero_after(device_name: str) -> None:
    # 1 GB/s of writes: the sanitize of 256 MiB takes ~270 ms, long enough to read through
    config = DeviceConfig(name=device_name, capacity=256 * MiB,
                          timing=TimingConfig(write_bandwidth_gbps=1.0))
    with serve(config):
        with MemDev.open(device_name) as md:
            md.write_untimed(0, np.full(4 * MiB, 0xAB, np.uint8))
            done = threading.Event()
            errors: list[BaseException] = []

            def run() -> None:
                try:
                    md.sanitize()
                except BaseException as exc:  # pragma: no cover - reported below
                    errors.append(exc)
                finally:
                    done.set()

            threading.Thread(target=run).start()
            deadline = time.monotonic() + 5
            while md.media_status != 3:  # wait for media disabled
                assert time.monotonic() < deadline
                time.sleep(0.001)
            reads = refused = 0
            out = np.empty(64, np.uint8)
            while md.media_status == 3:
                reads += 1
                try:
                    md.read(4096, 64)
                except MediaDisabled:
                    refused += 1
                try:
                    md.read_into(0, out)
                except MediaDisabled:
                    refused += 1
                reads += 1
            assert done.wait(10) and not errors
            assert reads >= 10 and refused >= reads - 2  # the last pair may straddle the end
            assert md.read(0, 4 * MiB) == bytes(4 * MiB)


def test_read_returns_bytes_from_one_copy_and_fails_on_poison(memdev) -> None:
    memdev.write(0, bytes(range(256)) * 64)
    assert memdev.read(100, 5000) == (bytes(range(256)) * 64)[100:5100]
    assert memdev.read(0, 0) == b""
    with pytest.raises(ValueError, match="past the end"):
        memdev.read(256 * MiB - 10, 11)
    memdev.inject_poison(8192)
    with pytest.raises(Exception, match="poisoned line at DPA 0x2000"):
        memdev.read(8000, 1000)


def test_send_after_close_says_the_handle_is_closed(served) -> None:
    md = MemDev.open(served.name)
    md.close()
    with pytest.raises(ValueError, match="closed handle: open the device again"):
        md.send(0x0001)


def test_device_name_rule_is_stated_as_checked() -> None:
    with pytest.raises(ConfigError, match="must start with a letter or a digit"):
        DeviceConfig(name=".")


def test_registers_are_single_aligned_stores_and_64_bit_ones_take_halves(memdev) -> None:
    """One aligned access per register (misaligned refused); the Command register written as two
    dwords, lower first (§8.2.2), is one command to the firmware."""
    from emulator.spec import registers as R

    regs = memdev.regs
    with pytest.raises(ValueError, match="not aligned"):
        regs.read(R.MB_CMD.offset + 2, 4)
    with pytest.raises(ValueError, match="only 64-bit registers"):
        regs.write_half(R.MB_CTRL, False, 1)
    cmd = R.MB_CMD.f("LENGTH").put(R.MB_CMD.f("OPCODE").put(0, 0x4000), 0)
    with memdev._tlock:
        regs.write_half(R.MB_CMD, False, cmd & 0xFFFF_FFFF)
        regs.write_half(R.MB_CMD, True, cmd >> 32)
        assert regs.get(R.MB_CMD) == cmd
        regs.set_field(R.MB_CTRL, "DOORBELL", 1)
        memdev._poll_doorbell_clear()
    assert regs.get_field(R.MB_STATUS, "RETCODE") == 0
    assert regs.get_field(R.MB_CMD, "LENGTH") == 0x45  # Identify Memory Device's output
