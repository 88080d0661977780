"""Fixtures of the KV-cache tests."""
from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="module")
def model() -> Any:
    """The tiny seeded Llama (`kv_support.tiny_model`), built once per module: its runs are
    deterministic, so tests of one module share it."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kv_support import tiny_model

    return tiny_model()
