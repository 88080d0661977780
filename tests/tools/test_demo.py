"""`cxlemu demo` walks a device end to end and checks what it shows."""
from __future__ import annotations

from rich.console import Console

from tools.demo import run_demo


def test_device_demo_passes_every_step() -> None:
    console = Console(record=True, width=120)
    assert run_demo(console, kv=False) == 0
    text = console.export_text()
    assert "injected poison at 0x10040; poison list: [('0x10040', 64, 'injected')]" in text
    assert "a read across it fails and returns no data" in text
    for step in ("identify", "health", "poison", "sanitize"):
        assert f"│ {step}" in text
    assert "FAILED" not in text
