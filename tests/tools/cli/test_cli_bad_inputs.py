"""Issue 24, items 9 and 11: each bad input is exit 2 and exactly one line `cxlemu: error: ...` on
stderr, no traceback, and the process ends at once (nothing served, allocated or waited for)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cli_support import cxlemu  # the subprocess helper (60 s timeout: a wait fails the test)

from tools.cli._sim_sweep import MAX_LEVELS
from tools.sim.run import MAX_CLIENTS

CONTRACT = ("a class implementing EvictionPolicy (firmware_model.policies.base) with name: str; "
            "insert(self, key, now=0) -> None; touch(self, key, now=0) -> None; remove(self, key) -> None; "
            "evict(self, protected=()) -> key, raising NoVictimError when none; __contains__(self, key) -> bool; "
            "__len__(self) -> int; built as __init__(self, capacity, **options), or a factory "
            "f(capacity, **options) returning one")
LLAMA_H100 = ("llama-2-7b on h100 can hold: at most 6756 (its KV space is 6757 blocks of 16 tokens, one "
              "block a request, one the null block)")


def refused(*argv: str) -> str:
    """Run `cxlemu argv` in a subprocess; assert exit 2 and one error line; return its message."""
    proc = cxlemu(*argv)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("cxlemu: error: "), proc.stderr
    return lines[0].removeprefix("cxlemu: error: ")


@pytest.fixture(scope="module")
def zipf_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("traces") / "z.jsonl"
    path.write_text("".join(json.dumps({"t": i, "block": i % 7}) + "\n" for i in range(64)))
    return path


@pytest.fixture(scope="module")
def binary_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bin") / "a.out"
    path.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(0xd0, 0x100)) * 4)
    return path


# 11. --compute-ns=-1 (trace replay is the one subcommand taking it) ------------------------------

def test_replay_refuses_a_negative_compute_time(zipf_trace: Path) -> None:
    assert refused("trace", "replay", str(zipf_trace), "--capacity", "4", "--compute-ns=-1") == \
        "argument --compute-ns: must be a whole number of ns >= 0, got -1"


# 11. --policy os:getcwd: not a policy; the message says what the contract needs -----------------

@pytest.mark.parametrize("argv, prefix", [
    (("trace", "replay", "{trace}", "--capacity", "4"), "argument --policy: "),
    (("bench", "kv"), ""),  # checked before a model is built
])
def test_policy_flags_refuse_a_function_that_is_no_policy(zipf_trace: Path, argv: tuple[str, ...],
                                                          prefix: str) -> None:
    argv = tuple(a.format(trace=zipf_trace) for a in argv)
    assert refused(*argv, "--policy", "os:getcwd") == (
        f"{prefix}eviction policy os:getcwd is {os.getcwd!r}, which cannot be called as "
        f"f(capacity) (its signature is ()): expected {CONTRACT}")


# 11. a binary file given as a trace: named -------------------------------------------------------

def test_replay_names_a_binary_file_given_as_a_trace(binary_file: Path) -> None:
    assert refused("trace", "replay", str(binary_file), "--capacity", "4") == (
        f"{binary_file}:1: binary data, not JSON lines; a trace is JSON lines or a binary .npz/.npy file")


def test_sim_serve_names_a_binary_file_given_as_a_trace(binary_file: Path) -> None:
    assert refused("sim", "serve", "--workload", "trace", "--trace", str(binary_file)) == (
        f"trace {binary_file} is not a trace: it is binary, not JSON-lines text (byte 0xd0 is not UTF-8); a session "
        "trace is JSON lines (write one with `cxlemu trace gen sessions`)")


# 11. bench bandwidth --size 4G: the limit, before a device is served ------------------------------

def test_bench_bandwidth_says_the_size_limit() -> None:
    assert refused("bench", "bandwidth", "--size", "4K", "--size", "4G") == (
        "--size 4G is larger than the region the probe streams through (--region 64M, 0x4000000 B): give a "
        "--size of at most 64M, or a larger --region (at most the device's capacity)")


def test_bench_bandwidth_names_its_own_flag_for_a_region_past_the_device() -> None:
    assert refused("bench", "bandwidth", "--region", "1G", "--size", "512M") == (
        "probe region [0x0, 0x40000000) must be 64-B aligned and inside the media (0x10000000 B): pass a "
        "smaller --region or another --dpa")


# 11. sim sweep --address nonsense: refused before a cluster is asked -------------------------------

@pytest.mark.parametrize("address, message", [
    ("nonsense", "malformed scheduler address 'nonsense': use [PROTOCOL://]HOST:PORT, e.g. tcp://10.0.0.5:8786"),
    ("tcp://host:0", "port must be 1..65535, got 0"),
    ("foo://host:8786", "unknown protocol 'foo' in 'foo://host:8786': use one of tcp, tls, ucx, ws, wss, "
                        "e.g. tcp://10.0.0.5:8786"),
])
def test_sim_sweep_refuses_a_malformed_address(address: str, message: str) -> None:
    assert refused("sim", "sweep", "--address", address) == f"argument --address: {message}"


# 11. monitor nosuch: an error at once, not a wait for a device that never appears --------------------

def test_monitor_of_an_unknown_device_exits_at_once(runtime_dir: str) -> None:
    assert refused("monitor", "nosuch") == f"no device named 'nosuch' in {runtime_dir} (see `cxlemu list`)"
    assert refused("monitor", "nosuch", "--frames", "1") == \
        f"no device named 'nosuch' in {runtime_dir} (see `cxlemu list`)"


# 11. --concurrency 100000000: bounded by what the KV space holds, on every subcommand taking it ----

def test_sim_serve_bounds_concurrency_by_the_kv_space() -> None:
    assert refused("sim", "serve", "--concurrency", "100000000") == f"--concurrency: 100000000 clients is more than {LLAMA_H100}"
    assert refused("sim", "serve", "--concurrency", "6757", "--offload", "none") == \
        f"--concurrency: 6757 clients is more than {LLAMA_H100}"


def test_sim_serve_bounds_concurrency_by_the_hard_cap() -> None:
    assert refused("sim", "serve", "--kv-blocks", "1000000000", "--concurrency", str(MAX_CLIENTS + 1)) == (
        f"--concurrency: {MAX_CLIENTS + 1} clients is more than the simulator takes: at most {MAX_CLIENTS} "
        "(tools.sim.run.MAX_CLIENTS)")


def test_concurrency_ranges_are_bounded_before_they_are_built() -> None:
    assert refused("sim", "serve", "--concurrency", "1..100000000") == (
        f"argument --concurrency: too many concurrency levels in '1..100000000': at most {MAX_LEVELS} (each is a "
        "whole simulation); use a step, e.g. 1..100000000:6249999")


def test_sim_sweep_and_bench_sim_bound_concurrency_too() -> None:
    assert refused("sim", "sweep", "--models", "llama-2-7b", "--accelerators", "h100", "--concurrency",
                   "100000000") == f"--concurrency: 100000000 clients is more than {LLAMA_H100}"
    assert refused("bench", "sim", "--concurrency", "100000000") == \
        f"--concurrency: 100000000 clients is more than {LLAMA_H100}"


# 9. sim serve --workload trace: the trace's clients are its concurrency -----------------------------

def test_sim_serve_refuses_concurrency_with_a_trace(zipf_trace: Path) -> None:
    assert refused("sim", "serve", "--workload", "trace", "--trace", str(zipf_trace), "--concurrency", "1,4") == (
        "--concurrency does not apply to --workload trace: the trace's clients are its concurrency (write one "
        "at N with `cxlemu trace gen sessions --concurrency N`)")
