"""Build hook for setuptools (the cffi extensions are added here: the timed data path's C core,
and the firmware model's C replay loops)."""
from setuptools import setup

setup(cffi_modules=["emulator/timing/_build.py:ffibuilder", "firmware_model/_fast_build.py:ffibuilder"])
