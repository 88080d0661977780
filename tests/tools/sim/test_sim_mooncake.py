"""The Mooncake trace reader: records as they are, speed, and one clear error per malformed line."""
from __future__ import annotations

import json

import pytest

from tools.sim.mooncake import (MooncakeTraceError, TraceRequest, capped_hit_tokens, is_mooncake, read,
                                theoretical_hit_rate, to_scripts)

GOOD = {"timestamp": 1500, "input_length": 1100, "output_length": 7, "hash_ids": [4, 5, 6]}


def _line(**over: object) -> str:
    return json.dumps({**GOOD, **over})


def test_a_record_as_it_is_and_speed_divides_arrivals() -> None:
    (r,) = read([_line()], speed=2.0)
    assert r == TraceRequest(0, 750e6, 1100, 7, (4, 5, 6))
    assert [r.block_tokens(i) for i in range(3)] == [512, 512, 76]


@pytest.mark.parametrize("line, message", [
    ("{not json", "line 2: not JSON"),
    ("[1, 2]", "line 2: expected an object"),
    (_line(timestamp="soon"), "line 2: timestamp must be a number of ms >= 0, got 'soon'"),
    (_line(timestamp=-1), "line 2: timestamp must be a number of ms >= 0, got -1"),
    (_line(timestamp=10), "line 2: timestamp 10 is before the previous line's 1500"),
    (_line(input_length=0), "line 2: input_length must be >= 1, got 0"),
    (_line(input_length=12.5), "line 2: input_length must be a whole number, got 12.5"),
    (_line(output_length=None), "line 2: output_length must be a whole number, got None"),
    (_line(hash_ids="1,2"), "line 2: hash_ids must be a list of whole numbers, got '1,2'"),
    (_line(hash_ids=[1, 2]), "line 2: 1100 prompt tokens are 3 blocks of 512, but hash_ids has 2"),
])
def test_a_malformed_line_is_named(line: str, message: str) -> None:
    with pytest.raises(MooncakeTraceError) as exc:
        list(read([_line(), line, _line()]))
    assert str(exc.value).startswith(message)
    assert exc.value.line == 2


def test_blank_lines_are_skipped_and_counted() -> None:
    with pytest.raises(MooncakeTraceError, match="^line 3: not JSON"):
        list(read([_line(), "\n", "oops"]))


def test_speed_must_be_positive() -> None:
    with pytest.raises(ValueError, match="speed must be a number > 0"):
        list(read([_line()], speed=0))


def test_hits_are_capped_as_vllm_caps_them() -> None:
    r = TraceRequest(0, 0.0, 1024, 1, (1, 2))
    assert capped_hit_tokens(r, 1) == 512
    assert capped_hit_tokens(r, 2) == 1008  # one token is always computed: whole 16-token blocks below 1023


def test_the_theoretical_hit_rate_counts_prefixes_only() -> None:
    reqs = [TraceRequest(0, 0, 1024, 1, (1, 2)), TraceRequest(1, 0, 1536, 1, (1, 3, 4)),
            TraceRequest(2, 0, 1024, 1, (9, 2))]
    assert theoretical_hit_rate(reqs) == 512 / (1024 + 1536 + 1024)  # block 2 of the last follows a miss


def test_scripts_share_keys_exactly_where_prefixes_match() -> None:
    a, b = to_scripts([TraceRequest(0, 0, 1024, 4, (1, 2)), TraceRequest(1, 2e9, 1030, 4, (1, 3, 5))])
    key = [lambda j, t=s.turns[0]: t.owner_at((j + 1) * 16 - 1) for s in (a, b)]
    assert key[0](31) == key[1](31) == ("mc", 1)
    assert key[0](32) != key[1](32)
    assert b.turns[0].think_s == 2.0 and b.turns[0].owner_at(1030) == ("mc-out", 1)
    assert is_mooncake(_line()) and not is_mooncake('{"client": "c0"}')


def test_sim_serve_reads_a_mooncake_trace_as_it_is(capsys, tmp_path) -> None:
    from cli_support import cli

    trace = tmp_path / "m.jsonl"
    # r1 repeats r0's first block two seconds later: a prefix-cache hit of 512 tokens; at speed 2
    # it arrives after one second
    trace.write_text(_line(timestamp=0, input_length=600, output_length=4, hash_ids=[1, 2]) + "\n"
                     + _line(timestamp=2000, input_length=700, output_length=4, hash_ids=[1, 3]) + "\n")
    code, out, _ = cli(capsys, "sim", "serve", "--workload", "trace", "--trace", str(trace), "--model", "llama-3-8b",
                       "--offload", "none", "--speed", "2", "--json")
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and (row["concurrency"], row["requests"], row["prefix_hit_tokens"]) == (2, 2, 512)
    trace.write_text(_line(timestamp=0) + "\n" + _line(hash_ids=[]) + "\n")
    code, _, err = cli(capsys, "sim", "serve", "--workload", "trace", "--trace", str(trace))
    assert code == 2 and err == (f"cxlemu: error: trace {trace}: line 2: 1100 prompt tokens are 3 blocks of 512, "
                                 "but hash_ids has 0\n")
