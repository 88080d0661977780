"""A full filesystem never kills a process (issue 24, item 4): a served device's files are
reserved whole, a device that does not fit the free space is refused saying how much is free and
needed, and a host writing every byte of a device on a full disk never dies of SIGBUS."""
from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
import time
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from emulator.device import DeviceConfig, serve
from emulator.spec import registers as R
from emulator.spec.errors import ConfigError, NoSpace
from cli_support import ROOT, cxlemu, serve_process

MiB = 1 << 20
FS_SIZE = 300 * MiB
# what a 256 MiB device reserves: media, BAR, a 128 KiB LSA, the poison bitmap (1 bit per 64 B)
NEED_256M = -(-(256 * MiB + R.BAR_SIZE + (128 << 10) + 256 * MiB // 512) // MiB)


@pytest.fixture
def small_fs(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A runtime dir on a 300 MiB tmpfs of its own, unmounted after whatever happened."""
    if os.getuid() != 0:
        pytest.skip("mounting a 300 MiB tmpfs needs root")
    mnt = Path(tempfile.mkdtemp(prefix="cxlemu-small-"))
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_SIZE},mode=0700", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        mnt.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    monkeypatch.setenv("CXLEMU_RUNTIME_DIR", str(mnt / "rt"))
    try:
        yield mnt / "rt"
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        mnt.rmdir()


def free_mib(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize // MiB


def fill(path: Path) -> int:
    """Write ``path`` until the filesystem is full; the bytes written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    chunk, written = b"\xff" * MiB, 0
    try:
        while True:
            try:
                written += os.write(fd, chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if len(chunk) <= 4096:
                    return written
                chunk = chunk[: len(chunk) // 2]
    finally:
        os.close(fd)


# A host writing every byte of the device; "sanitize" first sanitizes (its zeros keep the
# reservation: punching holes had let the next write find the disk full and die of SIGBUS);
# "full" writes on the full disk, where a Sanitize is refused (state.json cannot be saved).
WRITER = """
import sys
import numpy as np
from driver import MemDev
from emulator.spec.errors import MailboxError
with MemDev.open(sys.argv[1]) as md:
    if sys.argv[2] == "sanitize":
        md.sanitize()
    chunk = np.full(16 << 20, 0xA5, np.uint8)
    for off in range(0, md.config.capacity, chunk.nbytes):
        md.write_untimed(off, chunk)
    assert md.read_untimed(md.config.capacity - 16, 16) == b"\\xa5" * 16
    if sys.argv[2] == "full":
        try:
            md.sanitize()
        except MailboxError as exc:
            print(f"sanitize refused: {exc.name}")
print("wrote every byte")
"""


def test_a_device_the_free_space_cannot_hold_is_refused_saying_how_much(small_fs: Path) -> None:
    first = DeviceConfig(name="a", capacity=256 * MiB)
    with serve(first, keep=True):
        assert os.stat(small_fs / "a" / "media").st_blocks * 512 == 256 * MiB  # reserved at serve time
        with pytest.raises(NoSpace) as info:
            with serve(DeviceConfig(name="b", capacity=256 * MiB)):
                pass
        free = free_mib(small_fs)
    assert isinstance(info.value, ConfigError) and info.value.path == str(small_fs)
    m = re.fullmatch(rf"{small_fs}: (\d+) MiB free, device 'b' needs (\d+) MiB more to reserve its files "
                     r"\(.*SIGBUS.*\); .*CXLEMU_RUNTIME_DIR to a filesystem with room", str(info.value))
    assert m, str(info.value)
    assert int(m[2]) == NEED_256M == 257 and abs(int(m[1]) - free) <= 1 and int(m[1]) < 44
    assert sorted(os.listdir(small_fs)) == ["a"]  # nothing of b left behind
    with serve(first, fresh=True, keep=True):  # the old device's space is freed before the new reserves
        pass
    with serve(first):  # as it was: already reserved
        pass
    assert free_mib(small_fs) > 250


def test_a_full_disk_never_kills_a_host_or_the_firmware_with_sigbus(small_fs: Path) -> None:
    procs: list[subprocess.Popen[str]] = []
    filler = small_fs.parent / "filler"
    try:
        procs.append(serve_process("a", "--capacity", "256M"))
        refused = cxlemu("serve", "--name", "b", "--capacity", "256M")
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert re.match(rf"cxlemu: error: {small_fs}: \d+ MiB free, device 'b' needs {NEED_256M} MiB more",
                        refused.stderr), refused.stderr
        for phase, said in (("sanitize", "wrote every byte\n"),
                            ("full", "sanitize refused: Internal Error\nwrote every byte\n")):
            if phase == "full":
                assert fill(filler) > 0 and free_mib(small_fs) == 0
            host = subprocess.run([sys.executable, "-c", WRITER, "a", phase], cwd=ROOT, capture_output=True,
                                  text=True, timeout=300, env=os.environ.copy())
            assert host.returncode == 0, \
                f"host exited {host.returncode} (-{int(signal.SIGBUS)}: SIGBUS) in {phase}: {host.stderr}"
            assert (phase, host.stdout) == (phase, said)
        inject = cxlemu("poison", "inject", "a", "0x1000")
        assert procs[0].poll() is None, f"the firmware exited {procs[0].returncode} on Inject Poison"
        # state.json cannot be saved on a full disk: the change is not acknowledged (item 3)
        assert (inject.returncode, inject.stderr) == (
            1, "cxlemu: error: a: device returned 0x04 Internal Error (opcode 0x4301)\n")
        filler.unlink()  # room again: the firmware's next save (back-off <= 10 s) clears the refusal
        deadline = time.monotonic() + 30
        while (inject := cxlemu("poison", "inject", "a", "0x1000")).returncode != 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert inject.returncode == 0, inject.stderr
        listed = cxlemu("poison", "list", "a")
        assert listed.returncode == 0 and '"dpa": 4096' in listed.stdout, listed.stdout
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        filler.unlink(missing_ok=True)
    assert procs[0].returncode == 0
