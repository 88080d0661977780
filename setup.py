"""Build hook for setuptools (the timed data path's cffi extension is added here)."""
from setuptools import setup

setup(cffi_modules=["emulator/timing/_build.py:ffibuilder"])
