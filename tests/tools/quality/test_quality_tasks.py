"""The yardstick's documents: the same seed gives the same tokens (exact), each fact is asked at
the end with its answer after it, and the perplexity tail is filler."""
from __future__ import annotations

import numpy as np
import pytest

from tools.quality.tasks import (BOS, FILLER, KEYS, NEEDLE_Q, NEEDLE_VALUE, PASSKEY, PPL_TOKENS, RECALL_PAIRS,
                                 RECALL_Q, SKIP_MAP, VALUES, make_document, query_tokens)


def test_a_seed_gives_exactly_these_tokens() -> None:
    doc = make_document(300, 1)
    assert doc.tokens[:12].tolist() == EXPECTED_HEAD
    assert doc.tokens[-29:].tolist() == EXPECTED_QUERIES
    assert (doc.needle_at, doc.recall_at, doc.prompt_len) == EXPECTED_POSITIONS
    assert np.array_equal(make_document(300, 1).tokens, doc.tokens)
    assert not np.array_equal(make_document(300, 2).tokens, doc.tokens)


EXPECTED_HEAD = [1, 58, 77, 93, 23, 69, 72, 106, 19, 100, 96, 111]
EXPECTED_QUERIES = [3, 192, 203, 215, 217, 4, 154, 250, 4, 136, 240, 4, 179, 238, 4, 157, 224, 4, 130, 234, 4, 172, 249, 4, 185, 247, 4, 188, 226]
EXPECTED_POSITIONS = ((271, 272, 273, 274), (277, 280, 283, 286, 289, 292, 295, 298), 206)


@pytest.mark.parametrize("context,seed", [(300, 0), (2048, 5), (8192, 9)])
def test_each_fact_is_asked_once_with_its_answer(context: int, seed: int) -> None:
    doc = make_document(context, seed)
    t = doc.tokens.tolist()
    assert len(t) == context and t[0] == BOS and len(t) - doc.needle_at[0] == query_tokens()
    # the needle: its passkey once in the body, token i the one of passkey range i there
    q = t.index(NEEDLE_Q)
    passkey = t[q + 1:q + 1 + NEEDLE_VALUE]
    span = (PASSKEY[1] - PASSKEY[0]) // NEEDLE_VALUE
    body = t[1:q]
    for i, p in enumerate(passkey):
        lo = PASSKEY[0] + i * span
        assert [x for x in body if lo <= x < lo + span] == [p]
    at = body.index(passkey[0])
    assert body[at:at + NEEDLE_VALUE] == passkey and doc.answers(doc.needle_at) == passkey
    # the recall pairs: each key once in the body, right after the value asked for
    assert len(doc.recall_at) == RECALL_PAIRS
    for p, answer in zip(doc.recall_at, doc.answers(doc.recall_at)):
        assert t[p - 1] == RECALL_Q and KEYS[0] <= t[p] < KEYS[1] and VALUES[0] <= answer < VALUES[1]
        assert body.count(t[p]) == 1 and body[body.index(t[p]) - 1] == answer
    # the perplexity tail: filler only, right before the queries
    tail = doc.answers(doc.ppl_at)
    assert len(tail) == PPL_TOKENS and doc.ppl_at[-1] + 2 == q
    assert all(FILLER[0] <= x < FILLER[1] for x in tail) and doc.prompt_len == doc.ppl_at[0]


def test_the_skip_map_is_a_fixed_permutation_of_the_filler() -> None:
    assert sorted(SKIP_MAP.tolist()) == list(range(*FILLER))
    assert SKIP_MAP[:4].tolist() == EXPECTED_SKIP_MAP


EXPECTED_SKIP_MAP = [18, 40, 26, 113]


def test_a_context_too_short_is_refused() -> None:
    with pytest.raises(ValueError, match="a context of 100 tokens has no room for 8 recall pairs"):
        make_document(100, 0)
