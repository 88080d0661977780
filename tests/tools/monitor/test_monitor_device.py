"""The monitor against real devices: headless frames under load, devices that stop, die, vanish
and come back."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Self

import numpy as np
import pytest
from cli_support import cxlemu, default_sigint, serve_process

from emulator.device import DeviceConfig, DeviceFiles, Served, serve
from emulator.spec import registers as R
from emulator.telemetry import TelemetryReader, TelemetryWriter
from emulator.timing import DataPath, TimingConfig
from tools.monitor.source import DeviceSet, DeviceSource

MiB = 1 << 20


def monitor_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return cxlemu("monitor", "--width", "140", *args, timeout=timeout)


def frames(stdout: str) -> list[str]:
    """The frames of a --frames run, whitespace squeezed."""
    parts = re.split(r"─+ frame \d+(?:/\d+)? ─+\n", stdout)[1:]
    return ["\n".join(" ".join(line.split()) for line in part.splitlines()) for part in parts]


def wait_for_firmware_section(source: DeviceSource):
    """Poll until the firmware runner has published section (a) (it does within ~one loop)."""
    import time

    deadline = time.monotonic() + 10
    while True:
        view = source.poll()
        if view.snapshot is not None and view.snapshot.firmware is not None:
            return view
        assert time.monotonic() < deadline, "the firmware never published its telemetry section"
        time.sleep(0.01)


class Load:
    """A host streaming 256 KiB writes through the timed data path and counting 'tokens' in the
    host section, in a thread, until stopped."""

    def __init__(self, served: Served) -> None:
        files = served.files
        link = memoryview(files.bar)[R.LINK_STATE_OFFSET:R.LINK_STATE_OFFSET + R.LINK_STATE_SIZE]
        self.dp = DataPath(files.media, files.poison, link, files.config.timing)
        self.host = TelemetryWriter(files.bar, "host", lock_path=files.path / "bar")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        buf = np.full(256 << 10, 0xA5, np.uint8)
        i = 0
        while not self.stop.is_set():
            self.dp.write((i % 64) * len(buf), buf)
            i += 1
            self.host.publish(tokens_generated=i, hits=3 * i, misses=i)
            time.sleep(0.002)  # leave the second core to the monitor process

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.host.close()


@pytest.fixture
def timed(device_name: str) -> Iterator[Served]:
    """A served device whose link costs 300 ns + 2 GB/s each way."""
    timing = TimingConfig(read_latency_ns=300, write_latency_ns=300, read_bandwidth_gbps=2.0,
                          write_bandwidth_gbps=2.0)
    with serve(DeviceConfig(name=device_name, capacity=256 * MiB, timing=timing)) as served:
        yield served


@pytest.mark.slow
def test_frames_under_load_show_counters_moving(timed: Served) -> None:
    """`cxlemu monitor NAME --frames 3 --interval 0.5` in another process: exits 0, names the
    device, and transfers, tokens and uptime grow from frame to frame."""
    served = timed
    with Load(served):
        result = monitor_cli(served.name, "--frames", "3", "--interval", "0.5")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    shots = frames(result.stdout)
    assert len(shots) == 3
    writes, tokens, uptimes = [], [], []
    for shot in shots:
        assert f"cxlemu monitor {served.name}: served (firmware pid {os.getpid()})" in shot
        writes.append(int(re.findall(r"([\d,]+) transfers", shot)[1].replace(",", "")))
        tokens.append(int(re.search(r"over ([\d,]+) tokens", shot)[1].replace(",", "")))
        up = re.search(rf"{served.name} served ready ok 35 °C ([\d.]+) (ms|s) ", shot)
        assert up is not None, shot
        uptimes.append(float(up[1]) * (1e-3 if up[2] == "ms" else 1.0))
    assert writes[0] < writes[1] < writes[2]
    assert tokens[0] < tokens[1] < tokens[2]
    assert uptimes[0] < uptimes[1] < uptimes[2]
    assert "write measuring" in shots[0]
    assert re.search(r"write \d+\.\d\d [kMG]?B/s total", shots[2])  # a rate from two samples
    # 256 KiB at 2 GB/s occupies the link 131 us; + 300 ns latency: every write lands in 2^17 ns.
    assert re.search(r"131\.1 µs–262\.1 µs █+ [\d,]+", shots[2])
    assert "hit rate 75.0%" in shots[2]


def test_source_follows_a_device_that_vanishes_and_returns(device_name: str) -> None:
    """Served -> files removed ("gone", no traceback) -> created again (picked up afresh)."""
    source = DeviceSource(device_name)
    assert source.poll().state == "not found"
    with serve(DeviceConfig(name=device_name, capacity=256 * MiB)):
        view = wait_for_firmware_section(source)
        assert (view.state, view.detail) == ("served", f"firmware pid {os.getpid()}")
        assert view.snapshot.firmware.capacity_bytes == 256 * MiB and view.snapshot.firmware.uptime_ns > 0
    view = source.poll()
    assert (view.state, view.detail) == ("gone", "device files removed")
    with serve(DeviceConfig(name=device_name, capacity=512 * MiB)):
        view = wait_for_firmware_section(source)
        assert view.state == "served" and view.capacity_bytes == 512 * MiB
        assert view.snapshot.firmware.capacity_bytes == 512 * MiB  # the new device's page, not the old one
    source.close()


def test_stopped_device_is_reported(device_name: str) -> None:
    served = Served(DeviceConfig(name=device_name, capacity=256 * MiB), keep=True).start()
    served.stop()
    try:
        result = monitor_cli(device_name, "--frames", "1", "--interval", "0.1")
        assert result.returncode == 0 and "Traceback" not in result.stderr
        assert f"{device_name}: stopped (not served (no firmware.pid))" in frames(result.stdout)[0]
    finally:
        DeviceFiles.open(device_name).destroy()


@pytest.fixture
def killed_server(device_name: str) -> Iterator[int]:
    """A `cxlemu serve` process killed with SIGKILL: its files and firmware.pid stay behind."""
    proc = serve_process(device_name, "--capacity", "256M")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    yield proc.pid
    DeviceFiles.open(device_name).destroy()


def test_dead_firmware_is_reported_gone(device_name: str, killed_server: int) -> None:
    """The firmware process died without cleaning up: the monitor says gone, without a traceback."""
    result = monitor_cli(device_name, "--frames", "2", "--interval", "0.1")
    assert result.returncode == 0 and "Traceback" not in result.stderr
    for shot in frames(result.stdout):
        assert f"{device_name}: gone (firmware pid {killed_server} exited)" in shot


def test_device_set_lists_all_and_keeps_the_gone(device_name: str) -> None:
    """With no names, every device is shown; one that disappears stays listed as gone."""
    devices = DeviceSet()
    with serve(DeviceConfig(name=device_name, capacity=256 * MiB)):
        assert {v.name: v.state for v in devices.poll()}[device_name] == "served"
    assert {v.name: v.state for v in devices.poll()}[device_name] == "gone"
    devices.close()


@pytest.mark.slow
def test_monitor_cli_rejects_bad_arguments() -> None:
    for args, message in ((["--interval", "0"], "--interval must be > 0 seconds, got 0.0"),
                          (["--frames", "0"], "--frames must be >= 1, got 0"),
                          (["--width", "20", "--frames", "1"], "--width must be >= 60 columns, got 20")):
        result = monitor_cli(*args)
        assert result.returncode == 2
        assert result.stderr.strip() == f"cxlemu: error: {message}"


def test_frames_show_poison_and_events(served: Served) -> None:
    """Poison injected through the mailbox and a data-path hit on it show up in the next frame."""
    from driver import MemDev

    with MemDev.open(served.name) as md:
        md.inject_poison(0x1000)
        md.inject_poison(0x8000)
    served.firmware.poison.report_hit(0x1000)  # what the data path reports on a poisoned read
    reader = TelemetryReader(served.files.bar)
    deadline = time.monotonic() + 30
    while (fw := reader.snapshot().firmware) is None or fw.events_fail < 1:  # the runner publishes every 100 ms
        assert time.monotonic() < deadline, "firmware never published the event"
        time.sleep(0.01)
    reader.close()
    result = monitor_cli(served.name, "--frames", "1")
    assert result.returncode == 0, result.stderr
    shot = frames(result.stdout)[0]
    assert "events: info 0 warn 0 fail 1 fatal 0 dcd 0 poison records 2" in shot
    assert "00:00:00.000 fail media media_ecc_error at 0x1000 (host_read)" in shot  # no Set Timestamp yet
    assert "poison DPA 0x1000 +64 B injected" in shot and "poison DPA 0x8000 +64 B injected" in shot


def test_piped_monitor_without_frames_prints_until_interrupted(served: Served) -> None:
    """stdout not a terminal and no --frames: frames keep coming (a log), SIGINT ends with 0."""
    # the CLI's own main, with SIGUSR1 dumping every thread's stack: if the monitor ever fails
    # to stop on SIGINT, the failure shows where it was
    cli = ("import faulthandler, signal, sys; faulthandler.register(signal.SIGUSR1); "
           "from tools.cli.main import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.Popen([sys.executable, "-c", cli, "monitor", served.name, "--interval", "0.1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        if m := re.search(r" frame (\d+) ", line):
            seen.append(int(m[1]))
            if len(seen) == 3:
                break
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1)
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"monitor still running 30 s after SIGINT; its stacks:\n{err}")
    assert seen == [1, 2, 3]
    assert proc.returncode == 0 and "Traceback" not in err


def test_monitor_shows_two_hosts_sharing_a_pool(device_name: str) -> None:
    """Issue 25.7 end to end: a device of 2 host ports with a pool, served in this process; host 0
    publishes a block and pins it, host 1 loads it. The firmware's page shows both hosts, the
    kv-index extent, host 0's sealed and shared block and its pin, host 1's cross-host hit; the
    dashboard shows the same rows."""
    from pool_support import FP, SLOT, block_hash, payload

    from driver import MemDev
    from driver.pool import Fingerprint, KvPool
    from tools.monitor import panels as P
    from tools.monitor.app import dashboard_grid

    fp, pid = Fingerprint(*FP), os.getpid()
    config = DeviceConfig(name=device_name, capacity=256 * MiB, hosts=2, dc_regions=(256 * MiB,))
    with serve(config), MemDev.open(device_name, host=0) as md0, MemDev.open(device_name, host=1) as md1:
        md0.fm_create_pool(8 * MiB, slot_bytes=SLOT)
        with KvPool.open(md0) as pool0, KvPool.open(md1) as pool1:
            out = np.zeros(SLOT, np.uint8)
            assert pool0.publish(fp, block_hash(1), payload(1)) and pool1.load(fp, block_hash(1), out)
            pin = pool0.pin(fp, block_hash(1))
            quota = P.fmt_bytes(pool0.info()["quota"])
            rows = [f"│ 0 {pid} member 1 (8.0 MiB) 8.0 MiB 1 1 0 0 1 0 0 B / {quota} │",
                    f"│ 1 {pid} member 1 (8.0 MiB) 8.0 MiB 0 0 1 1 0 0 0 B / {quota} │"]
            source = DeviceSource(device_name)
            try:
                deadline = time.monotonic() + 10
                while True:  # the firmware publishes ~10 times a second, its pool pass every 20 ms
                    view = source.poll()
                    text = _squeezed(P.hosts_panel(view))
                    if all(row in text for row in rows) or time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
                assert all(row in text for row in rows), text
                assert "pool: 1/" in text and "1 sealed, 1 read across hosts" in text
                assert rows[1] in _squeezed(dashboard_grid([view], 0, time.monotonic(), "t", 160))
            finally:
                source.close()
            assert pin is not None
            pin.release()


def _squeezed(renderable: object) -> str:
    """Rendered 160 columns wide, runs of spaces squeezed (as `frames` does)."""
    import io

    from rich.console import Console

    console = Console(record=True, width=160, color_system=None, file=io.StringIO())
    console.print(renderable)
    return "\n".join(" ".join(line.split()) for line in console.export_text().splitlines())
