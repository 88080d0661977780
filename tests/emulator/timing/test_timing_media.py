"""The shared media block (several hosts on one device): two data paths on their own link-state
pages and one media block, exact times on a simulated clock for both twins; the block's file,
its counters, the configs that carry the media bandwidths, and concurrent hosts in C."""
from __future__ import annotations

import threading

import pytest

from emulator import presets
from emulator.spec.registers import LINK_STATE_SIZE
from emulator.timing import DataPath, ManualClock, TimingConfig, c_available, linkstate
from firmware_model.link import READ, Link, MediaLink

IMPLS = ["py", "c"] if c_available() else ["py"]
MEDIA = 1 << 21
#: 64 GB/s per host, 100 GB/s media: 1 MiB holds a host's link 16,384 ns, the media 10,486
SHARED = TimingConfig(read_latency_ns=90, write_latency_ns=90, read_bandwidth_gbps=64, write_bandwidth_gbps=64,
                      media_read_bandwidth_gbps=100, media_write_bandwidth_gbps=100)


def _hosts(impl: str, cfg: TimingConfig, clock: ManualClock, block: bytearray) -> list[DataPath]:
    return [DataPath(bytearray(MEDIA), None, bytearray(4096), cfg, impl=impl, clock=clock, media_link=block)
            for _ in range(2)]


@pytest.mark.parametrize("impl", IMPLS)
def test_the_second_host_waits_for_the_media_not_its_link(impl: str) -> None:
    clock, block = ManualClock(0), bytearray(4096)
    a, b = _hosts(impl, SHARED, clock, block)
    assert a.read(0, bytearray(1 << 20)) == 16_384 + 90
    assert b.read(0, bytearray(1 << 20)) == 10_486 + 16_384 + 90
    assert a.counters()["read_link_free_ns"] == 16_384
    assert b.counters()["read_link_free_ns"] == 10_486 + 16_384
    media = a.media_counters()
    assert (media["read_link_free_ns"], media["read_bytes"], media["read_transfers"], media["read_busy_ns"]) \
        == (2 * 10_486, 2 << 20, 2, 2 * 10_486)
    clock.advance(30_000)  # both links and the media idle again: a 64-B read pays 1 ns + 90
    assert b.read(64, bytearray(64)) == 30_000 + 1 + 90


@pytest.mark.parametrize("impl", IMPLS)
def test_one_hosts_traffic_leaves_the_other_hosts_link_page_alone(impl: str) -> None:
    clock, block = ManualClock(0), bytearray(4096)
    a, b = _hosts(impl, SHARED, clock, block)
    before = b.counters()
    for i in range(50):
        clock.advance(100)
        a.read(i * 4096, bytearray(4096))
        a.write(i * 4096, bytes(8192))
        a.copy(0, 1 << 20, 65536)
    assert b.counters() == before
    assert a.media_counters()["write_busy_ns"] > 0


@pytest.mark.parametrize("impl", IMPLS)
def test_without_a_media_limit_the_block_is_never_touched(impl: str) -> None:
    """A media block handed to a path whose config has no media limit: today's times, and the
    block stays as stamped (the C core gets NULL)."""
    cfg = TimingConfig(read_latency_ns=90, read_bandwidth_gbps=64, write_bandwidth_gbps=16)
    clock, block = ManualClock(0), bytearray(4096)
    a, b = _hosts(impl, cfg, clock, block)
    stamped = bytes(block)
    link_a, link_b = Link(cfg.link_params()), Link(cfg.link_params())
    for i in range(20):
        clock.advance(7)
        assert a.read(i, bytearray(100 * i + 1)) == link_a.transfer("read", clock.now_ns(), 100 * i + 1, i)
        assert b.write(0, bytes(4096)) == link_b.transfer("write", clock.now_ns(), 4096)
    assert bytes(block) == stamped and a.media_counters()["read_bytes"] == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_a_single_host_with_a_media_limit_has_a_media_of_its_own(impl: str) -> None:
    cfg = TimingConfig(read_bandwidth_gbps=64, media_read_bandwidth_gbps=32)
    dp = DataPath(bytearray(MEDIA), None, bytearray(4096), cfg, impl=impl, clock=ManualClock(0))
    link = Link(cfg.link_params())
    assert [dp.read(0, bytearray(64)), dp.read(0, bytearray(64))] == [link.transfer(READ, 0, 64),
                                                                      link.transfer(READ, 0, 64)] == [2, 4]
    assert dp.media_counters()["read_link_free_ns"] == link.media.free[READ] == 4


def test_the_media_file_is_created_stamped_and_shared(tmp_path) -> None:
    first = linkstate.open_media(tmp_path)
    second = linkstate.open_media(tmp_path)  # another host maps the same file
    assert (tmp_path / linkstate.MEDIA_LINK_FILE).stat().st_size == LINK_STATE_SIZE
    assert (tmp_path / linkstate.MEDIA_LINK_FILE).stat().st_mode & 0o777 == 0o600
    clock = ManualClock(0)
    dps = [DataPath(bytearray(MEDIA), None, bytearray(4096), SHARED, clock=clock, media_link=mm)
           for mm in (first, second)]
    assert [dps[0].read(0, bytearray(1 << 20)), dps[1].read(0, bytearray(1 << 20))] == [16_474, 26_960]
    assert linkstate.snapshot(first)["read_link_free_ns"] == 2 * 10_486
    for dp in dps:
        dp.close()
    first.close()
    second.close()


def test_a_foreign_media_block_is_refused() -> None:
    with pytest.raises(ValueError, match="not a cxlemu link page"):
        DataPath(bytearray(MEDIA), None, bytearray(4096), SHARED, media_link=bytearray(b"\x07" * 4096))


def test_the_media_bandwidths_round_trip_and_old_configs_have_none() -> None:
    assert TimingConfig.from_dict(SHARED.to_dict()) == SHARED
    old = {k: v for k, v in SHARED.to_dict().items() if not k.startswith("media_")}
    assert TimingConfig.from_dict(old).link_params().media_fs_per_byte == (0, 0)
    assert not TimingConfig(media_read_bandwidth_gbps=100).untimed
    with pytest.raises(ValueError, match="media_write_bandwidth_gbps must be at least 0.001"):
        TimingConfig(media_write_bandwidth_gbps=0)


def test_the_beluga_switch_preset() -> None:
    """64 GB/s per host and 1 TB/s of media, the leo-x16 latency, time-scaled like the others."""
    t = presets.load("beluga-switch").timing
    assert (t.read_latency_ns, t.read_bandwidth_gbps, t.media_read_bandwidth_gbps) == (90, 64, 1000)
    assert t.read_latency_ns == presets.load("leo-x16").timing.read_latency_ns
    scaled = TimingConfig(**{**t.to_dict(), "time_scale": 5.0}).link_params()
    assert (scaled.lat_ns, scaled.fs_per_byte, scaled.media_fs_per_byte) == ((450, 450), (78125, 78125), (5000, 5000))


@pytest.mark.skipif(not c_available(), reason="the C core's CAS")
def test_concurrent_hosts_hold_the_media_back_to_back() -> None:
    """Two hosts' threads issue at one simulated instant with the media the bottleneck (32 GB/s
    under 64 GB/s links), the C core's GIL released: every start is the media's free time, so
    the media ends exactly at the sum of the claims, no gap and no overlap, and each host's
    link page counts only its own transfers."""
    cfg = TimingConfig(read_bandwidth_gbps=64, media_read_bandwidth_gbps=32)
    clock, block = ManualClock(0), bytearray(4096)
    hosts, per = _hosts("c", cfg, clock, block), 3000
    done: list[list[int]] = [[], []]

    def run(h: int) -> None:
        buf = bytearray(4096)
        done[h] = [hosts[h].read(0, buf) for _ in range(per)]

    threads = [threading.Thread(target=run, args=(h,)) for h in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    occ_m = 128  # 4096 B at 32 GB/s
    assert hosts[0].media_counters()["read_link_free_ns"] == 2 * per * occ_m
    assert sorted(done[0] + done[1]) == [occ_m * (i + 1) for i in range(2 * per)]
    assert [h.counters()["read_transfers"] for h in hosts] == [per, per]
