"""The CLI on a runtime dir that is not the user's alone, and on device files deleted or
truncated behind a device's back: exit 2 and one line naming the path and the way out (issue 24,
items 1 and 7)."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from emulator.device import DeviceConfig, destroy, device_path, serve
from cli_support import cxlemu, serve_process

MiB = 1 << 20


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The error line of a command that had to fail with exit 2 and nothing else on stderr."""
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (proc.returncode, proc.stderr)
    assert proc.stderr.startswith("cxlemu: error: ") and "Traceback" not in proc.stderr
    return proc.stderr.strip()


def test_every_command_refuses_a_runtime_dir_others_can_reach() -> None:
    parent = Path(tempfile.mkdtemp(prefix="cxlemu-cli-guard-"))
    try:
        root = parent / "rt"
        root.mkdir()
        os.chmod(root, 0o777)
        env = {"CXLEMU_RUNTIME_DIR": str(root)}
        expected = f"cxlemu: error: {root}: runtime dir has mode 0777 (owner uid {os.getuid()} ("
        for args in (("serve", "--name", "mem0", "--capacity", "256M"), ("list",), ("identify", "mem0"),
                     ("destroy", "mem0")):
            assert one_line(cxlemu(*args, env=env)).startswith(expected), args
        assert os.listdir(root) == []
    finally:
        shutil.rmtree(parent)


def test_serve_names_a_deleted_or_truncated_media(device_name: str) -> None:
    with serve(DeviceConfig(name=device_name, capacity=256 * MiB), keep=True):
        pass
    media = device_path(device_name) / "media"
    try:
        os.truncate(media, 0)
        line = one_line(cxlemu("serve", "--name", device_name))
        assert line.startswith(f"cxlemu: error: {media}: is 0 bytes, its device's configuration says {256 * MiB} "
                               f"(truncated?); `truncate -s {256 * MiB} {media}` keeps what is left")
        media.unlink()
        line = one_line(cxlemu("serve", "--name", device_name))
        assert line == (f"cxlemu: error: {media}: is missing (deleted?); serve {device_name} with --fresh to "
                        f"start it empty (what it held is lost), or `cxlemu destroy {device_name}`")
    finally:
        destroy(device_name)


def test_a_host_command_names_a_deleted_mailbox_lock(device_name: str) -> None:
    proc = serve_process(device_name, "--capacity", "256M")
    try:
        lock = device_path(device_name) / "mbox.lock"
        lock.unlink()
        line = one_line(cxlemu("identify", device_name))
        assert line == (f"cxlemu: error: {lock}: is missing (deleted?); stop its server (pid {proc.pid}) and "
                        f"serve {device_name} again: `cxlemu serve --name {device_name}` recreates it, the media kept")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert cxlemu("destroy", device_name).returncode == 0


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another uid needs root")
def test_serve_names_the_other_owner_of_the_runtime_dir() -> None:
    parent = Path(tempfile.mkdtemp(prefix="cxlemu-cli-guard-"))
    try:
        root = parent / "rt"
        root.mkdir(mode=0o700)
        os.chown(root, 65534, 65534)
        line = one_line(cxlemu("serve", "--name", "mem0", "--capacity", "256M", env={"CXLEMU_RUNTIME_DIR": str(root)}))
        assert line.startswith(f"cxlemu: error: {root}: runtime dir is owned by uid 65534")
        assert f"not by you (uid {os.getuid()}" in line and "CXLEMU_RUNTIME_DIR" in line
    finally:
        shutil.rmtree(parent)
