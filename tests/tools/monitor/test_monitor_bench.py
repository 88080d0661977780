"""`cxlemu bench telemetry`: the telemetry page's cost, through the CLI."""
from __future__ import annotations

import json

from tools.cli.main import main
from tools.monitor.bench import run


def test_bench_telemetry_prints_microseconds_per_call_as_json(capsys) -> None:
    assert main(["bench", "telemetry", "--rounds", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == list(run(1))
    assert all(isinstance(us, float) and us > 0 for us in out.values())


def test_bench_telemetry_refuses_zero_rounds_in_one_line(capsys) -> None:
    assert main(["bench", "telemetry", "--rounds", "0"]) == 2
    assert capsys.readouterr().err == "cxlemu: error: --rounds must be >= 1, got 0\n"
