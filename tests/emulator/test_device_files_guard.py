"""A runtime dir, device directory or device file that is not this user's alone is refused, never
adopted; a device file deleted or truncated behind a device's back is named with the way out
(issue 24, items 1 and 7)."""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from driver import DeviceFileDamaged, MemDev, UnsafePath
from emulator.device import DeviceConfig, DeviceFiles, destroy, device_path, list_devices, serve
from emulator.spec import registers as R

MiB = 1 << 20
NOBODY = 65534
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another uid needs root")


@pytest.fixture
def other_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A runtime dir of its own for one test (the session's stays untouched), removed after."""
    parent = Path(tempfile.mkdtemp(prefix="cxlemu-guard-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    root = parent / "rt"
    monkeypatch.setenv("CXLEMU_RUNTIME_DIR", str(root))
    yield root
    shutil.rmtree(parent, ignore_errors=True)


def plant_device(root: Path, name: str, capacity: int = 256 * MiB) -> Path:
    """What another user plants before the owner's first run: a device directory with a
    configuration and its files, all mode 0666, the media holding bytes to watch."""
    config = DeviceConfig(name=name, capacity=capacity)
    path = root / name
    path.mkdir(parents=True)
    (path / "config.json").write_text(config.to_json())
    for fname, size in {"bar": R.BAR_SIZE, "media": capacity, "lsa": config.lsa_size,
                        "poison": capacity // 512, "mbox.lock": 0}.items():
        with open(path / fname, "wb") as f:
            f.truncate(size)
        os.chmod(path / fname, 0o666)
    with open(path / "media", "r+b") as f:
        f.write(b"planted")
    return path


def test_a_runtime_dir_with_group_or_other_bits_is_refused(other_root: Path) -> None:
    other_root.mkdir(mode=0o700)
    os.chmod(other_root, 0o777)  # what a planted /dev/shm/cxlemu-<uid> would have
    with pytest.raises(UnsafePath) as info:
        with serve(DeviceConfig(name="mem0", capacity=256 * MiB)):
            pass
    msg = str(info.value)
    assert msg.startswith(f"{other_root}: runtime dir has mode 0777 (owner uid {os.getuid()} (")
    assert f"chmod 700 {other_root}" in msg and "\n" not in msg
    assert info.value.path == str(other_root)
    assert not (other_root / "mem0").exists()
    with pytest.raises(UnsafePath):
        list_devices()


@needs_root
def test_a_runtime_dir_another_user_made_is_refused_with_its_owner(other_root: Path) -> None:
    plant_device(other_root, "mem0")
    os.chmod(other_root, 0o700)  # even private: it is another user's
    os.chown(other_root, NOBODY, NOBODY)
    with pytest.raises(UnsafePath, match=rf"^{other_root}: runtime dir is owned by uid {NOBODY}\b.*not by you"):
        with serve(DeviceConfig(name="mem0", capacity=256 * MiB)):
            pass
    with pytest.raises(UnsafePath, match="owned by uid 65534"):
        DeviceFiles.open("mem0")
    with pytest.raises(UnsafePath, match="owned by uid 65534"):
        MemDev.open("mem0")
    assert (other_root / "mem0" / "media").read_bytes()[:7] == b"planted"  # nothing adopted, nothing changed


@needs_root
def test_a_device_directory_or_file_of_another_user_is_refused(other_root: Path) -> None:
    other_root.mkdir(mode=0o700)
    planted = plant_device(other_root, "mem0")
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(UnsafePath, match=rf"^{planted}: device directory is owned by uid {NOBODY}"):
        with serve(DeviceConfig(name="mem0", capacity=256 * MiB)):
            pass
    os.chown(planted, os.getuid(), os.getgid())
    os.chown(planted / "media", NOBODY, NOBODY)
    with pytest.raises(UnsafePath, match=rf"^{planted / 'media'}: is a regular file owned by uid {NOBODY}"):
        with serve(DeviceConfig(name="mem0", capacity=256 * MiB)):
            pass
    with serve(DeviceConfig(name="mem0", capacity=256 * MiB), fresh=True):  # the remedy it names
        with MemDev.open("mem0") as md:
            assert md.read(0, 7) == bytes(7)


def test_a_symlinked_runtime_dir_or_device_file_is_refused(other_root: Path, tmp_path: Path) -> None:
    other_root.parent.mkdir(exist_ok=True)
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    other_root.symlink_to(target)
    with pytest.raises(UnsafePath, match=rf"^{other_root}: runtime dir is a symlink"):
        with serve(DeviceConfig(name="mem0", capacity=256 * MiB)):
            pass
    other_root.unlink()
    with serve(DeviceConfig(name="mem0", capacity=256 * MiB), keep=True):
        pass
    media = other_root / "mem0" / "media"
    secret = tmp_path / "secret"
    secret.write_bytes(bytes(256 * MiB))
    media.unlink()
    media.symlink_to(secret)
    with pytest.raises(UnsafePath, match=rf"^{media}: is a symlink .*serve mem0 with --fresh"):
        with serve(DeviceConfig(name="mem0", capacity=256 * MiB)):
            pass
    destroy("mem0")


def test_a_deleted_or_truncated_media_is_named_with_the_way_out(device_name: str) -> None:
    config = DeviceConfig(name=device_name, capacity=256 * MiB)
    media = device_path(device_name) / "media"
    with serve(config, keep=True):
        with MemDev.open(device_name) as md:
            md.write(0, b"kept before the cut")
    os.truncate(media, 4096)
    with pytest.raises(DeviceFileDamaged) as info:
        with serve(config):
            pass
    assert str(info.value) == (
        f"{media}: is 4096 bytes, its device's configuration says {256 * MiB} (truncated?); "
        f"`truncate -s {256 * MiB} {media}` keeps what is left (the rest reads zeros); or serve {device_name} "
        f"with --fresh to start it empty (what it held is lost), or `cxlemu destroy {device_name}`")
    with pytest.raises(DeviceFileDamaged, match="truncated"):
        with serve(config.with_(capacity=512 * MiB), reconfigure=True):
            pass
    assert os.stat(media).st_size == 4096  # refused before any change
    os.truncate(media, 256 * MiB)  # the remedy it names
    with serve(config, keep=True):
        with MemDev.open(device_name) as md:
            assert md.read(0, 19) == b"kept before the cut"
    media.unlink()
    with pytest.raises(DeviceFileDamaged, match=rf"^{media}: is missing \(deleted\?\); serve {device_name} "
                                                r"with --fresh"):
        with serve(config):
            pass
    with serve(config, fresh=True):
        assert media.stat().st_size == 256 * MiB


def test_a_served_device_whose_media_or_lock_went_names_it_on_open(device_name: str) -> None:
    config = DeviceConfig(name=device_name, capacity=256 * MiB)
    path = device_path(device_name)
    with serve(config, keep=True):
        (path / "mbox.lock").unlink()
        with pytest.raises(DeviceFileDamaged) as info:
            MemDev.open(device_name)
        assert str(info.value) == (
            f"{path / 'mbox.lock'}: is missing (deleted?); stop its server (pid {os.getpid()}) and serve "
            f"{device_name} again: `cxlemu serve --name {device_name}` recreates it, the media kept")
        os.rename(path / "media", path / "media.moved")
        with pytest.raises(DeviceFileDamaged, match=rf"^{path / 'media'}: is missing \(deleted\?\); stop its "
                                                    rf"server \(pid {os.getpid()}\) and serve"):
            MemDev.open(device_name)
        os.rename(path / "media.moved", path / "media")
    with serve(config) as served:  # serving again recreates the lock
        with MemDev.open(device_name) as md:
            assert md.identify_memdev().total_bytes == 256 * MiB
        assert served.firmware.generation == 2
