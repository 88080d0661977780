"""A device is a directory under the runtime dir: its configuration, register file and media.
Serving one (its firmware in this process) is ``emulator.serving``; ``emulator.device`` exports both.

    $CXLEMU_RUNTIME_DIR/<name>/        (default /dev/shm/cxlemu-<uid>: memory-backed, like sysfs)
        config.json    DeviceConfig
        bar            register file, BAR_SIZE bytes
        media          the DPA space (sparse until served, then reserved whole)
        lsa            label storage area
        poison         1 bit per 64-B line of media
        access.h<h>    host port h's DC access bitmap: 1 bit per DC block (emulator/dcd.py)
        state.json     poison list and firmware slots (emulator/persist.py); fwslot<N>.img
        firmware.pid   "<pid> <start time>" of the process serving it (emulator/liveness.py)
        mbox.lock      hosts flock it around one mailbox exchange
        bar.h<h>, mbox.h<h>.lock   host port h > 0's BAR and mailbox lock (config.hosts ports)
        host.<h>.lock, host.<h>.pid   the process that claimed port h (driver.MemDev.open)

Hosts and monitors find devices by listing the runtime dir, as `cxl list` walks sysfs.

A device outlives the process that serves it, as hardware outlives a power cycle: serving a
stopped device again (`provision`) keeps its media, LSA, poison list, partition, firmware slots
and configuration. Serving it with a different configuration is refused, naming the difference,
unless ``reconfigure`` (the media is kept where it fits); ``fresh`` starts it empty. A new
device is built in a hidden directory and renamed into place, so a create that fails (a size the
host cannot back) leaves nothing behind and never touches a device of the same name.

The runtime dir, a device's directory and its files are used only when they are this user's
alone (``emulator.runtime_fs``); a served device's files are reserved whole, so a full filesystem
refuses a serve instead of killing a writer with SIGBUS. A file deleted or truncated behind a
device's back is ``DeviceFileDamaged``, naming the file and the way out.
"""
from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import shutil
import zlib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from emulator import liveness
from emulator.runtime_fs import (
    allocated,
    check_private_dir,
    check_room,
    checked_runtime_dir,
    ensure_runtime_dir,
    open_private_file,
    reserve,
    runtime_dir,
)
from emulator.spec import registers as R
from emulator.spec.errors import ConfigError, DeviceFileDamaged, DeviceFileError, DeviceNotFound, NoSpace, NoSuchHost
from emulator.timing.config import TimingConfig

from emulator.spec.payloads_dcd import DC_BLOCK, DC_MAX_REGIONS, DC_REGION_ALIGN, dc_base
from emulator.spec.payloads_memdev import CAPACITY_UNIT
POISON_GRANULE = 64
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,31}$")
_STAGING_PREFIX = ".new-"  # a device being created: <runtime dir>/.new-<name>-<pid>
MAX_HOSTS = 8  # host ports one device serves (config.hosts)


# One home for the names of a host port's files: host 0 keeps the names a one-host device always
# had, so every tool that maps `bar` or locks `mbox.lock` works unchanged.
def bar_name(host: int) -> str:
    """The file holding host port ``host``'s BAR."""
    return "bar" if host == 0 else f"bar.h{host}"


def mbox_lock_name(host: int) -> str:
    """The lock hosts of port ``host`` flock around one mailbox exchange."""
    return "mbox.lock" if host == 0 else f"mbox.h{host}.lock"


def host_lock_name(host: int) -> str:
    """The lock the process that claims port ``host`` holds (flock) while it has it open."""
    return f"host.{host}.lock"


def host_pid_name(host: int) -> str:
    """The claiming process of port ``host``: "<pid> <start time>", as firmware.pid."""
    return f"host.{host}.pid"


def access_name(host: int) -> str:
    """Host port ``host``'s DC access bitmap: 1 bit per DC block over [dc_base, dc_base + dc_total);
    block i is byte i>>3, bit i&7; set: the host may access it (written by the firmware alone)."""
    return f"access.h{host}"


def check_host(name: str, host: int, hosts: int) -> None:
    """Refuse (``NoSuchHost``) a host port the device does not have."""
    if isinstance(host, bool) or not isinstance(host, int) or not 0 <= host < hosts:
        raise NoSuchHost(name, host, hosts)


@dataclass(frozen=True, kw_only=True)
class DeviceConfig:
    """What a device is: name, size and how its link behaves."""

    name: str
    capacity: int = 1 << 30
    lsa_size: int = 128 << 10
    numa_node: int | None = None
    serial: int | None = None
    fw_revision: str = "cxlemu-0.1.0"
    preset: str | None = None
    hosts: int = 1  # host ports, each its own BAR and mailbox (an older config.json has none: 1)
    dc_regions: tuple[int, ...] = ()  # Dynamic Capacity region lengths, after the static capacity (older: none)
    timing: TimingConfig = field(default_factory=TimingConfig)

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ConfigError(f"device name {self.name!r} must start with a letter or a digit, followed by up "
                              f"to 31 letters, digits, '_', '.' or '-' (e.g. mem0)")
        if self.capacity <= 0 or self.capacity % CAPACITY_UNIT:
            raise ConfigError(f"capacity {self.capacity} must be a positive multiple of 256 MiB (e.g. 256M, 1G)")
        if not 0 <= self.lsa_size <= 1 << 20 or self.lsa_size % 64:
            raise ConfigError(f"lsa_size {self.lsa_size} must be a multiple of 64 bytes up to 1 MiB")
        if self.numa_node is not None and self.numa_node < 0:
            raise ConfigError(f"numa_node must be >= 0 or None, got {self.numa_node}")
        if len(self.fw_revision.encode()) > 16:
            raise ConfigError(f"fw_revision {self.fw_revision!r} is longer than 16 bytes")
        if isinstance(self.hosts, bool) or not isinstance(self.hosts, int) or not 1 <= self.hosts <= MAX_HOSTS:
            raise ConfigError(f"hosts {self.hosts!r} must be an integer from 1 to {MAX_HOSTS}")
        object.__setattr__(self, "dc_regions", tuple(self.dc_regions))
        if len(self.dc_regions) > DC_MAX_REGIONS or any(
                isinstance(n, bool) or not isinstance(n, int) or n <= 0 or n % DC_REGION_ALIGN for n in self.dc_regions):
            raise ConfigError(f"dc_regions {list(self.dc_regions)!r}: at most {DC_MAX_REGIONS} regions, each a "
                              f"positive multiple of 256 MiB")
        if self.serial is None:
            object.__setattr__(self, "serial", zlib.crc32(self.name.encode()) | 0xC0DE_0000_0000)

    @property
    def dc_base(self) -> int:
        """DPA of DC region 0: the static capacity rounded up to 256 MiB."""
        return dc_base(self.capacity)

    @property
    def dc_total(self) -> int:
        """Bytes of all DC regions together."""
        return sum(self.dc_regions)

    @property
    def media_bytes(self) -> int:
        """The media file's size: the static capacity, then the DC regions (none: the capacity)."""
        return self.dc_base + self.dc_total if self.dc_regions else self.capacity

    @property
    def dc_blocks(self) -> int:
        """DC blocks over all regions: the bits of each access bitmap."""
        return self.dc_total // DC_BLOCK

    def to_json(self) -> str:
        data = asdict(self)
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "DeviceConfig":
        data: dict[str, Any] = json.loads(text)
        data["timing"] = TimingConfig.from_dict(data.get("timing") or {})
        return cls(**data)

    def with_(self, **changes: Any) -> "DeviceConfig":
        return replace(self, **changes)

    def differences(self, other: "DeviceConfig") -> list[str]:
        """What differs from ``other``, one 'field: mine -> other's' each (timing field by field)."""
        out = []
        mine, theirs = asdict(self), asdict(other)
        for key in sorted(mine):
            if key == "timing":
                for tk in sorted(mine[key]):
                    if mine[key][tk] != theirs[key][tk]:
                        out.append(f"timing.{tk}: {mine[key][tk]} -> {theirs[key][tk]}")
            elif mine[key] != theirs[key]:
                out.append(f"{key}: {_show(key, mine[key])} -> {_show(key, theirs[key])}")
        return out


def _show(key: str, value: Any) -> str:
    if key == "dc_regions":
        return repr([f"{n >> 20} MiB" for n in value])
    if key in ("capacity", "lsa_size") and isinstance(value, int):
        return f"{value} ({value >> 20} MiB)" if value >= 1 << 20 else str(value)
    return repr(value)


def device_path(name: str) -> Path:
    return runtime_dir() / name


def _checked_device_dir(name: str) -> Path:
    """The device's directory, after checking it and the runtime dir are this user's alone."""
    path = checked_runtime_dir() / name
    check_private_dir(path, "device directory", private=False)
    return path


def list_devices() -> list[str]:
    """Names of the devices under the runtime dir, sorted."""
    root = checked_runtime_dir()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir()
                  if not p.name.startswith(".") and (p / "config.json").is_file())


def firmware_pid(name: str) -> int | None:
    """The pid serving `name`, or None when no live process serves it (none recorded, exited, or
    a zombie: killed and not yet reaped)."""
    return liveness.firmware_pid(device_path(name))


def device_state(name: str) -> str:
    """'served' while a firmware runs, 'stopped' otherwise (`cxl list` shows enabled/disabled)."""
    return "served" if firmware_pid(name) is not None else "stopped"


def load_config(name: str) -> DeviceConfig:
    """The device's stored configuration. A file this cxlemu cannot take (damaged, or written by
    an older one with values it now refuses) is a ``ConfigError`` naming the device, the file
    and the way out, never a bare parse error."""
    path = _checked_device_dir(name) / "config.json"
    try:
        fd = open_private_file(path, os.O_RDONLY)
    except FileNotFoundError:
        raise DeviceNotFound(name, str(runtime_dir())) from None
    with open(fd, encoding="utf-8") as f:
        text = f.read()
    try:
        return DeviceConfig.from_json(text)
    except (ValueError, TypeError, KeyError, ConfigError) as exc:  # JSONDecodeError is a ValueError
        raise ConfigError(f"device {name!r}: {path} cannot be used ({exc}); "
                          f"`cxlemu destroy {name}` removes the device") from None


def _map(path: Path, size: int, *, writable: bool = True) -> mmap.mmap:
    """Map a device file of this user's (no symlink followed) that holds at least ``size`` bytes;
    ``DeviceFileDamaged`` for one deleted or truncated (mapping past its end would SIGBUS)."""
    try:
        fd = open_private_file(path, os.O_RDWR if writable else os.O_RDONLY)
    except FileNotFoundError:
        raise DeviceFileDamaged(path, "is missing (deleted?)", _damaged_remedy(path)) from None
    try:
        found = os.fstat(fd).st_size
        if found < size:
            raise DeviceFileDamaged(path, f"is {found} bytes, its device's configuration says {size} (truncated?)",
                                    f"`truncate -s {size} {path}` keeps what is left (the rest reads zeros); or "
                                    + _damaged_remedy(path))
        if size == 0:
            return mmap.mmap(-1, 1)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
    finally:
        os.close(fd)


def _stop_first(device_dir: Path) -> str:
    """'stop its server (pid N) and ' while a firmware serves the device, else ''."""
    pid = liveness.firmware_pid(device_dir)
    return f"stop its server (pid {pid}) and " if pid is not None else ""


def _damaged_remedy(path: Path) -> str:
    """The way out for a device whose file ``path`` was deleted or truncated."""
    name = path.parent.name
    return (f"{_stop_first(path.parent)}serve {name} with --fresh to start it empty (what it held is lost), "
            f"or `cxlemu destroy {name}`")


def open_bar(name: str, *, writable: bool = False, host: int = 0) -> mmap.mmap:
    """Map a device's register file (read-only by default: monitors never write); ``host``: that
    host port's BAR (``NoSuchHost`` past the device's ports)."""
    path = _checked_device_dir(name)
    if not (path / "config.json").is_file():
        raise DeviceNotFound(name, str(runtime_dir()))
    if host != 0:
        check_host(name, host, load_config(name).hosts)
    return _map(path / bar_name(host), R.BAR_SIZE, writable=writable)


class DeviceFiles:
    """The mapped files of one device, shared by whoever opens them."""

    def __init__(self, config: DeviceConfig, path: Path, *, writable: bool = True, host: int = 0) -> None:
        """``host``: the host port whose BAR ``bar`` maps (the firmware maps the others too,
        ``host_bars``); ``NoSuchHost`` past the device's ports."""
        check_host(config.name, host, config.hosts)
        self.config = config
        self.name = config.name
        self.path = path
        self.host = host
        self._writable = writable
        self.bar = _map(path / bar_name(host), R.BAR_SIZE, writable=writable)
        self._other_bars: dict[int, mmap.mmap] = {}
        self.media = _map(path / "media", config.media_bytes, writable=writable)
        self.lsa = _map(path / "lsa", config.lsa_size, writable=writable)
        self.poison = _map(path / "poison", poison_bitmap_size(config.media_bytes), writable=writable)
        self._access: dict[tuple[int, bool], mmap.mmap] = {}
        self._closed = False

    @classmethod
    def create(cls, config: DeviceConfig) -> "DeviceFiles":
        """Create the device's files empty, replacing a stopped device of that name; refuses while
        a firmware serves it. Checked and built aside first: a create that fails changes nothing."""
        path = device_path(config.name)
        pid = firmware_pid(config.name)
        if pid is not None:
            raise ConfigError(f"device {config.name!r} is already served by pid {pid}")
        check_backing(config)
        staged = _build(config)
        try:  # the old device's space comes back when it is retired, before the server reserves the new one
            check_room(runtime_dir(), _paths(staged, config), config.name, freed=_held(path))
        except NoSpace:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        if path.exists():
            _retire(path)
        os.rename(staged, path)
        return cls(config, path)

    def host_bars(self) -> list[mmap.mmap]:
        """Every host port's BAR, port order (the firmware serves them all); mapped once."""
        for h in range(self.config.hosts):
            if h != self.host and h not in self._other_bars:
                self._other_bars[h] = _map(self.path / bar_name(h), R.BAR_SIZE, writable=self._writable)
        return [self.bar if h == self.host else self._other_bars[h] for h in range(self.config.hosts)]

    def access_bits(self, host: int, *, writable: bool | None = None) -> mmap.mmap:
        """Host port ``host``'s DC access bitmap (``access_name``), mapped once per mode; writable
        as the files are unless ``writable`` says (the firmware writes them; a host maps its own
        read-only)."""
        check_host(self.name, host, self.config.hosts)
        mode = self._writable if writable is None else writable
        if (host, mode) not in self._access:
            self._access[(host, mode)] = _map(self.path / access_name(host), access_bitmap_size(self.config),
                                              writable=mode)
        return self._access[(host, mode)]

    @classmethod
    def open(cls, name: str, *, writable: bool = True, host: int = 0) -> "DeviceFiles":
        config = load_config(name)
        try:
            return cls(config, device_path(name), writable=writable, host=host)
        except DeviceFileDamaged:
            if not (device_path(name) / "config.json").exists():  # destroyed since load_config
                raise DeviceNotFound(name, str(runtime_dir())) from None
            raise

    def reserve(self) -> None:
        """Allocate the files whole (``runtime_fs.reserve``): no write through their mappings can
        then find the filesystem full. ``emulator.serving`` calls it after binding the media to
        its NUMA node, so the pages land there; ``NoSpace`` when they do not fit."""
        reserve(self.path.parent, _paths(self.path, self.config), self.name)

    def open_lock(self, fname: str) -> int:
        """An fd on the device's lock file ``fname`` (mbox.lock); ``DeviceFileDamaged`` if it is gone.
        Never recreated here: a host locking a new file while others lock the old one would not
        exclude them. Serving the device again recreates it (``provision``)."""
        path = self.path / fname
        try:
            return open_private_file(path, os.O_RDWR)
        except FileNotFoundError:
            raise DeviceFileDamaged(path, "is missing (deleted?)",
                                    f"{_stop_first(self.path)}serve {self.name} again: `cxlemu serve --name {self.name}` recreates "
                                    f"it, the media kept") from None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for m in (self.bar, self.media, self.lsa, self.poison, *self._other_bars.values(), *self._access.values()):
            with contextlib.suppress(BufferError):  # live views elsewhere: let GC unmap
                m.close()

    def destroy(self) -> None:
        self.close()
        shutil.rmtree(self.path, ignore_errors=True)


def poison_bitmap_size(capacity: int) -> int:
    return (capacity // POISON_GRANULE + 7) // 8


def access_bitmap_size(config: DeviceConfig) -> int:
    """Bytes of one host port's DC access bitmap: 1 bit per DC block."""
    return (config.dc_blocks + 7) // 8


def _file_sizes(config: DeviceConfig) -> dict[str, int]:
    bars = {bar_name(h): R.BAR_SIZE for h in range(config.hosts)}
    access = {access_name(h): access_bitmap_size(config) for h in range(config.hosts)}
    return {**bars, **access, "media": config.media_bytes, "lsa": config.lsa_size,
            "poison": poison_bitmap_size(config.media_bytes)}


def _lock_names(config: DeviceConfig) -> list[str]:
    """The lock files a device has (created by a serve, never by a host)."""
    return [n for h in range(config.hosts) for n in (mbox_lock_name(h), host_lock_name(h))]


def _paths(path: Path, config: DeviceConfig) -> dict[Path, int]:
    """The mapped files of the device at ``path`` with the sizes ``config`` gives them."""
    return {path / fname: size for fname, size in _file_sizes(config).items()}


def _held(path: Path) -> int:
    """Bytes the device at ``path`` holds on its filesystem (0: none there)."""
    return sum(allocated(p) for p in path.iterdir()) if path.is_dir() else 0


def check_backing(config: DeviceConfig) -> None:
    """Refuse (ConfigError) a device the host cannot back: its files must fit the filesystem of
    the runtime dir (tmpfs: memory), which is where its pages land once written."""
    root = runtime_dir()
    probe = root if root.exists() else next((p for p in root.parents if p.exists()), Path("/"))
    st = os.statvfs(probe)
    limit = st.f_blocks * st.f_frsize
    need = sum(_file_sizes(config).values())
    if need > limit:
        fit = (limit - config.hosts * R.BAR_SIZE - config.lsa_size) * 512 // 513 // CAPACITY_UNIT * CAPACITY_UNIT
        hint = f"at most {fit >> 20} MiB here" if fit > 0 else "none fits here"
        raise ConfigError(f"capacity {config.capacity} ({config.capacity >> 20} MiB) cannot be backed: the "
                          f"runtime dir {root} is on a filesystem of {limit >> 20} MiB ({hint}; "
                          f"CXLEMU_RUNTIME_DIR chooses another)")


def _build(config: DeviceConfig) -> Path:
    """The device's files, empty, in a staging directory beside where it will live."""
    root = ensure_runtime_dir()
    for old in root.glob(f"{_STAGING_PREFIX}{config.name}-*"):  # debris of a create that died
        pid = old.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or not liveness.process_alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    staged = root / f"{_STAGING_PREFIX}{config.name}-{os.getpid()}"
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(mode=0o700)
    try:
        for fname, size in _file_sizes(config).items():
            with open(staged / fname, "wb") as f:
                f.truncate(size)
        for lock in _lock_names(config):
            (staged / lock).touch()
        (staged / "config.json").write_text(config.to_json())
    except OSError as exc:
        shutil.rmtree(staged, ignore_errors=True)
        raise ConfigError(f"device {config.name!r} cannot be created in {root}: {exc.strerror or exc}") from None
    return staged


def _retire(path: Path) -> None:
    """Remove a stopped device's directory; hosts still holding its BAR see it down first."""
    for bar_file in sorted(path.glob("bar*")):  # every host port's BAR
        with contextlib.suppress(OSError, ValueError, DeviceFileError):  # damaged: nobody maps it
            bar = _map(bar_file, R.BAR_SIZE)
            view = liveness.state_view(bar)
            liveness.mark_down(view, view[0])
            view.release()
            bar.close()
    shutil.rmtree(path)


def _resize(path: Path, old: DeviceConfig, new: DeviceConfig) -> None:
    """Reconfigure a stopped device's files in place: media, LSA and poison bitmap take the new
    sizes (contents kept where they fit; a larger device reads zeros past the old end); host
    ports added get their BAR, those removed lose theirs."""
    old_sizes = _file_sizes(old)
    for fname, size in _file_sizes(new).items():
        if size != old_sizes.get(fname):
            os.close(open_private_file(path / fname, os.O_RDWR | os.O_CREAT))
            os.truncate(path / fname, size)
    for h in range(new.hosts, old.hosts):
        for fname in (bar_name(h), access_name(h), mbox_lock_name(h), host_lock_name(h), host_pid_name(h)):
            with contextlib.suppress(FileNotFoundError):
                (path / fname).unlink()
    (path / "config.json").write_text(new.to_json())


def provision(config: DeviceConfig, *, fresh: bool = False, reconfigure: bool = False) -> DeviceFiles:
    """The files a firmware serves ``config`` from: the stopped device of that name as it was
    (same configuration), reconfigured (``reconfigure``), or new (none yet, or ``fresh``)."""
    name = config.name
    path = _checked_device_dir(name)
    pid = firmware_pid(name)
    if pid is not None:
        raise ConfigError(f"device {name!r} is already served by pid {pid}")
    if fresh or not (path / "config.json").is_file():
        return DeviceFiles.create(config)
    try:
        stored = load_config(name)
    except ConfigError as exc:
        raise ConfigError(f"{exc}; or serve it with --fresh to start it empty") from None
    diff = stored.differences(config)
    if diff and not reconfigure:
        raise ConfigError(f"device {name!r} exists with another configuration ({'; '.join(diff)}): serve "
                          f"it as it is (leave those settings out), add --reconfigure to change them "
                          f"(its media kept where it fits), or --fresh to start it empty")
    if diff:
        DeviceFiles(stored, path, writable=False).close()  # a deleted or truncated file: refused, unchanged
        check_backing(config)
    check_room(path.parent, _paths(path, config), name)  # reserved by the server (DeviceFiles.reserve)
    if diff:
        try:
            _resize(path, stored, config)
        except OSError as exc:
            raise ConfigError(f"device {name!r} cannot be reconfigured: {exc.strerror or exc}") from None
    # a lock deleted while the device was stopped: no host of an earlier boot locks it again
    for lock in _lock_names(config):
        _create_missing(path / lock, 0)
    for h in range(config.hosts):  # a device from before DC has no access bitmaps: zeroed (the firmware rebuilds them)
        _create_missing(path / access_name(h), access_bitmap_size(config))
    return DeviceFiles(config, path)


def _create_missing(path: Path, size: int) -> None:
    """Create ``path`` empty, or ``size`` zero bytes, where it is missing; as every device file
    is opened (``open_private_file``: never through a symlink, only the user's own)."""
    try:
        fd = open_private_file(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    except FileExistsError:  # there, as it is (one damaged is named when the files are opened)
        os.close(open_private_file(path, os.O_RDWR))
        return
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def destroy(name: str) -> None:
    """Remove a stopped device's files; refuses while it is served."""
    path = checked_runtime_dir() / name
    if not (path / "config.json").exists():
        raise DeviceNotFound(name, str(runtime_dir()))
    pid = firmware_pid(name)
    if pid is not None:
        raise ConfigError(f"device {name!r} is served by pid {pid}: stop it (SIGTERM) before destroying it")
    _retire(path)


def host_claims(name: str) -> list[dict[str, Any]]:
    """Each host port of the device and the live process that claimed it (None: unclaimed), as
    ``cxlemu list`` shows them: ``[{"host": 0, "pid": 1234}, {"host": 1, "pid": None}]``."""
    path = device_path(name)
    hosts = load_config(name).hosts
    return [{"host": h, "pid": liveness.firmware_pid(path, host_pid_name(h))} for h in range(hosts)]


def numa_node(name: str) -> int | None:
    """The node the device's media lives on as its server found it (-1: unknown)."""
    try:
        return int((device_path(name) / "numa_node").read_text())
    except (OSError, ValueError):
        return None


__all__ = [
    "CAPACITY_UNIT", "MAX_HOSTS", "DeviceConfig", "DeviceFiles", "access_bitmap_size", "access_name", "bar_name", "check_backing", "check_host",
    "destroy", "device_path", "device_state", "firmware_pid", "host_claims", "host_lock_name", "host_pid_name",
    "list_devices", "load_config", "mbox_lock_name", "numa_node", "open_bar", "poison_bitmap_size", "provision",
    "runtime_dir",
]
