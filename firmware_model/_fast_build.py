"""cffi (API mode) build of the C replay loops: ``firmware_model._fastreplay_c``.

Built by setuptools at install (``cffi_modules`` in setup.py, paths relative to the repo root) or
in place for a source checkout with ``python -m firmware_model._fast_build``. Without it,
:mod:`firmware_model._fast` says so and replay runs the Python policies.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

from cffi import FFI  # type: ignore[import-untyped]

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_HEADER = (_ROOT / "firmware_model/_fastreplay.h").read_text()


def make_builder(root: str = "") -> FFI:
    """The builder; paths relative to the repo root unless ``root`` is given."""
    prefix = f"{root}/" if root else ""
    ffi = FFI()
    ffi.cdef("\n".join(line for line in _HEADER.splitlines() if not line.startswith("#")))
    ffi.set_source(
        "firmware_model._fastreplay_c",
        '#include "_fastreplay.h"',
        sources=[f"{prefix}firmware_model/_fastreplay.c"],
        include_dirs=[f"{prefix}firmware_model"],
        extra_compile_args=["-O2", "-std=gnu11"],
    )
    return ffi


ffibuilder = make_builder()


def build_in_place() -> pathlib.Path:
    """Compile next to the sources; the library is renamed into place, never overwritten (a
    process that has the old one loaded keeps its mapping)."""
    with tempfile.TemporaryDirectory() as tmp:
        built = pathlib.Path(make_builder(str(_ROOT)).compile(tmpdir=tmp, verbose=False))
        target = _ROOT / "firmware_model" / built.name
        staged = target.with_name(f".{built.name}.{os.getpid()}.tmp")
        shutil.copy2(built, staged)
        os.replace(staged, target)
    return target


if __name__ == "__main__":
    print(build_in_place())
