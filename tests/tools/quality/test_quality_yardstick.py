"""The shipped yardstick: its weights match their sha256; through CxlCache's dense attention it
predicts exactly what it does through DynamicCache on a held-out 2k document, and its perplexity
there is the trained one (the filler's grammar learned; a random model's is the vocabulary's), and it
retrieves: the needle at 2k."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tools.common import CliError  # noqa: E402
from tools.quality import model as yardstick  # noqa: E402
from tools.quality.evaluate import score  # noqa: E402
from tools.quality.tasks import make_document  # noqa: E402


@pytest.fixture(scope="module")
def model() -> Any:
    import torch

    torch.set_num_threads(1)
    return yardstick.load()


def test_damaged_weights_are_refused(tmp_path: Path) -> None:
    for name in (yardstick.WEIGHTS, yardstick.META):
        shutil.copy(yardstick.DATA_DIR / name, tmp_path / name)
    data = bytearray((tmp_path / yardstick.WEIGHTS).read_bytes())
    data[-1] ^= 1
    (tmp_path / yardstick.WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(CliError, match=r"has sha256 [0-9a-f]{64}, yardstick.json says"):
        yardstick.load(tmp_path)


def test_dense_cxlcache_predicts_as_dynamiccache_with_the_trained_perplexity(model: Any) -> None:
    import math

    from transformers import DynamicCache

    from driver.kv import MemoryBlockStore
    from driver.kv.cache import CxlCache

    doc = make_document(2048, 1 << 62)  # bench quality's first held-out document
    with CxlCache(1 << 30, store=MemoryBlockStore(1 << 24), max_seq_len=2048) as cache:
        ours = score(model, doc, cache)
    ref = score(model, doc, DynamicCache())
    assert ours.argmax == ref.argmax and ours.nll_sum == pytest.approx(ref.nll_sum, rel=1e-5)
    assert math.exp(ours.nll_sum / ours.nll_count) < 20  # the filler's 112 tokens: 112 if untrained


def test_trained_model_finds_the_needle_and_some_recall_values_at_2k(model: Any) -> None:
    from tools.bench.quality import EVAL_SEED
    from tools.quality.evaluate import forward_accuracy

    # bench quality's first 4 held-out 2k documents: every passkey (4 tokens, 1 in 4096 by chance)
    # and 7 of the 32 recall values (1 in 32 by chance)
    assert forward_accuracy(model, 2048, 4, EVAL_SEED) == (1.0, 7 / 32)


def test_layer_0_reads_the_passkey_and_spreads_over_the_values(model: Any) -> None:
    """`quality probe`: at the needle a layer-0 head reads the passkey token; at the recall queries
    the same head spreads its weight over all the document's values, about an eighth on the
    answer's (it answers with a value, not by the key); the attention implementation restored."""
    from tools.bench.quality import EVAL_SEED
    from tools.quality.probe import probe

    before = model.config._attn_implementation
    rows = {(r.layer, r.head): r for r in probe(model, [2048], 2, EVAL_SEED)}
    assert model.config._attn_implementation == before
    assert sorted(rows) == [(layer, head) for layer in (0, 1) for head in range(4)]
    head = rows[(0, 0)]
    assert head.needle_answer > 0.3
    assert head.recall_values > 0.8 and head.recall_answer_value < head.recall_values / 4
    assert all(r.recall_answer_key < 0.05 for r in rows.values())  # nothing finds the pair by its key
