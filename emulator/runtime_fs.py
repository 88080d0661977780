"""The runtime dir and a device's files on the host's filesystem: whose they are, and the space
they hold.

Whose: another local user must never read a device's media or write its registers. So, as
XDG_RUNTIME_DIR is checked, the runtime dir is used only when ``lstat`` finds a directory (not a
symlink) owned by this user with no group or other permission bits; each device's directory must
be a directory of this user's too (its mode is free: nobody else can enter the runtime dir), and
a device's files are opened with ``O_NOFOLLOW`` and must be regular files of this
user's. Anything else is refused (``UnsafePath``) naming the path and the owner found: a directory
another user made before the owner's first run is never adopted.

Space: a device's files are mapped shared, and a page the filesystem cannot back when it is
first touched kills whoever touches it with SIGBUS (a host's writer, the firmware injecting
poison). So a served device's files are reserved whole (``posix_fallocate``); a device whose
files do not fit the free space is refused (``NoSpace``) saying how much is free and needed.
"""
from __future__ import annotations

import errno
import os
import pwd
import stat
from collections.abc import Mapping
from pathlib import Path

from emulator.spec.errors import NoSpace, UnsafePath

ENV = "CXLEMU_RUNTIME_DIR"
_PRIVATE_BITS = 0o077  # group and other: none may be set on a directory holding devices
_OTHER_USER_REMEDY = ("another user may have made it to reach your devices: remove it (as that user or root), "
                      f"or set {ENV} to a directory of your own with mode 0700")


def runtime_dir() -> Path:
    """`$CXLEMU_RUNTIME_DIR`, or /dev/shm/cxlemu-<uid> (a temp dir where /dev/shm is absent).
    Only the path: ``ensure_runtime_dir`` / ``checked_runtime_dir`` check who owns it."""
    env = os.environ.get(ENV)
    if env:
        return Path(env)
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    return base / f"cxlemu-{os.getuid()}"


def owner(uid: int) -> str:
    """'uid 65534 (nobody)', or 'uid N' for a uid with no passwd entry."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def check_private_dir(path: Path, what: str, *, private: bool = True) -> bool:
    """True when ``path`` is a directory of this user's (``private``: with no group or other
    permission bits), False when it does not exist; ``UnsafePath`` otherwise."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    me = os.getuid()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise UnsafePath(path, f"{what} is {kind} (owner {owner(st.st_uid)})", _OTHER_USER_REMEDY)
    if st.st_uid != me:
        raise UnsafePath(path, f"{what} is owned by {owner(st.st_uid)}, not by you ({owner(me)})",
                         _OTHER_USER_REMEDY)
    mode = stat.S_IMODE(st.st_mode)
    if private and mode & _PRIVATE_BITS:
        raise UnsafePath(path, f"{what} has mode {mode:04o} (owner {owner(st.st_uid)}): other users can reach "
                               f"the devices in it",
                         f"`chmod 700 {path}` if you made it, else remove it, or set {ENV} to a directory "
                         f"of your own with mode 0700")
    return True


def checked_runtime_dir() -> Path:
    """The runtime dir after ``check_private_dir`` (it may not exist yet)."""
    root = runtime_dir()
    check_private_dir(root, "runtime dir")
    return root


def ensure_runtime_dir() -> Path:
    """The runtime dir, made (mode 0700) if absent and checked after: one that someone else made
    first, even between our look and our mkdir, is refused."""
    root = runtime_dir()
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    check_private_dir(root, "runtime dir")
    return root


def open_private_file(path: Path, flags: int, mode: int = 0o600) -> int:
    """``os.open`` that follows no symlink and accepts only a regular file of this user's (its
    fd); ``UnsafePath`` otherwise. A missing file is the caller's FileNotFoundError."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        st = os.lstat(path)
        raise UnsafePath(path, f"is a symlink (owner {owner(st.st_uid)}), not a device file",
                         _replace_remedy(path)) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        os.close(fd)
        kind = "a regular file" if stat.S_ISREG(st.st_mode) else "not a regular file"
        raise UnsafePath(path, f"is {kind} owned by {owner(st.st_uid)}, not by you ({owner(os.getuid())})",
                         _replace_remedy(path))
    return fd


def _replace_remedy(path: Path) -> str:
    name = path.parent.name
    return f"serve {name} with --fresh to replace its files (what it held is lost), or `cxlemu destroy {name}`"


def allocated(path: Path) -> int:
    """Bytes the filesystem holds for ``path`` (0 when it does not exist)."""
    try:
        return os.lstat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


def _mib(n: int, *, up: bool) -> str:
    return f"{(n + (1 << 20) - 1 if up else n) >> 20} MiB"


def _room(where: Path, sizes: Mapping[Path, int]) -> tuple[int, int]:
    """(bytes these files still lack of their sizes, bytes free for this user on where's filesystem)."""
    need = sum(max(0, size - allocated(p)) for p, size in sizes.items())
    probe = next((p for p in (where, *where.parents) if p.exists()), Path("/"))
    st = os.statvfs(probe)
    return need, st.f_bavail * st.f_frsize


def _no_space(where: Path, free: int, need: int, device: str) -> NoSpace:
    return NoSpace(where, f"{_mib(free, up=False)} free, device {device!r} needs {_mib(need, up=True)} more "
                          f"to reserve its files (an unreserved page dies of SIGBUS when the disk is full)",
                   f"`cxlemu destroy` a stopped device or remove other files there, serve a smaller "
                   f"--capacity, or set {ENV} to a filesystem with room")


def check_room(where: Path, sizes: Mapping[Path, int], device: str, *, freed: int = 0) -> None:
    """``NoSpace`` unless the free space of the filesystem of ``where`` (the runtime dir), plus
    ``freed`` bytes that will be released first, covers what these files lack of their sizes."""
    need, free = _room(where, sizes)
    if need > free + freed:
        raise _no_space(where, free + freed, need, device)


def reserve(where: Path, sizes: Mapping[Path, int], device: str) -> None:
    """Allocate every byte of these (existing) files now, so that no write through a mapping of
    them can find the filesystem full; ``NoSpace`` when it cannot (checked first, and again
    when another writer took the space meanwhile)."""
    check_room(where, sizes, device)
    for path, size in sizes.items():
        if size == 0 or allocated(path) >= size:
            continue
        fd = open_private_file(path, os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            need, free = _room(where, sizes)
            raise _no_space(where, free, need, device) from None
        finally:
            os.close(fd)


__all__ = ["ENV", "allocated", "check_private_dir", "check_room", "checked_runtime_dir", "ensure_runtime_dir",
           "open_private_file", "owner", "reserve", "runtime_dir"]
