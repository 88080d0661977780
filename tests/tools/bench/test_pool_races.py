"""`cxlemu bench pool --races` (tools/bench/pool.py): 3 host processes, 10,000 operations under
eviction pressure and one extent release mid-run; nothing stale, torn or leaked."""
from __future__ import annotations

import pytest
from cli_support import cli

from tools.bench.pool import classify, payload, run_races


def test_10k_operations_race_cleanly() -> None:
    r = run_races(processes=3, ops=10_000, pool_size=2 << 20, seed=1)
    assert (r.ops, r.stale, r.torn, r.leaked_allocations, r.errors) == (10_000, 0, 0, 0, [])
    assert r.evictions > 0 and r.revocations == 1  # the pool was under pressure, the release was seen
    assert r.loads_checked == r.hits > 1000 and r.sealed_audited > 0


def test_the_checker_tells_stale_from_torn() -> None:
    good = payload(5)
    assert (len(good), good[:8]) == (512 + 5 * 448, (5).to_bytes(8, "little"))
    assert classify(5, good + bytes(100)) == "ok"
    assert classify(5, payload(13)) == "stale"  # another key's block (13 % 8 == 5: the same length)
    torn = bytearray(good)
    torn[700] ^= 1
    assert classify(5, bytes(torn)) == "torn"


@pytest.mark.parametrize(("argv", "message"), [
    (["--processes", "8"], "--processes must be 1..7"),
    (["--pool-size", "3M"], "multiple of 2 MiB"),
    (["--ops", "2"], "at least --processes"),
])
def test_bad_arguments_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    rc, out, err = cli(capsys, "bench", "pool", "--races", *argv)
    assert rc == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1


def test_without_races_it_is_the_vllm_bench(capsys: pytest.CaptureFixture[str]) -> None:
    """`bench pool` alone runs vLLM engines on the pool (tools/bench/pool_serve.py): its flags."""
    rc, _, err = cli(capsys, "bench", "pool", "--engines", "4")
    assert rc == 2 and "--engines must be 2 or 3" in err
