"""The data path honours Dynamic Capacity (needs h/access's NoExtent and DataPath access_bits):
a host reaches a DC block only after accepting it, loses it the moment Release DC returns, and a
port's accepted extent opens nothing to another port; the static capacity stays open."""
from __future__ import annotations

import pytest

from driver import MemDev
from emulator.device import DeviceConfig, serve

M256 = 256 << 20
MB2 = 2 << 20


def test_access_follows_accept_and_release_per_port(device_name: str) -> None:
    from driver import NoExtent  # h/access's; imported here so the folder collects without it

    with serve(DeviceConfig(name=device_name, capacity=M256, hosts=2, dc_regions=(M256,))):
        with MemDev.open(device_name, host=0) as h0, MemDev.open(device_name, host=1) as h1:
            h0.write(0, b"static")  # the static capacity needs no extent
            with pytest.raises(NoExtent) as caught:
                h1.write(M256, b"x" * 64)
            assert caught.value.dpa == M256
            h0.fm_add(1, 0, [(M256, MB2)])
            h1.accept([(M256, MB2)])
            h1.write(M256, b"y" * 64)
            assert h1.read(M256, 64) == b"y" * 64
            with pytest.raises(NoExtent):
                h0.read(M256, 64)  # host 1's extent is not host 0's
            with pytest.raises(NoExtent):
                h1.read(M256 + MB2, 64)  # the next block was never offered
            h1.release([(M256, MB2)])
            with pytest.raises(NoExtent):
                h1.read(M256, 64)  # cleared before Release DC answered
