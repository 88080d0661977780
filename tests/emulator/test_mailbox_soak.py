"""The cross-process mailbox soak (`cxlemu bench mailbox`), short: the firmware in its own
process, two host processes and a data-path load process, every answer checked; and the soak
catching lost commands from a firmware that drops some on purpose."""
from __future__ import annotations

import shlex
import sys
import textwrap

import pytest

from emulator.device import list_devices
from tools.bench import mailbox
from tools.cli.main import main


def _no_soak_devices_left() -> bool:
    return not [n for n in list_devices() if n.startswith("mbsoak-")]


@pytest.mark.slow
def test_short_soak_two_hosts_with_data_path_load() -> None:
    r = mailbox.run(commands=10_000, hosts=2, load_procs=1)
    assert r.errors == [] and r.samples == [] and r.data_samples == []
    assert r.commands == r.requested == 10_000
    assert sum(r.commands_by_kind.values()) == 10_000 and all(r.commands_by_kind.values())
    assert r.wrong == 0 and r.data_mismatches == 0
    assert r.data_ops > 0  # the load ran while the hosts did
    assert r.ok and r.wall_s > 0 and r.commands_per_s > 0
    assert _no_soak_devices_left()


#: A firmware that loses commands as the mailbox did before register stores were single stores:
#: the doorbell is cleared without running the command. Every 500th doorbell from the 100th on,
#: so none of the soak's setup commands (3, then 2 per host) is lost.
DROPPING_SERVER = textwrap.dedent("""
    import sys

    from emulator.firmware import Firmware
    from emulator.spec import registers as R

    run_command = Firmware.service_mailbox
    doorbells = 0

    def service_mailbox(self):
        global doorbells
        if not self.regs.get(R.MB_CTRL) & 1:
            return False
        doorbells += 1
        if doorbells >= 100 and doorbells % 500 == 0:
            self.regs.set_field(R.MB_CTRL, "DOORBELL", 0)
            return True
        return run_command(self)

    Firmware.service_mailbox = service_mailbox
    from tools.cli.main import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.slow
def test_soak_counts_every_lost_command(tmp_path, monkeypatch) -> None:
    wrapper = tmp_path / "dropping_server.py"
    wrapper.write_text(DROPPING_SERVER)
    monkeypatch.setenv(mailbox.SERVER_ARGV_ENV, shlex.join([sys.executable, str(wrapper)]))
    r = mailbox.run(commands=5_000, hosts=2, load_procs=0)
    setup = 3 + 2 * 2
    assert r.commands == 5_000 and r.errors == []
    assert r.wrong == (5_000 + setup) // 500  # doorbells 500, 1000, ..., 5000: each one caught
    assert not r.ok and r.server_argv[:2] == [sys.executable, str(wrapper)]
    assert 0 < len(r.samples) <= min(r.wrong, 2 * mailbox.MAX_SAMPLES)  # the first few per host
    assert all(s["got"] != s["expected"] for s in r.samples)
    assert _no_soak_devices_left()


@pytest.mark.parametrize("argv, fragment", [
    (["--commands", "0"], "--commands must be >= 1, got 0"),
    (["--commands", "-5"], "--commands must be >= 1"),
    (["--hosts", "0"], "--hosts must be between 1"),
    (["--load-procs", "-1"], "--load-procs must be >= 0"),
    (["--load-bytes", "100"], "--load-bytes must be a positive multiple of 64"),
    (["--capacity", "100M"], "--capacity must be a positive multiple of 256M"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, fragment, capsys) -> None:
    assert main(["bench", "mailbox", *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cxlemu: error: ") and fragment in lines[0], captured.err
    assert captured.out == "" and _no_soak_devices_left()


def test_shares_sum_to_the_commands() -> None:
    assert mailbox.shares(10, 3) == [4, 3, 3] and mailbox.shares(1, 2) == [1, 0]


def test_liveness_bench_times_each_call_to_device_gone() -> None:
    """`cxlemu bench liveness`'s own run: one kill per call, each found well under 100 ms."""
    from tools.bench import liveness

    result = liveness.run(kills=1)
    assert [r["call"] for r in result["rows"]] == ["read", "send", "open"]
    assert result["ok"] and all(r["max_ms"] < 100 for r in result["rows"])
