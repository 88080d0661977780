"""Two host ports of one device share its media bandwidth: each host's data path has its own
link (its BAR's link-state page) and every one maps the device's one media block (media.link),
so a write through either is counted on the shared media and only on its own host's link."""
from __future__ import annotations

from driver import MemDev
from emulator.device import DeviceConfig, serve
from emulator.timing import TimingConfig
from emulator.timing.linkstate import MEDIA_LINK_FILE

MiB = 1 << 20
# per host 64 GB/s each way, the media 100 GB/s for all hosts together (a switch-attached pool)
SWITCHED = TimingConfig(read_bandwidth_gbps=64.0, write_bandwidth_gbps=64.0,
                        media_read_bandwidth_gbps=100.0, media_write_bandwidth_gbps=100.0)


def test_two_hosts_write_through_their_own_links_onto_one_shared_media(device_name: str) -> None:
    with serve(DeviceConfig(name=device_name, capacity=256 * MiB, hosts=2, timing=SWITCHED)) as served:
        with MemDev.open(device_name, host=0) as h0, MemDev.open(device_name, host=1) as h1:
            assert (served.files.path / MEDIA_LINK_FILE).is_file()
            h0.write(0, bytes(MiB))
            h1.write(MiB, b"\x01" * MiB)
            h1.write(2 * MiB, b"\x02" * (MiB // 2))
            own0, own1 = h0.datapath.counters(), h1.datapath.counters()
            assert (own0["write_bytes"], own1["write_bytes"]) == (MiB, MiB + MiB // 2)
            for seen_by in (h0, h1):  # the one block, whichever host reads it
                media = seen_by.datapath.media_counters()
                assert (media["write_bytes"], media["write_transfers"]) == (2 * MiB + MiB // 2, 3)
            assert h0.read(MiB, 4) == b"\x01" * 4  # one media: host 0 reads what host 1 wrote


def test_without_a_media_limit_no_media_block_is_made(device_name: str) -> None:
    with serve(DeviceConfig(name=device_name, capacity=256 * MiB, hosts=2)) as served:
        with MemDev.open(device_name, host=1) as h1:
            h1.write(0, bytes(4096))
            assert h1.datapath.media_counters() == {}
        assert not (served.files.path / MEDIA_LINK_FILE).exists()
