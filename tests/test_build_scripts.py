"""The cffi build scripts load in pip's isolated build environment, which has setuptools and cffi
and none of cxlemu's dependencies: a fresh clone's `pip install -e .` failed when
firmware_model/_fast_build.py imported the package at its top (firmware_model/__init__ imports numpy)."""
from __future__ import annotations

import ast
import subprocess
import sys

from cli_support import ROOT


def _cffi_modules() -> list[str]:
    """The ``path:builder`` entries of setup.py's ``cffi_modules``."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    (entries,) = [kw.value for node in ast.walk(tree) if isinstance(node, ast.Call)
                  for kw in node.keywords if kw.arg == "cffi_modules"]
    return [ast.literal_eval(e) for e in entries.elts]  # type: ignore[attr-defined]


def test_every_build_script_loads_without_the_projects_dependencies() -> None:
    modules = _cffi_modules()
    assert len(modules) == 2  # the timed data path's C core and the firmware model's replay loops
    code = ("import runpy, sys\n"
            "for name in ('numpy', 'simpy', 'rich', 'torch'):\n"
            "    sys.modules[name] = None  # absent, as in pip's build environment\n"
            "for entry in sys.argv[1:]:\n"
            "    path, _, builder = entry.partition(':')\n"
            "    assert runpy.run_path(path)[builder] is not None, entry\n")
    proc = subprocess.run([sys.executable, "-c", code, *modules], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
