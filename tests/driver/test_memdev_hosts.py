"""A device serving several host ports: each port its own BAR, mailbox and link; the media,
poison list and LSA the device's; a port claimed by one process at a time."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from driver import MemDev, NoSuchHost
from emulator.device import DeviceConfig, serve
from emulator.spec import registers as R
from emulator.timing import linkstate

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = 2_000
LSA_REGION = 1024  # bytes of the LSA each host process owns (host h at h * LSA_REGION)

#: One host process: claims port ``host``, writes its own LSA region, says ready, waits for "go",
#: then sends COMMANDS commands (Get Timestamp / Identify / Get LSA of its region, in turn) and
#: checks every answer against what its own port must answer; prints the tally as JSON.
HOST = textwrap.dedent("""
    import json, random, sys
    from driver import MemDev
    from emulator.spec.payloads_memdev import GET_LSA, SET_LSA

    name, host, count, region, identify = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \\
        bytes.fromhex(sys.argv[5])
    rng = random.Random(host)
    pattern = rng.randbytes(region)
    base = host * region
    wrong, last_ts, kinds = [], 0, {"timestamp": 0, "identify": 0, "lsa": 0}
    with MemDev.open(name, host=host) as md:
        assert md.send(0x4103, SET_LSA.pack(offset=base) + pattern) == (0, b"")
        print("ready", flush=True)
        sys.stdin.readline()
        for i in range(count):
            if i % 3 == 0:
                rc, out = md.send(0x0300)
                ts = int.from_bytes(out, "little")
                ok, kind = rc == 0 and len(out) == 8 and ts >= max(last_ts, 1), "timestamp"
                last_ts = ts
            elif i % 3 == 1:
                rc, out = md.send(0x0001)
                ok, kind = rc == 0 and out == identify, "identify"
            else:
                off = rng.randrange(0, region - 16)
                length = rng.randrange(16, region - off + 1)
                rc, out = md.send(0x4102, GET_LSA.pack(offset=base + off, length=length))
                ok, kind = rc == 0 and out == pattern[off:off + length], "lsa"
            kinds[kind] += 1
            if not ok:
                wrong.append([i, kind, rc, out[:16].hex()])
    print(json.dumps({"kinds": kinds, "wrong": wrong[:5], "wrong_count": len(wrong)}), flush=True)
""")


@pytest.fixture
def two_hosts(device_name: str) -> Iterator[object]:
    """A 256 MiB device with two host ports, served in-process."""
    with serve(DeviceConfig(name=device_name, capacity=256 << 20, hosts=2)) as s:
        yield s


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def test_two_hosts_send_concurrently_from_two_processes_and_get_only_their_own_answers(two_hosts) -> None:
    name = two_hosts.name
    with MemDev.open(name, host=0) as md:
        md.set_timestamp()
        identify = md.send(0x0001)[1]
    procs = [subprocess.Popen([sys.executable, "-c", HOST, name, str(h), str(COMMANDS), str(LSA_REGION),
                               identify.hex()], cwd=ROOT, env=_env(), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for h in (0, 1)]
    try:
        for p in procs:
            line = p.stdout.readline()
            assert line == "ready\n", p.stderr.read()
        for p in procs:  # both start together: their commands interleave in the runner's passes
            p.stdin.write("go\n")
            p.stdin.flush()
        results = [json.loads(p.communicate(timeout=300)[0]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    sent = {kind: len(range(k, COMMANDS, 3)) for k, kind in enumerate(("timestamp", "identify", "lsa"))}
    for r in results:
        assert r["wrong_count"] == 0, r["wrong"]
        assert r["kinds"] == sent == {"timestamp": 667, "identify": 667, "lsa": 666}


def test_poison_injected_through_host_1_is_listed_through_host_0(two_hosts) -> None:
    with MemDev.open(two_hosts.name, host=1) as md1, MemDev.open(two_hosts.name, host=0) as md0:
        md1.inject_poison(0x4000)
        listed = md0.get_poison_list()
        assert [(r.dpa, r.length) for r in listed.records] == [(0x4000, 64)]
        assert md0.first_poisoned(0, 1 << 20) == 0x4000


def test_a_media_event_reaches_every_port_and_each_clears_its_own(two_hosts) -> None:
    """A device-wide event goes into every port's logs; Clear Event Records through one port
    leaves the other's copy."""
    two_hosts.firmware.events.general_media(2, 0x8000)  # failure log
    with MemDev.open(two_hosts.name, host=1) as md1, MemDev.open(two_hosts.name, host=0) as md0:
        got = [md.get_event_records("failure").records for md in (md0, md1)]
        assert [[r.fields["physical_address"] & ~0x3F for r in recs] for recs in got] == [[0x8000], [0x8000]]
        md1.clear_event_records("failure", [got[1][0].handle])
        assert md1.get_event_records("failure").records == []
        assert [r.handle for r in md0.get_event_records("failure").records] == [got[0][0].handle]


def test_each_host_has_its_own_bar_and_link_state(two_hosts) -> None:
    with MemDev.open(two_hosts.name, host=1) as md1, MemDev.open(two_hosts.name, host=0) as md0:
        assert md1.host == 1 and md0.host == 0
        assert Path(md1.files.path, "bar.h1").stat().st_size == R.BAR_SIZE
        before0 = linkstate.words(memoryview(md0.bar)[R.LINK_STATE_OFFSET:R.LINK_STATE_OFFSET + R.LINK_STATE_SIZE])
        words1 = linkstate.words(memoryview(md1.bar)[R.LINK_STATE_OFFSET:R.LINK_STATE_OFFSET + R.LINK_STATE_SIZE])
        snapshot0, snapshot1 = bytes(before0), bytes(words1)
        md1.write(0, bytes(1 << 20))  # host 1's link only
        assert bytes(words1) != snapshot1 and bytes(before0) == snapshot0
        assert md0.read(0, 64) == bytes(64)
        del before0, words1


def test_a_host_the_device_lacks_is_refused_with_the_count(two_hosts) -> None:
    with pytest.raises(NoSuchHost, match=r"has 2 host ports \(0\.\.1\): no host 2") as err:
        MemDev.open(two_hosts.name, host=2)
    assert isinstance(err.value, ValueError) and err.value.hosts == 2


def test_a_claimed_port_is_refused_to_another_process_and_reopened_by_its_own(two_hosts) -> None:
    name = two_hosts.name
    probe = ("import sys\nfrom driver import MemDev, PortClaimed\n"
             "try:\n    MemDev.open(sys.argv[1], host=1).close()\n    print('opened')\n"
             "except PortClaimed as e:\n    print(e.pid, e)\n")
    run = lambda: subprocess.run([sys.executable, "-c", probe, name], cwd=ROOT, env=_env(),  # noqa: E731
                                 capture_output=True, text=True, timeout=120).stdout
    with MemDev.open(name, host=1) as md:
        again = MemDev.open(name, host=1)  # the same process may open it again
        again.close()
        assert md.identify().serial == DeviceConfig(name=name).serial  # still usable, still claimed
        refused = run()
        assert refused.startswith(f"{os.getpid()} ") and f"claimed by pid {os.getpid()}" in refused
    assert run() == "opened\n"  # released with the last handle


def test_one_port_devices_are_shared_by_every_process_as_before(served) -> None:
    probe = "import sys\nfrom driver import MemDev\nMemDev.open(sys.argv[1]).close()\nprint('opened')\n"
    with MemDev.open(served.name):
        out = subprocess.run([sys.executable, "-c", probe, served.name], cwd=ROOT, env=_env(),
                             capture_output=True, text=True, timeout=120)
    assert out.stdout == "opened\n", out.stderr
    assert not list(Path(served.files.path).glob("host.*.pid"))
