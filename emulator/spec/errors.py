"""Exceptions a host sees (the driver re-exports them). Firmware never raises these to a host:
device-visible errors are mailbox return codes."""
from __future__ import annotations


class CxlemuError(Exception):
    """Base of every cxlemu error a caller may catch."""


class ConfigError(CxlemuError, ValueError):
    """A configuration value is out of range; the message says what to change."""


class DeviceFileError(CxlemuError):
    """The runtime dir or a device's file cannot be used as it is; the message names the path,
    what was found there and what to do."""

    def __init__(self, path: object, found: str, remedy: str) -> None:
        self.path = str(path)
        self.found = found
        self.remedy = remedy
        super().__init__(f"{self.path}: {found}; {remedy}")


class UnsafePath(DeviceFileError):
    """The runtime dir, a device's directory or file is not this user's alone (another user owns
    it, can reach it, or it is a symlink): refused, never adopted, as XDG_RUNTIME_DIR is checked."""


class DeviceFileDamaged(DeviceFileError):
    """A device's file was deleted or truncated behind its back: nothing was mapped."""


class NoSpace(DeviceFileError, ConfigError):
    """The runtime dir's filesystem has too little free space to reserve a device's files:
    refused before anything was created or changed."""


class MailboxError(CxlemuError):
    """A mailbox command completed with a return code other than Success."""

    def __init__(self, retcode: int, opcode: int | None = None, detail: str = "") -> None:
        from emulator.spec.retcodes import retcode_name

        self.retcode = int(retcode)
        self.opcode = opcode
        self.name = retcode_name(self.retcode)
        where = f" (opcode {opcode:#06x})" if opcode is not None else ""
        msg = f"device returned {self.retcode:#04x} {self.name}{where}"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class MailboxTimeout(CxlemuError, TimeoutError):
    """The doorbell did not clear in time: the firmware is not servicing the mailbox."""


class PoisonError(CxlemuError):
    """A read touched a poisoned 64-B line; no data was returned."""

    def __init__(self, dpa: int) -> None:
        self.dpa = int(dpa)
        super().__init__(f"poisoned line at DPA {self.dpa:#x}: read returned no data")


class NoExtent(CxlemuError):
    """A transfer touched a Dynamic Capacity block this host holds no accepted extent for (the
    device's access bitmap, written by the firmware); nothing was moved."""

    def __init__(self, dpa: int) -> None:
        self.dpa = int(dpa)
        super().__init__(f"no extent at DPA {self.dpa:#x}: a host reaches Dynamic Capacity only through "
                         f"extents it accepted (Add DC Response); no data was moved")


class DeviceNotFound(CxlemuError, LookupError):
    """No device directory of that name under the runtime dir."""

    def __init__(self, name: str, runtime_dir: str = "") -> None:
        self.device_name = name
        where = f" in {runtime_dir}" if runtime_dir else ""
        super().__init__(f"no device named {name!r}{where} (see `cxlemu list`)")


class NoSuchHost(CxlemuError, ValueError):
    """A host port the device does not have (ports are 0 .. hosts-1, ``DeviceConfig.hosts``)."""

    def __init__(self, name: str, host: object, hosts: int) -> None:
        self.device_name, self.host, self.hosts = name, host, hosts
        super().__init__(f"device {name!r} has {hosts} host port{'s' if hosts != 1 else ''} "
                         f"(0..{hosts - 1}): no host {host!r} (`cxlemu serve --hosts N --reconfigure` adds ports)")


class PortClaimed(CxlemuError):
    """Another live process holds this host port (``MemDev.open(name, host=h)`` claims it)."""

    def __init__(self, name: str, host: int, pid: int) -> None:
        self.device_name, self.host, self.pid = name, host, pid
        super().__init__(f"device {name!r}: host port {host} is claimed by pid {pid}: open another port "
                         f"(host=) or stop that process")


class DeviceGone(CxlemuError):
    """The device went away (its firmware stopped or its files were destroyed)."""

    def __init__(self, name: str, detail: str = "") -> None:
        self.device_name = name
        super().__init__(f"device {name!r} is gone" + (f": {detail}" if detail else ""))


class MediaDisabled(CxlemuError):
    """The device's media is disabled (a sanitize or secure erase runs): no data was moved."""

    def __init__(self, name: str, detail: str = "") -> None:
        self.device_name = name
        super().__init__(f"device {name!r}: media disabled" + (f" ({detail})" if detail else "")
                         + ": no data was moved; retry when the operation completes")


class DmaError(CxlemuError):
    """A DMA descriptor failed; nothing was written outside the device or the host buffer."""

    def __init__(self, index: int, reason: str) -> None:
        self.index = index
        self.reason = reason
        super().__init__(f"DMA descriptor {index} failed: {reason}")
