"""cffi (API mode) build of the timed data path's C core: ``emulator.timing._cdatapath``.

Built by setuptools at install (``cffi_modules`` in setup.py, paths relative to the repo
root) or in place for a source checkout with ``python -m emulator.timing._build``.  The
library also holds two plain CPython modules, loaded from the same file by ``cimpl``:
``emulator.timing._fastcall`` (``_fastcall.c``: the data path's entry points, plain host
buffers through the buffer protocol) and ``emulator.timing._dmacall`` (``_dmacall.c``: the DMA
engine's issue, channel claim word, handle fields and inline submission).
"""
from __future__ import annotations

import pathlib
import re

from cffi import FFI

_ROOT = pathlib.Path(__file__).resolve().parents[2]
_HEADER = (_ROOT / "emulator/timing/_datapath.h").read_text()


def _cdef_from_header(header: str) -> str:
    """The header minus preprocessor lines cffi cannot parse: integer ``#define``s become
    ``#define NAME ...`` (value taken from the compiled header), function-like ones go."""
    keep = []
    for line in header.splitlines():
        if re.match(r"#define CXL_\w+ ", line):
            keep.append(re.sub(r"#define (\w+) .*", r"#define \1 ...", line))
        elif not line.startswith("#"):
            keep.append(line)
    return "\n".join(keep)


def make_builder(root: str = "") -> FFI:
    """The builder; paths relative to the repo root (setuptools wants them so) unless
    ``root`` is given (cffi's in-place compile runs in a temporary directory)."""
    prefix = f"{root}/" if root else ""
    ffi = FFI()
    ffi.cdef(_cdef_from_header(_HEADER))
    ffi.set_source(
        "emulator.timing._cdatapath",
        '#include "_datapath.h"',
        # _fastcall.c, _dmacall.c: further modules in the same library, see their header comments
        sources=[f"{prefix}emulator/timing/{name}.c" for name in ("_datapath", "_fastcall", "_dmacall")],
        include_dirs=[f"{prefix}emulator/timing"],
        extra_compile_args=["-O2", "-std=gnu11"],
    )
    return ffi


ffibuilder = make_builder()


def build_in_place() -> pathlib.Path:
    """Compile next to the sources (a source checkout without `pip install -e .`), renamed into
    place as for the replay library."""
    from firmware_model.cbuild import compile_in_place

    return compile_in_place(make_builder(str(_ROOT)), _ROOT / "emulator/timing")


if __name__ == "__main__":
    print(build_in_place())
