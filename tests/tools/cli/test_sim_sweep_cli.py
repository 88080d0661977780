"""`cxlemu sim sweep`'s command line: the concurrency syntax and the argument errors."""
from __future__ import annotations

import argparse

import pytest

from tools.cli._common import CliError
from tools.cli._sim_sweep import cmd_sweep, parse_levels, register_sweep


@pytest.mark.parametrize(("text", "levels"), [
    ("1..4", [1, 2, 3, 4]),
    ("1,2,4", [1, 2, 4]),
    ("1..32:4", [1, 5, 9, 13, 17, 21, 25, 29]),
    ("4..16:4", [4, 8, 12, 16]),
    ("8", [8]),
    ("16, 1, 4..8:4, 1", [1, 4, 8, 16]),
])
def test_parse_levels(text, levels):
    assert parse_levels(text) == levels


@pytest.mark.parametrize("text", ["", "0..4", "4..1", "1..8:0", "a", "1..", "1-4", "2.5", "1,,x"])
def test_parse_levels_errors(text):
    with pytest.raises(CliError, match="concurrency"):
        parse_levels(text)


# --------------------------------------------------------------------------- the CLI


def _parse(argv):
    parser = argparse.ArgumentParser(prog="cxlemu sim")
    register_sweep(parser.add_subparsers(dest="cmd", required=True))
    return parser.parse_args(["sweep", *argv])


@pytest.mark.parametrize(("argv", "needle"), [
    (["--models", "gpt-9"], "--models: unknown model 'gpt-9'"),
    (["--accelerators", "tpu"], "--accelerators: unknown accelerator"),
    (["--modes", "none,cxl"], "--modes: unknown mode 'cxl'"),
    (["--workloads", "chat"], "--workloads: unknown workload 'chat'"),
    (["--policies", "nope"], "--policies: unknown eviction policy"),
    (["--concurrency", "4..1"], "--concurrency: empty concurrency range"),
    (["--pool-gb", "0"], "--pool-gb: pool sizes must be > 0"),
    (["--pool-gb", "big"], "--pool-gb: malformed"),
    (["--price", "h100"], "--price: malformed 'h100'"),
    (["--price", "v100=1"], "--price: unknown accelerator 'v100'"),
    (["--price", "h100=-1"], "--price: USD per hour must be"),
    (["--pool-price", "0.01"], "need --price"),
    (["--workers", "0"], "--workers must be >= 1"),
    (["--workers", "2", "--address", "tcp://127.0.0.1:8786"], "drop it when giving --address"),
    (["--context", "0"], "--context"),
    (["--tp", "two"], "--tp: malformed tensor parallelism 'two'"),
    (["--cost", "roofline,measured"], "--cost: unknown cost model 'measured'"),
    (["--models", "llama-3-70b", "--tp", "1,3"], "--tp: model llama-3-70b does not split over 3"),
])
def test_cli_argument_errors(argv, needle):
    args = _parse(argv)
    assert args.func is cmd_sweep
    with pytest.raises(CliError, match=needle.replace("(", r"\(")) as e:
        cmd_sweep(args)
    assert e.value.exit_code == 2
    assert "\n" not in str(e.value)


def test_cli_defaults():
    args = _parse([])
    assert args.json is None and args.plot is None and args.address is None
    assert _parse(["--plot"]).plot == "sweep"
    assert _parse(["--json"]).json == "-"
