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


def test_without_the_kv_extra_the_demo_skips_its_kv_step_saying_how_to_install_it(monkeypatch) -> None:
    """torch absent (as after the README's command without the kv extra): the device steps pass,
    the KV step is skipped, and the line says to take torch's CPU build first (PyPI's Linux torch
    is the CUDA build, several GB)."""
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)  # import torch: ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "driver.kv.demo", raising=False)
    console = Console(record=True, width=400)
    assert run_demo(console, kv=True) == 0
    text = console.export_text()
    assert ("skipping the KV generation: import of torch halted; None in sys.modules (pip install torch==2.13.0 "
            "--index-url https://download.pytorch.org/whl/cpu && pip install -e '.[kv]' (in the cxlemu "
            "checkout))") in text
    assert "FAILED" not in text
