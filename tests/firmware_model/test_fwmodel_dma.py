"""DMA scheduling model: the one link model on a simulated clock."""
from __future__ import annotations

import pytest
import simpy

from firmware_model.dma import DmaScheduler, QueueFullError, TransferCost
from firmware_model.link import LinkParams

COST = TransferCost(read_latency_ns=100, write_latency_ns=200, read_bandwidth_gbps=16,
                    write_bandwidth_gbps=8, block_bytes=4096)


def test_cost_is_the_link_model_latency_pipelined() -> None:
    """The link is busy for the bytes only: a second read queues behind the first's 256 ns of
    occupancy, not behind its latency (the data path's figure is checked in test_link_model)."""
    assert COST.duration_ns("read", 4096) == 100 + 256
    assert COST.duration_ns("write", 4096) == 200 + 512
    assert COST.duration_ns("read", 4033) == 100 + 256  # 64 whole 64-B transactions
    scaled = TransferCost(read_latency_ns=100, read_bandwidth_gbps=16, time_scale=2.5)
    assert scaled.duration_ns("read", 4096) == 890
    assert TransferCost().duration_ns("read", 1 << 30) == 0  # bandwidth 0 = unthrottled
    env = simpy.Environment()
    dma = DmaScheduler(env, TransferCost(read_latency_ns=100, read_bandwidth_gbps=16), channels=2)
    first, second = dma.submit("read", 64), dma.submit("read", 64)
    env.run()
    assert (first.completed_at, second.completed_at, env.now) == (104, 108, 108)
    assert dma.link_free == {"read": 8, "write": 0}


def test_transactions_charged_follow_the_dpa() -> None:
    """64 B straddling a 64-B boundary occupy two transactions."""
    env = simpy.Environment()
    dma = DmaScheduler(env, TransferCost(read_bandwidth_gbps=1), channels=2)
    aligned, straddling = dma.submit("read", 64, dpa=0), dma.submit("read", 64, dpa=32)
    env.run()
    assert (aligned.completed_at, straddling.completed_at) == (64, 64 + 128)


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
    assert (r1.completed_at, r2.completed_at, w.completed_at) == (356, 612, 712)
    assert dma.link_free == {"read": 512, "write": 512}
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
    """0 is the link model's 'unthrottled'; None is a TypeError naming the field, not a
    comparison crash; the numbers become the integers the data path uses."""
    import numpy as np

    with pytest.raises(TypeError, match=r"read_bandwidth_gbps must be a number \(0 = unthrottled\), got None"):
        TransferCost(read_latency_ns=300, read_bandwidth_gbps=None)
    with pytest.raises(TypeError, match="write_latency_ns must be a number, got '5'"):
        TransferCost(write_latency_ns="5")
    cost = TransferCost(read_latency_ns=300, read_bandwidth_gbps=0, block_bytes=np.int64(4096))
    assert cost.duration_ns("read", 1 << 20) == 300
    assert (cost.lat_ns, cost.fs_per_byte, cost.txn_bytes, cost.block_bytes) == ((300, 0), (0, 0), 64, 4096)
    assert isinstance(cost, LinkParams)
