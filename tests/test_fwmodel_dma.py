"""DMA scheduling model: the timed data path's cost function on a simulated clock."""
from __future__ import annotations

import pytest
import simpy

from firmware_model.dma import DmaScheduler, QueueFullError, TransferCost

COST = TransferCost(read_latency_ns=100, write_latency_ns=200, read_bandwidth_gbps=16,
                    write_bandwidth_gbps=8, block_bytes=4096)


def test_cost_function_matches_the_timed_data_path() -> None:
    """completion = max(now, link_free) + (latency + bytes / bandwidth) * time_scale."""
    assert COST.duration_ns("read", 4096) == 100 + 256
    assert COST.duration_ns("write", 4096) == 200 + 512
    assert COST.completion_ns(now=1000, link_free=500, direction="read", nbytes=4096) == 1356
    assert COST.completion_ns(now=1000, link_free=2000, direction="read", nbytes=4096) == 2356
    scaled = TransferCost(read_latency_ns=100, read_bandwidth_gbps=16, time_scale=2.5)
    assert scaled.duration_ns("read", 4096) == 890
    assert TransferCost().duration_ns("read", 1 << 30) == 0  # bandwidth 0 = unthrottled


def test_one_transfer_completes_at_its_cost() -> None:
    env = simpy.Environment()
    dma = DmaScheduler(env, COST)
    req = dma.submit("read", 4096)
    assert req.state == "in_flight"
    env.run()
    assert env.now == 356 and req.completed_at == 356 and req.state == "done"
    assert dma.bytes_done == {"read": 4096, "write": 0}


def test_channels_share_one_link_per_direction() -> None:
    """Two channels: reads still serialise on the read link; a write runs on its own link."""
    env = simpy.Environment()
    dma = DmaScheduler(env, COST, channels=3)
    r1, r2, w = dma.submit("read", 4096), dma.submit("read", 4096), dma.submit("write", 4096)
    env.run()
    assert (r1.completed_at, r2.completed_at, w.completed_at) == (356, 712, 712)
    assert r2.started_at == 0 and dma.max_queue_depth == 3


def test_queued_requests_go_by_priority_then_fifo() -> None:
    """One channel: the rest wait; lower priority value first, FIFO among equals."""
    env = simpy.Environment()
    dma = DmaScheduler(env, COST, channels=1)
    first = dma.submit("read", 4096, priority=5)
    a, b, c = (dma.submit("read", 4096, priority=p, tag=t) for p, t in ((2, "a"), (1, "b"), (2, "c")))
    order: list[str] = []
    for r in (a, b, c):
        r.done.callbacks.append(lambda ev: order.append(ev.value.tag))
    assert dma.queued == 3 and dma.in_flight == 1
    env.run()
    assert order == ["b", "a", "c"]
    assert (first.completed_at, b.started_at, b.completed_at, c.completed_at) == (356, 356, 712, 1424)


def test_queue_depth_bounds_outstanding_requests() -> None:
    env = simpy.Environment()
    dma = DmaScheduler(env, COST, channels=1, queue_depth=2)
    dma.submit("read", 64)
    dma.submit("read", 64)
    with pytest.raises(QueueFullError, match="2 outstanding"):
        dma.submit("read", 64)
    env.run()
    dma.submit("read", 64)


def test_cancelled_request_never_completes() -> None:
    """A queued request can be cancelled; an in-flight one cannot."""
    env = simpy.Environment()
    dma = DmaScheduler(env, COST, channels=1)
    running, queued = dma.submit("read", 4096), dma.submit("read", 4096)
    assert not dma.cancel(running) and dma.cancel(queued) and not dma.cancel(queued)
    assert dma.queued == 0
    env.run()
    assert env.now == 356 and not queued.done.triggered and queued.state == "cancelled"
    assert dma.transfers_done["read"] == 1


@pytest.mark.parametrize("call, message", [
    (lambda d: d.submit("sideways", 1), "direction"),
    (lambda d: d.submit("read", 0), "> 0 bytes"),
])
def test_bad_requests_are_refused(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(DmaScheduler(simpy.Environment(), COST))
    with pytest.raises(ValueError, match="time_scale"):
        TransferCost(time_scale=0)


def test_unthrottled_is_zero_and_none_is_refused_by_name() -> None:
    """0 is the firmware model's 'unthrottled'; None (TimingConfig's spelling of it) is a TypeError
    naming the field and the conversion, not a comparison crash deep in __post_init__."""
    import numpy as np

    with pytest.raises(TypeError, match=r"read_bandwidth_gbps must be a number \(0 = unthrottled; None is "
                                        r"TimingConfig's spelling of it\), got None"):
        TransferCost(read_latency_ns=300, read_bandwidth_gbps=None)
    with pytest.raises(TypeError, match="write_latency_ns must be a number, got '5'"):
        TransferCost(write_latency_ns="5")
    cost = TransferCost(read_latency_ns=300, read_bandwidth_gbps=0, block_bytes=np.int64(4096))
    assert cost.duration_ns("read", 1 << 20) == 300
