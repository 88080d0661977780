"""`cxlemu identify NAME` prints the driver's `MemDev.identity()` record, nothing of its own."""
from __future__ import annotations

import json
from typing import Any

from tools.cli.main import main


def test_cli_identify_prints_the_drivers_record(served: Any, memdev: Any, capsys: Any) -> None:
    assert main(["identify", served.name]) == 0
    out, err = capsys.readouterr()
    assert err == "" and json.loads(out) == {"memdev": served.name, **memdev.identity()}
    assert json.loads(out)["serial"] == memdev.identify().serial  # the Identify command's fields are there
