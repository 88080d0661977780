"""cffi (API mode) build of the C replay loops and Quest's page choice: ``firmware_model._fastreplay_c``.

Built by setuptools at install (``cffi_modules`` in setup.py, paths relative to the repo root) or
in place for a source checkout with ``python -m firmware_model._fast_build``. Without it,
:mod:`firmware_model._fast` says so and replay runs the Python policies.
"""
from __future__ import annotations

import pathlib

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
        sources=[f"{prefix}firmware_model/_fastreplay.c", f"{prefix}firmware_model/_hotpages.c"],
        include_dirs=[f"{prefix}firmware_model"],
        extra_compile_args=["-O2", "-std=gnu11"],
    )
    return ffi


ffibuilder = make_builder()


def build_in_place() -> pathlib.Path:
    """Compile next to the sources (a source checkout without ``pip install -e .``)."""
    # imported here, not at the top: setuptools runs this file (cffi_modules) in pip's build
    # environment, where importing the package (its __init__ imports numpy) fails
    from firmware_model.cbuild import compile_in_place

    return compile_in_place(make_builder(str(_ROOT)), _ROOT / "firmware_model")


if __name__ == "__main__":
    print(build_in_place())
