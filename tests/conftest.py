"""Shared fixtures: every test session gets its own runtime dir, so tests never see a user's devices."""
from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Iterator

import pytest

_SESSION_DIR = tempfile.mkdtemp(prefix="cxlemu-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
os.environ["CXLEMU_RUNTIME_DIR"] = _SESSION_DIR
_names = itertools.count()


@pytest.fixture
def runtime_dir() -> str:
    """The runtime dir of this test session (`$CXLEMU_RUNTIME_DIR`)."""
    return _SESSION_DIR


@pytest.fixture
def device_name() -> str:
    """A fresh device name per test (tests in one session share the runtime dir)."""
    return f"t{os.getpid()}-{next(_names)}"


@pytest.fixture
def served(device_name: str) -> Iterator["object"]:
    """A 256 MiB device served in-process, destroyed after the test."""
    from emulator.device import DeviceConfig, serve

    with serve(DeviceConfig(name=device_name, capacity=256 << 20)) as s:
        yield s


@pytest.fixture
def fw(request: pytest.FixtureRequest, device_name: str) -> Iterator["object"]:
    """A device's `Firmware` with no runner (`mbox_support.firmware`): commands go through
    `dispatch` and background jobs advance only when the test steps them; nothing runs behind the
    test. 256 MiB unless the test or its module is marked ``@pytest.mark.firmware(capacity=...,
    lsa_size=..., fw_revision=...)``."""
    from mbox_support import firmware

    marker = request.node.get_closest_marker("firmware")
    with firmware(**{"capacity": 256 << 20, **(marker.kwargs if marker else {})}, name=device_name) as f:
        yield f


@pytest.fixture
def memdev(served: "object") -> Iterator["object"]:
    """`MemDev` opened on the `served` device."""
    from driver import MemDev

    with MemDev.open(served.name) as md:  # type: ignore[attr-defined]
        yield md


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    import shutil

    shutil.rmtree(_SESSION_DIR, ignore_errors=True)
