"""Compiling a cffi library next to its sources, for a source checkout without ``pip install -e .``:
the one helper both C libraries' build scripts use (``firmware_model/_fast_build.py``,
``emulator/timing/_build.py``)."""
from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
from typing import Any

__all__ = ["compile_in_place"]


def compile_in_place(builder: Any, directory: pathlib.Path) -> pathlib.Path:
    """Compile ``builder`` (a cffi FFI) and put the library into ``directory``: renamed into
    place, never overwritten, so a process that has the old one loaded (a test run, a served
    device) keeps its mapping instead of crashing on a truncated file."""
    with tempfile.TemporaryDirectory() as tmp:
        built = pathlib.Path(builder.compile(tmpdir=tmp, verbose=False))
        target = directory / built.name
        staged = target.with_name(f".{built.name}.{os.getpid()}.tmp")
        shutil.copy2(built, staged)
        os.replace(staged, target)
    return target
