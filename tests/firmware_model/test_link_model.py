"""The one link model (firmware_model.link) against everything that times a transfer: the C data
path and its Python twin on a simulated clock, the firmware's DMA scheduling model and the
device's DMA engine complete every transfer of random workloads at the same simulated time."""
from __future__ import annotations

import dataclasses

import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from emulator.dma import Descriptor, DmaEngine
from emulator.timing import DataPath, ManualClock, TimingConfig, c_available
from firmware_model.dma import DmaScheduler, TransferCost
from firmware_model.link import (
    READ,
    WRITE,
    Link,
    LinkParams,
    MediaLink,
    charged_bytes,
    occupancy_ns,
    reserve,
)

MEDIA = 1 << 16
MAX_N = 8192

if not c_available():
    from emulator.timing._build import build_in_place

    build_in_place()


# ------------------------------------------------------------------------------ the model alone
def test_two_reads_pipeline_their_latency() -> None:
    """Issue 13's figure: two 64-B reads at t=0, 100 ns, 16 GB/s complete at 104 and 108 ns."""
    link = Link(LinkParams.from_rates(read_latency_ns=100, read_bandwidth_gbps=16))
    assert [link.transfer(READ, 0, 64), link.transfer(READ, 0, 64)] == [104, 108]
    assert link.free == [8, 0]


def test_charged_bytes_are_whole_aligned_transactions() -> None:
    assert [charged_bytes(0, 1, 64), charged_bytes(63, 2, 64), charged_bytes(100, 4000, 4096),
            charged_bytes(4096, 4096, 4096), charged_bytes(64, 0, 64)] == [64, 128, 8192, 4096, 0]


def test_occupancy_rounds_half_up_and_zero_occupancy_does_not_queue() -> None:
    """0.5 ns rounds up, 0.4999 down; a transfer with no occupancy starts at once even on a busy
    link (as the C core's reserve() returns the request time for occ == 0)."""
    assert [occupancy_ns(1, 500_000), occupancy_ns(1, 499_999), occupancy_ns(3, 1_000_000)] == [1, 0, 3]
    assert reserve(link_free=900, now=100, occ=0) == 100 and reserve(900, 100, 1) == 900
    link = Link(LinkParams(lat_ns=(10, 0), fs_per_byte=(1, 0)))  # 1e6 GB/s: 64 B take 0.064 ns
    link.free[READ] = 500
    assert link.transfer(READ, 100, 64) == 110 and link.free == [500, 0]


def test_copy_holds_both_directions_and_pays_both_latencies() -> None:
    link = Link(LinkParams.from_rates(read_latency_ns=100, write_latency_ns=200, read_bandwidth_gbps=16,
                                      write_bandwidth_gbps=8))
    assert link.copy(0, 4096, 4096, now=10) == 10 + 512 + 300
    assert link.free == [10 + 256, 10 + 512]
    assert link.transfer(WRITE, 0, 64) == 522 + 8 + 200


def test_from_rates_is_timing_configs_conversion() -> None:
    """TimingConfig's LinkParams is the model's; None (unthrottled) there is 0 here."""
    cfg = TimingConfig(read_latency_ns=150.4, write_latency_ns=250, read_bandwidth_gbps=16,
                       transaction_bytes=256, time_scale=2.5)
    assert cfg.link_params() == LinkParams(lat_ns=(376, 625), fs_per_byte=(156250, 0), txn_bytes=256)
    assert type(cfg.link_params()) is LinkParams
    assert LinkParams.from_rates(read_bandwidth_gbps=1e7).fs_per_byte == (1, 0)  # timed, however fast


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"lat_ns": (1,)}, ValueError, "two integers"),
    ({"fs_per_byte": (1.5, 0)}, ValueError, "two integers"),
    ({"txn_bytes": 96}, ValueError, "power of two"),
])
def test_bad_link_params_are_refused(kwargs, error, message) -> None:
    with pytest.raises(error, match=message):
        LinkParams(**kwargs)


# ------------------------------------------------------------------------------ shared media
def _two_hosts(**media_gbps: float) -> tuple[Link, Link, MediaLink]:
    params = LinkParams.from_rates(read_latency_ns=90, write_latency_ns=90, read_bandwidth_gbps=64,
                                   write_bandwidth_gbps=64, **media_gbps)
    media = MediaLink()
    return Link(params, media), Link(params, media), media


def test_a_second_host_waits_for_the_shared_media() -> None:
    """64 GB/s per host, 100 GB/s media, 1 MiB each at t=0: host 0 holds its link 16,384 ns and
    the media 10,485.76 -> 10,486 ns; host 1's link is idle but its transfer starts when the
    media is free, at 10,486, and holds its own link from there."""
    a, b, media = _two_hosts(media_read_bandwidth_gbps=100)
    assert a.transfer(READ, 0, 1 << 20) == 16_384 + 90
    assert b.transfer(READ, 0, 1 << 20) == 10_486 + 16_384 + 90
    assert (a.free, b.free, media.free) == ([16_384, 0], [10_486 + 16_384, 0], [2 * 10_486, 0])
    assert b.transfer(WRITE, 5, 64) == 5 + 1 + 90  # writes have no media limit here: unaffected


def test_media_slower_than_the_link_sets_the_completion() -> None:
    """Media 32 GB/s under a 64 GB/s link: 1 MiB holds the media 32,768 ns, the link 16,384;
    completion is start + latency + the longer, and the next host queues behind the media."""
    a, b, media = _two_hosts(media_read_bandwidth_gbps=32)
    assert a.transfer(READ, 0, 1 << 20) == 32_768 + 90
    assert a.free[READ] == 16_384 and media.free[READ] == 32_768
    assert b.transfer(READ, 100, 1 << 20) == 32_768 + 32_768 + 90


def test_one_hosts_transfers_never_move_another_hosts_link() -> None:
    a, b, media = _two_hosts(media_read_bandwidth_gbps=100, media_write_bandwidth_gbps=100)
    for t in range(0, 50_000, 1_000):
        a.transfer(READ, t, 4096)
        a.transfer(WRITE, t, 65536)
        a.copy(0, 4096, 8192, t)
    assert b.free == [0, 0] and media.free != [0, 0]


def test_a_link_without_shared_media_owns_one() -> None:
    """A single host with a media limit: its media is its own, and still bounds it."""
    link = Link(LinkParams.from_rates(read_bandwidth_gbps=64, media_read_bandwidth_gbps=32))
    assert [link.transfer(READ, 0, 64), link.transfer(READ, 0, 64)] == [2, 4]
    assert link.free == [3, 0] and link.media.free == [4, 0]  # 1 ns on the link from 2


_ops = st.lists(st.tuples(st.sampled_from(["read", "write", "copy"]), st.integers(0, 1 << 20),
                          st.integers(0, 1 << 20), st.integers(0, 1 << 21), st.integers(0, 5000)),
                min_size=1, max_size=20)


@settings(max_examples=300, deadline=None)
@given(lat=st.integers(0, 2000), bw=st.sampled_from([0, 0.001, 1.0, 16.0, 64.0, 1e7]),
       scale=st.sampled_from([1.0, 0.25, 2.5]), txn=st.sampled_from([64, 4096]), ops=_ops)
def test_no_media_limit_is_exactly_the_one_link_model(lat, bw, scale, txn, ops) -> None:
    """With no media limit every time and link_free is the one-link model's (here written out
    from its formula, as before the media existed), a shared MediaLink or not."""
    params = LinkParams.from_rates(read_latency_ns=lat, write_latency_ns=lat // 2, read_bandwidth_gbps=bw,
                                   write_bandwidth_gbps=bw / 2, time_scale=scale, txn_bytes=txn)
    link, shared, free, now = Link(params), Link(params, MediaLink()), [0, 0], 0

    def one(i: int, t: int, dpa: int, n: int) -> int:
        occ = params.occupancy(i, dpa, n)
        start = t if occ == 0 else max(t, free[i])
        if occ:
            free[i] = start + occ
        return start + occ

    for kind, a, b, n, gap in ops:
        now += gap
        if n == 0 or params.untimed:
            want = now
        elif kind == "copy":
            want = max(now, one(READ, now, a, n), one(WRITE, now, b, n)) + sum(params.lat_ns)
        else:
            i = READ if kind == "read" else WRITE
            want = one(i, now, a, n) + params.lat_ns[i]
        got = [lk.copy(a, b, n, now) if kind == "copy" else lk.transfer(kind, now, n, a)
               for lk in (link, shared)]
        assert got == [want, want] and link.free == shared.free == free
    assert shared.media.free == [0, 0]


# ------------------------------------------------------------------------------ differential
_bandwidth = st.one_of(st.none(), st.sampled_from([0.001, 1.0, 16.0, 64.0, 1e7]),
                       st.floats(0.01, 200.0, allow_nan=False))
_timing = st.builds(
    TimingConfig,
    read_latency_ns=st.one_of(st.integers(0, 2000), st.floats(0, 2000, allow_nan=False)),
    write_latency_ns=st.integers(0, 2000),
    read_bandwidth_gbps=_bandwidth, write_bandwidth_gbps=_bandwidth,
    transaction_bytes=st.sampled_from([64, 128, 256, 4096]),
    time_scale=st.sampled_from([1.0, 1.0, 0.25, 2.5, 10.0]),
)
# (direction, dpa, bytes, ns after the previous transfer's issue)
_transfers = st.lists(st.tuples(st.sampled_from(["read", "write"]), st.integers(0, MEDIA - MAX_N),
                                st.integers(1, MAX_N), st.integers(0, 3000)), min_size=1, max_size=12)


def _datapath(impl: str, cfg: TimingConfig, clock: ManualClock) -> DataPath:
    media = bytearray(MEDIA)
    return DataPath(media, bytearray(MEDIA // 512), bytearray(4096), cfg, impl=impl, clock=clock)


def _through_model(params: LinkParams, ops) -> list[int]:
    link, now, out = Link(params), 0, []
    for d, dpa, n, gap in ops:
        now += gap
        out.append(link.transfer(d, now, n, dpa))
    return out


def _through_datapath(impl: str, cfg: TimingConfig, ops) -> list[int]:
    clock = ManualClock(0)
    dp, out = _datapath(impl, cfg, clock), []
    for d, dpa, n, gap in ops:
        clock.advance(gap)
        out.append(dp.read(dpa, bytearray(n)) if d == "read" else dp.write(dpa, bytes(n)))
    return out


def _through_dma_model(cost: LinkParams, ops) -> list[float]:
    """Every transfer gets a channel at once (as many channels as transfers), so the link is
    the only thing it waits for."""
    env = simpy.Environment()
    dma = DmaScheduler(env, cost, channels=len(ops), queue_depth=len(ops))
    reqs = []

    def issue():
        for d, dpa, n, gap in ops:
            yield env.timeout(gap)
            reqs.append(dma.submit(d, n, dpa=dpa))

    env.process(issue())
    env.run()
    assert env.now == max(r.completed_at for r in reqs)
    return [r.completed_at for r in reqs]


def _through_dma_engine(impl: str, cfg: TimingConfig, ops) -> list[int]:
    """The device's DMA engine over a simulated-clock data path, one descriptor a submission."""
    clock = ManualClock(0)
    dp, host, out = _datapath(impl, cfg, clock), bytearray(MAX_N), []
    with DmaEngine(dp, channels=1) as eng:
        for d, dpa, n, gap in ops:
            clock.advance(gap)
            out.extend(eng.submit([Descriptor(d, dpa, host, 0, n)]).wait(10))
    return out


@pytest.mark.slow
@settings(max_examples=1000, deadline=None)
@given(cfg=_timing, ops=_transfers)
def test_every_transfer_completes_at_the_same_time_everywhere(cfg: TimingConfig, ops) -> None:
    """Random workloads through the link model, DataPath(ManualClock) impl='c' and 'py', and the
    firmware's DmaScheduler (its TransferCost built from the same ns and GB/s numbers)."""
    expected = _through_model(cfg.link_params(), ops)
    cost = TransferCost(read_latency_ns=cfg.read_latency_ns, write_latency_ns=cfg.write_latency_ns,
                        read_bandwidth_gbps=cfg.read_bandwidth_gbps or 0,
                        write_bandwidth_gbps=cfg.write_bandwidth_gbps or 0,
                        time_scale=cfg.time_scale, txn_bytes=cfg.transaction_bytes)
    assert _through_datapath("c", cfg, ops) == expected
    assert _through_datapath("py", cfg, ops) == expected
    assert _through_dma_model(cost, ops) == expected


@settings(max_examples=200, deadline=None)
@given(cfg=_timing, ops=_transfers)
def test_the_dma_engine_completes_at_the_models_times(cfg: TimingConfig, ops) -> None:
    """The device's DMA engine (emulator.dma) on both twins: the model's completion times."""
    expected = _through_model(cfg.link_params(), ops)
    assert _through_dma_engine("c", cfg, ops) == expected
    assert _through_dma_engine("py", cfg, ops) == expected


# (kind, a, b, bytes, gap): kind "copy" copies n bytes from DPA a to DPA b; n may be 0
_mixed = st.lists(st.tuples(st.sampled_from(["read", "write", "copy"]), st.integers(0, MEDIA - MAX_N),
                            st.integers(0, MEDIA - MAX_N), st.integers(0, MAX_N), st.integers(0, 3000)),
                  min_size=1, max_size=12)


@settings(max_examples=500, deadline=None)
@given(cfg=_timing, ops=_mixed)
def test_copies_and_empty_transfers_agree_with_the_model(cfg: TimingConfig, ops) -> None:
    """Device-internal copies (both directions, both latencies) and 0-byte transfers too."""
    def model() -> list[int]:
        link, now, out = Link(cfg.link_params()), 0, []
        for kind, a, b, n, gap in ops:
            now += gap
            out.append(link.copy(a, b, n, now) if kind == "copy" else link.transfer(kind, now, n, a))
        return out

    def datapath(impl: str) -> list[int]:
        clock = ManualClock(0)
        dp, out = _datapath(impl, cfg, clock), []
        for kind, a, b, n, gap in ops:
            clock.advance(gap)
            if kind == "copy":
                out.append(dp.copy(a, b, n))
            else:
                out.append(dp.read(a, bytearray(n)) if kind == "read" else dp.write(a, bytes(n)))
        return out

    expected = model()
    assert datapath("c") == expected
    assert datapath("py") == expected


_media_bandwidth = st.one_of(st.none(), st.sampled_from([0.001, 16.0, 100.0, 1000.0]),
                             st.floats(0.01, 400.0, allow_nan=False))
_shared_timing = st.builds(
    TimingConfig, read_latency_ns=st.integers(0, 2000), write_latency_ns=st.integers(0, 2000),
    read_bandwidth_gbps=_bandwidth, write_bandwidth_gbps=_bandwidth,
    media_read_bandwidth_gbps=_media_bandwidth, media_write_bandwidth_gbps=_media_bandwidth,
    transaction_bytes=st.sampled_from([64, 256, 4096]), time_scale=st.sampled_from([1.0, 0.25, 2.5]))
# (host, kind, a, b, bytes, gap): two hosts' transfers and copies interleaved on one clock
_two_hosts_ops = st.lists(st.tuples(st.integers(0, 1), st.sampled_from(["read", "write", "copy"]),
                                    st.integers(0, MEDIA - MAX_N), st.integers(0, MEDIA - MAX_N),
                                    st.integers(0, MAX_N), st.integers(0, 3000)), min_size=1, max_size=16)


@settings(max_examples=400, deadline=None)
@given(cfg=_shared_timing, ops=_two_hosts_ops)
def test_two_hosts_sharing_the_media_agree_with_the_model(cfg: TimingConfig, ops) -> None:
    """Two hosts' data paths (their own link-state pages, one media block) on one simulated
    clock, impl='c' and 'py': every completion, each host's link_free and the media's free time
    are the two-resource model's (two Links sharing one MediaLink)."""
    media = MediaLink()
    links = [Link(cfg.link_params(), media), Link(cfg.link_params(), media)]
    now, expected = 0, []
    for host, kind, a, b, n, gap in ops:
        now += gap
        link = links[host]
        expected.append(link.copy(a, b, n, now) if kind == "copy" else link.transfer(kind, now, n, a))

    for impl in ("c", "py"):
        clock, block = ManualClock(0), bytearray(4096)
        dps = [DataPath(bytearray(MEDIA), None, bytearray(4096), cfg, impl=impl, clock=clock,
                        media_link=block) for _ in range(2)]
        got = []
        for host, kind, a, b, n, gap in ops:
            clock.advance(gap)
            dp = dps[host]
            if kind == "copy":
                got.append(dp.copy(a, b, n))
            else:
                got.append(dp.read(a, bytearray(n)) if kind == "read" else dp.write(a, bytes(n)))
        assert got == expected, impl
        for dp, link in zip(dps, links, strict=True):
            c = dp.counters()
            assert [c["read_link_free_ns"], c["write_link_free_ns"]] == link.free, impl
        m = dps[0].media_counters()
        assert [m["read_link_free_ns"], m["write_link_free_ns"]] == media.free, impl


def test_an_untimed_link_completes_at_the_request_time() -> None:
    link = Link(LinkParams())
    assert [link.transfer("read", 5, 1 << 20), link.copy(0, 64, 64, 9)] == [5, 9] and link.free == [0, 0]


# ------------------------------------------------------------------------------ the model's users
ODD_SIZES = [1, 63, 65, 4097, (2 << 20) + 7]  # none a whole number of 64-B transactions


@pytest.mark.parametrize("n", ODD_SIZES)
def test_the_link_cost_outside_the_data_path_is_the_models(n: int) -> None:
    """Sanitize's pacing, `bench kv`'s transfer bound and `sim validate`'s replay of a bench's
    jobs (each once a formula of its own) give the link model's times on sizes that are not
    whole transactions: leo-x16 at k = 3, 270 ns and 60,000 fs/B each way."""
    from emulator import presets
    from emulator.commands.sanitize import sanitize_ns
    from tools.bench.kv import transfer_bound_s
    from tools.sim import hardware as hw
    from tools.sim.validate import link_check

    params = hw.link_params("leo-x16", 3.0)
    assert params == LinkParams(lat_ns=(270, 270), fs_per_byte=(60_000, 60_000), txn_bytes=64)
    assert params == dataclasses.replace(presets.load("leo-x16").timing, time_scale=3.0).link_params()
    assert sanitize_ns(params, n) == Link(params).transfer(WRITE, 0, n)
    frames = Link(params)
    last = [frames.transfer(READ, 0, n) for _ in range(3)][-1]
    assert transfer_bound_s(params, 3, n) == last / 1e9
    jobs = [[0.0, "load", 1, 1.0, 1.0, True], [0.0, "load", 1, 1.0, 1.0, True], [0.0, "store", 1, 1.0, 1.0, True]]
    report = {"config": {"block_bytes": n}, "time_scale": {"time_scale": 3.0},
              "modes": {"cxl-lru": {"mode": {"preset": "leo-x16"}, "levels": {"1": {"jobs": jobs}}}}}
    row = link_check(report)["cxl-lru"]
    link = Link(params)
    loads = [link.transfer(READ, 0, n) / 1e9 for _ in range(2)]
    assert row["load_model_s"] == 0.0 + loads[0] + loads[1]
    assert row["store_model_s"] == link.transfer(WRITE, 0, n) / 1e9


def test_sanitize_time_is_whole_transactions_and_one_latency() -> None:
    """1 B and 65 B at k = 3 (leo-x16): 64 and 128 B charged, 3.84 -> 4 ns and 7.68 -> 8 ns."""
    from emulator.commands.sanitize import sanitize_ns

    params = LinkParams(lat_ns=(270, 270), fs_per_byte=(60_000, 60_000))
    assert [sanitize_ns(params, 0), sanitize_ns(params, 1), sanitize_ns(params, 65)] == [0, 274, 278]
