"""The DMA engine: scatter-gather through the timed data path, typed per-descriptor errors,
nothing written outside the device or the host buffer, FIFO per channel."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emulator.dma import Descriptor, Direction, DmaEngine, DmaHandle
from emulator.spec.errors import DmaError
from emulator.timing import DataPath, ManualClock, TimingConfig, c_available

MEDIA = 1 << 20
QEMU = TimingConfig(read_latency_ns=150, write_latency_ns=250,
                    read_bandwidth_gbps=16, write_bandwidth_gbps=16)

if not c_available():
    from emulator.timing._build import build_in_place

    build_in_place()


@pytest.fixture(params=["c", "py"])
def impl(request):
    return request.param


def make(impl: str, config: TimingConfig = QEMU, clock=None):
    media = bytearray(np.random.default_rng(3).integers(0, 256, MEDIA, dtype=np.uint8).tobytes())
    poison = bytearray(MEDIA // 512)
    dp = DataPath(media, poison, bytearray(4096), config, impl=impl, clock=clock)
    return dp, media, poison


def test_scatter_gather_round_trip(impl):
    dp, media, _ = make(impl)
    src = np.arange(3 * 4096, dtype=np.uint8)
    with DmaEngine(dp, channels=2) as eng:
        h = eng.submit([Descriptor("write", 0x10000 + i * 0x8000, src, i * 4096, 4096) for i in range(3)])
        assert len(h.check(timeout=10)) == 3
        dst = np.zeros(3 * 4096, dtype=np.uint8)
        h2 = eng.submit([Descriptor(Direction.READ, 0x10000 + i * 0x8000, dst, i * 4096, 4096)
                         for i in reversed(range(3))])
        h2.check(timeout=10)
    assert np.array_equal(dst, src)
    assert bytes(media[0x18000:0x19000]) == src[4096:8192].tobytes()


def test_descriptors_pipeline_on_the_link(impl):
    """On a simulated clock: one latency each, link time back to back (16 GB/s: 256 ns/4 KiB)."""
    dp, *_ = make(impl, clock=ManualClock(0))
    buf = bytearray(8192)
    with DmaEngine(dp, channels=1) as eng:
        results = eng.submit([Descriptor("read", 0, buf, 0, 4096),
                              Descriptor("read", 4096, buf, 4096, 4096)]).wait(10)
    assert results == [256 + 150, 512 + 150]


def test_bad_descriptors_fail_alone_and_write_nothing(impl):
    dp, media, poison = make(impl, clock=ManualClock(0))
    poison[0x2000 >> 9] |= 1 << ((0x2000 >> 6) & 7)
    host = bytearray(b"\x11" * 8192)
    before_media, before_host = bytes(media), bytes(host)
    with DmaEngine(dp) as eng:
        results = eng.submit([
            Descriptor("read", MEDIA - 64, host, 0, 128),       # past the device
            Descriptor("write", 0, host, 8000, 512),            # past the host buffer
            Descriptor("read", 0x2000, host, 0, 64),            # poisoned line
            Descriptor("read", 0, b"read-only host buffer", 0, 4),
            Descriptor("write", MEDIA - 64, host, 0, 65),       # one byte past the device
            Descriptor("read", 0x3000, host, 4096, 64),         # fine
        ]).wait(10)
    errors = [r for r in results if isinstance(r, DmaError)]
    assert [e.index for e in errors] == [0, 1, 2, 3, 4]
    assert f"{MEDIA:#x}" in errors[0].reason and "host buffer" in errors[1].reason
    assert "0x2000" in errors[2].reason and "read-only" in errors[3].reason
    assert isinstance(results[5], int)
    assert bytes(media) == before_media
    assert host[:4096] == before_host[:4096] and host[4096:4160] == media[0x3000:0x3040]
    with pytest.raises(DmaError, match="descriptor 0 failed"):
        eng_h = DmaEngine(dp, channels=1)
        try:
            eng_h.submit([Descriptor("read", MEDIA, host, 0, 1)]).check(10)
        finally:
            eng_h.close()


def test_channel_is_fifo_and_completion_queue_follows(impl):
    dp, *_ = make(impl, config=TimingConfig(read_latency_ns=2000))
    buf = bytearray(64)
    with DmaEngine(dp, channels=3, queue_depth=4) as eng:
        handles = [eng.submit([Descriptor("read", i * 64, buf, 0, 64)], channel=1) for i in range(10)]
        for h in handles:
            h.wait(10)
        assert [h.id for h in eng.poll_completions()] == [h.id for h in handles]
        assert eng.poll_completions() == []
        assert all(h.channel == 1 for h in handles)


def test_callbacks_and_round_robin(impl):
    dp, *_ = make(impl, clock=ManualClock(0))
    seen: list[int] = []
    ev = threading.Event()
    with DmaEngine(dp, channels=2) as eng:
        h1 = eng.submit([])
        h2 = eng.submit([Descriptor("write", 0, bytes(64), 0, 64)])
        h2.add_done_callback(lambda h: (seen.append(h.id), ev.set()))
        assert ev.wait(10)
        h2.add_done_callback(lambda h: seen.append(-h.id))  # already done: runs now
    assert (h1.channel, h2.channel) == (0, 1)
    assert h1.wait(1) == [] and seen == [h2.id, -h2.id]


def test_close_drains_and_refuses_more(impl):
    dp, *_ = make(impl, config=TimingConfig(write_latency_ns=5000))
    eng = DmaEngine(dp, channels=1)
    handles = [eng.submit([Descriptor("write", 0, bytes(64), 0, 64)]) for _ in range(5)]
    eng.close()
    assert all(h.done() for h in handles)
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit([])
    eng.close()  # idempotent


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"channels": 0}, "channels must be"), ({"queue_depth": 0}, "queue_depth must be"),
    ({"channels": 2.0}, "channels must be")])
def test_bad_engine_arguments(kwargs, message):
    dp, *_ = make("py")
    with pytest.raises(ValueError, match=message):
        DmaEngine(dp, **kwargs)


def test_bad_descriptor_arguments():
    with pytest.raises(ValueError, match="direction must be 'read' or 'write'"):
        Descriptor("sideways", 0, bytearray(1), 0, 1)
    with pytest.raises(ValueError, match="length must be an int >= 0"):
        Descriptor("read", 0, bytearray(1), 0, -1)
    dp, *_ = make("py")
    with DmaEngine(dp, channels=1) as eng:
        with pytest.raises(TypeError, match="must be an emulator.dma.Descriptor"):
            eng.submit([("read", 0, bytearray(1), 0, 1)])
        with pytest.raises(ValueError, match="channel must be"):
            eng.submit([], channel=1)


def test_wait_times_out_while_a_transfer_is_in_flight():
    dp, *_ = make("c", config=TimingConfig(read_latency_ns=300_000_000))
    with DmaEngine(dp, channels=1) as eng:
        h = eng.submit([Descriptor("read", 0, bytearray(64), 0, 64)])
        with pytest.raises(TimeoutError, match="not complete"):
            h.wait(timeout=0.01)
        assert not h.done()
        h.wait(10)


def test_batched_c_path_matches_the_python_twin():
    """A long submission goes to the C core in one call: same completions, same errors."""
    from emulator.dma import BATCH_MIN

    def run(impl):
        dp, media, poison = make(impl, clock=ManualClock(100))
        poison[0x4000 >> 9] |= 1 << ((0x4000 >> 6) & 7)  # descriptor 4 reads it
        host = bytearray(1 << 16)
        descs = [Descriptor("read" if i % 3 else "write", i * 0x1000, host, i * 512, 512 + i)
                 for i in range(BATCH_MIN + 6)]
        descs += [Descriptor("read", MEDIA - 8, host, 0, 64), Descriptor("write", 0, host, 65000, 1000)]
        with DmaEngine(dp, channels=1) as eng:
            results = eng.submit(descs).wait(10)
        return ([r if isinstance(r, int) else (r.index, r.reason) for r in results],
                bytes(media), bytes(host))

    c, py = run("c"), run("py")
    assert c == py
    assert [r[0] for r in c[0] if isinstance(r, tuple)] == [4, 10, 11]


# -- inline submission ------------------------------------------------------------------------
@pytest.mark.parametrize("config", [TimingConfig(), TimingConfig(read_bandwidth_gbps=1e6)],
                         ids=["untimed", "nil-link"])
def test_small_submission_to_an_idle_channel_completes_in_submit(impl, config):
    """io_uring's inline completion: issued and done before submit returns, in the CQ."""
    dp, media, _ = make(impl, config=config)
    out = np.zeros(64, np.uint8)
    desc = [Descriptor("read", 0x40, out, 0, 64)]
    with DmaEngine(dp, channels=2) as eng:
        handles = [eng.submit(desc, channel=1) for _ in range(3)]
        assert all(h.done() for h in handles) and eng.pending() == 0
        assert [h.id for h in eng.poll_completions()] == [1, 2, 3]
        assert isinstance(handles[0], DmaHandle) and handles[0].channel == 1 and handles[0].count == 1
        results = handles[0].wait(0)
        assert len(results) == 1 and isinstance(results[0], int)
        assert results[0] == 0 if config.untimed else results[0] > 0
    assert out.tobytes() == bytes(media[0x40:0x80])
    assert dp.counters()["read_transfers"] == 3


def test_inline_errors_match_the_python_twin():
    """One, two and three descriptors (the inline paths below the batch call) fail alike."""
    def run(impl):
        dp, media, poison = make(impl, clock=ManualClock(100))
        poison[0x2000 >> 9] |= 1 << ((0x2000 >> 6) & 7)
        host = bytearray(4096)
        subs = [[Descriptor("read", 0x2000, host, 0, 64)],
                [Descriptor("write", 0x40, host, 0, 64), Descriptor("read", MEDIA - 32, host, 0, 64)],
                [Descriptor("read", 0x80, host, 64, 128), Descriptor("read", 0, host, 4000, 200),
                 Descriptor("write", 0x1000, host, 0, 512)]]
        if impl == "c":
            subs[0][0].c_descriptor()  # built beforehand: the one-call path (inline1)
        with DmaEngine(dp, channels=1) as eng:
            out = [[r if isinstance(r, int) else (r.index, r.reason) for r in eng.submit(s).wait(10)]
                   for s in subs]
        return out, bytes(media), bytes(host), dp.counters()

    c, py = run("c"), run("py")
    assert c == py
    assert [[r[0] for r in sub if isinstance(r, tuple)] for sub in c[0]] == [[0], [1], [1]]
    assert "0x2000" in c[0][0][0][1] and f"{MEDIA:#x}" in c[0][1][1][1]


def test_a_completion_still_ahead_is_waited_for_by_the_channel_thread(impl):
    """Issued inline, not yet complete: submit returns at once; FIFO still holds for what is
    submitted after it on the channel."""
    dp, *_ = make(impl, config=TimingConfig(read_latency_ns=20_000_000))
    with DmaEngine(dp, channels=1) as eng:
        first = eng.submit([Descriptor("read", 0, bytearray(64), 0, 64)])
        assert not first.done()
        second = eng.submit([Descriptor("read", 64, bytearray(64), 0, 64)])
        (done_first,), (done_second,) = first.wait(10), second.wait(10)
        assert eng.poll_completions() == [first, second]
        assert done_second >= done_first + 20_000_000 - 1 and dp.now_ns() >= done_second


def test_fifo_per_channel_under_concurrent_submitters(impl):
    """Four threads submitting to one channel (some inline, some queued behind a transfer in
    flight): every transfer completes, and each thread's completions keep its submission order."""
    dp, *_ = make(impl, config=TimingConfig(write_latency_ns=3000))
    bufs = [bytes([t]) * 64 for t in range(4)]
    mine: dict[int, list[int]] = {t: [] for t in range(4)}
    with DmaEngine(dp, channels=2, queue_depth=32) as eng:  # the CQ keeps 4 * 2 * 32 >= 240
        def submitter(t: int) -> None:
            for i in range(60):
                h = eng.submit([Descriptor("write", (t * 60 + i) * 64, bufs[t], 0, 64)], channel=0)
                mine[t].append(h.id)

        threads = [threading.Thread(target=submitter, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        eng.close()  # drains every channel
        order = [h.id for h in eng.poll_completions()]
        assert len(order) == 240
    for t in range(4):
        ids = set(mine[t])
        assert [i for i in order if i in ids] == mine[t]
    assert dp.counters()["write_transfers"] == 240


def test_handle_fields_and_callbacks_on_a_pending_handle():
    from emulator.dma import handle_base_is_c

    h = DmaHandle(7, 1, 2)
    seen = []
    h.add_done_callback(lambda hh: seen.append(hh.id))
    assert (h.id, h.channel, h.count, h.done(), h.errors) == (7, 1, 2, False, [])
    assert repr(h) == "<DmaHandle 7 ch1 2 desc pending>"
    with pytest.raises(TimeoutError, match="handle 7 not complete"):
        h.wait(timeout=0)
    with pytest.raises(TypeError):
        h.wait(0, 1)
    cq: list[DmaHandle] = []
    assert h._complete([5, DmaError(1, "x")], cq.append)
    assert not h._complete([6, 6], cq.append)  # the channel's thread and a waiter may both try
    assert cq == [h] and seen == [7]
    assert h.done() and h.wait(0)[0] == 5 and [e.index for e in h.errors] == [1]
    results = h.wait()
    results.append("mine")  # a copy: the handle's results stay as completed
    assert len(h.wait(timeout=None)) == 2
    assert handle_base_is_c() == c_available()


def _state_types():
    from emulator.dma import _PyChannelState
    from emulator.timing.cimpl import channel_state

    return [_PyChannelState] + ([channel_state] if channel_state is not None else [])


@pytest.mark.parametrize("state_type", _state_types(), ids=lambda t: t.__module__)
def test_channel_state_claims_only_an_idle_open_channel(state_type):
    """The C word and its threading twin: an inline claim needs nothing owned, queued or
    closed; the channel's own claim ignores the queue."""
    s = state_type()
    assert s.snapshot() == (False, 0, False)
    if state_type.__module__.endswith("_dmacall"):
        with pytest.raises(TypeError, match="every argument"):
            state_type(0, 1)  # the inline context is all or nothing
    assert s.try_claim() and not s.try_claim()
    s.release()
    s.add_queued(2)
    assert not s.try_claim()
    s.claim()
    assert s.snapshot() == (True, 2, False)
    s.add_queued(-2)
    s.release()
    assert s.try_claim()
    s.release()
    s.close()
    assert not s.try_claim() and s.snapshot() == (False, 0, True)


def test_pending_counts_an_inline_submission_until_it_completes(impl):
    dp, *_ = make(impl, config=TimingConfig(read_latency_ns=20_000_000))
    eng = DmaEngine(dp, channels=1)
    h = eng.submit([Descriptor("read", 0, bytearray(64), 0, 64)])
    queued = eng.submit([Descriptor("read", 64, bytearray(64), 0, 64)])
    assert eng.pending() == 2
    h.wait(10)
    queued.wait(10)
    eng.close()  # (a waiter may wake a moment before its channel is released: drain first)
    assert eng.pending() == 0
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit([Descriptor("read", 0, bytearray(64), 0, 64)])


_descs = st.lists(st.tuples(st.sampled_from(["read", "write"]), st.integers(0, MEDIA),
                            st.integers(0, 8000), st.sampled_from([0, 1, 64, 100, 4096])),
                  min_size=1, max_size=6)


@settings(max_examples=40, deadline=None)
@given(subs=st.lists(st.tuples(_descs, st.booleans(), st.integers(0, 3000)), min_size=1, max_size=8),
       poisoned=st.lists(st.integers(0, MEDIA - 1), max_size=3))
def test_c_and_python_engines_agree(subs, poisoned):
    """Random submissions on a simulated clock (one descriptor: the one-call inline path once
    the descriptor is built; lists of 2-6: the per-descriptor and batched paths), resubmitted
    descriptors included: same completion times, errors, bytes and counters on both twins."""
    def run(impl):
        clock = ManualClock(10)
        dp, media, poison = make(impl, config=QEMU, clock=clock)
        for dpa in poisoned:
            poison[dpa >> 9] |= 1 << ((dpa >> 6) & 7)
        host = bytearray(range(256)) * 40  # 10 KiB
        out = []
        with DmaEngine(dp, channels=2) as eng:
            for spec, twice, advance in subs:
                descs = [Descriptor(d, dpa, host, off, n) for d, dpa, off, n in spec]
                for _ in range(2 if twice else 1):
                    out.append([r if isinstance(r, int) else (r.index, r.reason)
                                for r in eng.submit(descs, channel=0).wait(10)])
                clock.advance(advance)
        return out, bytes(media), bytes(host), dp.counters()

    assert run("c") == run("py")


def _slow_channel_threads(dp, delay_s: float):
    """The channel threads' waits end ``delay_s`` late (a descheduled thread); a caller's don't."""
    wait_until = dp.wait_until

    def wait(completion_ns: int) -> None:
        wait_until(completion_ns)
        if threading.current_thread().name.startswith("cxlemu-dma-"):
            threading.Event().wait(delay_s)

    dp.wait_until = wait


@pytest.mark.slow
@pytest.mark.parametrize("size", [64, 256 << 10], ids=["inline", "queued"])
def test_the_waiter_completes_its_handle_when_the_channel_thread_lags(impl, size):
    """wait() on a real-time link knows the completion time once the descriptors are issued: it
    completes the handle in the caller's thread (callbacks there, one CQ entry) instead of
    waiting for the channel's thread, here 1 s late. The channel's order is unchanged: the
    next submission on that channel still completes after it."""
    dp, media, _ = make(impl, TimingConfig(read_latency_ns=2_000_000, read_bandwidth_gbps=16))
    _slow_channel_threads(dp, 1.0)
    buf = np.zeros(size, dtype=np.uint8)
    where = []
    with DmaEngine(dp, channels=1) as eng:
        h = eng.submit([Descriptor("read", 0x1000, buf, 0, size)])
        h.add_done_callback(lambda _h: where.append(threading.current_thread().name))
        if size > 64:  # queued: the waiter reaps once the channel's thread has issued it
            while getattr(h, "_reap", None) is None:
                threading.Event().wait(0.001)
        assert h.check(timeout=0.8)[0] > 0  # before the channel thread's 1-s lag
        assert where == [threading.current_thread().name]
        assert bytes(buf) == bytes(media[0x1000:0x1000 + size])
        h2 = eng.submit([Descriptor("read", 0, bytearray(64), 0, 64)])
        later = h2.check(timeout=10)[0]
    assert later > h.wait()[0]
    assert [c.id for c in eng.poll_completions()] == [h.id, h2.id]


@pytest.mark.slow
def test_done_completes_a_handle_whose_time_has_passed(impl):
    """A poller sees done() once the completion time passes, without the channel's thread."""
    dp, *_ = make(impl, TimingConfig(read_latency_ns=1_000_000, read_bandwidth_gbps=16))
    _slow_channel_threads(dp, 1.0)
    with DmaEngine(dp, channels=1) as eng:
        h = eng.submit([Descriptor("read", 0, bytearray(64), 0, 64)])
        for _ in range(800):
            if h.done():
                break
            threading.Event().wait(0.001)
        assert h.done() and len(eng.poll_completions()) == 1


def test_a_small_transfer_due_within_microseconds_completes_in_submit(impl):
    """A 64-B read on a 5-µs link, issued inline, is due within INLINE_WAIT_NS: submit waits it
    out and returns it done (no thread hand-off), completed at or after its completion time."""
    from emulator.dma import INLINE_WAIT_NS

    dp, *_ = make(impl, TimingConfig(read_latency_ns=5_000, read_bandwidth_gbps=16))
    assert 5_000 < INLINE_WAIT_NS
    with DmaEngine(dp, channels=1) as eng:
        for _ in range(20):
            h = eng.submit([Descriptor("read", 0, bytearray(64), 0, 64)])
            assert h.done() and eng._now_ns() >= h.wait()[0]
        assert len(eng.poll_completions()) == 20


@pytest.mark.parametrize("count", [2, 5], ids=["one-by-one", "batched"])
@pytest.mark.parametrize("change", ["restart", "media off"])
def test_a_device_gone_under_the_engine_fails_the_descriptors_not_the_submit(impl, count, change):
    """The C path fails each descriptor with the typed cause; the Python twin let DeviceGone and
    MediaDisabled escape from submit(), so a caller holding a handle never saw it complete."""
    from emulator.spec.errors import DeviceGone, MediaDisabled
    from emulator.timing.linkstate import serving_word

    word = np.array([serving_word(7)], dtype=np.uint64)
    media = bytearray(MEDIA)
    dp = DataPath(media, bytearray(MEDIA // 512), bytearray(4096), QEMU, impl=impl, clock=ManualClock(0),
                  state=(memoryview(word).cast("B").cast("Q"), serving_word(7)))
    host = bytearray(count * 64)
    word[0] = serving_word(8) if change == "restart" else serving_word(7, media=False)
    with DmaEngine(dp, channels=1) as eng:
        results = eng.submit([Descriptor("write", i * 64, host, i * 64, 64) for i in range(count)]).wait(10)
    cause = DeviceGone if change == "restart" else MediaDisabled
    assert [(r.index, type(r.__cause__)) for r in results] == [(i, cause) for i in range(count)]
    assert not any(media)
