"""`bench quality`'s diagnosis (tools.bench.quality_reads) on a hand-made document: the answers'
source tokens, what each layer and KV head read at their steps, and the counts (misses split by
read / not read, answers paired with dense's), exactly."""
from __future__ import annotations

import numpy as np
import pytest

from tools.bench.quality_reads import (Answer, ReadLog, answers, diagnose, guess_chance, recall_guesses,
                                       sign_test, tail_fact_share, values_read)
from tools.quality.evaluate import DocScore
from tools.quality.tasks import BOS, NEEDLE_Q, RECALL_Q, Document, answer_sources, value_positions

PASSKEY = (193, 201, 210, 219)  # one token of each passkey range


def _doc() -> Document:
    """80 tokens: the passkey at 20-23, pairs ``v k`` (230, 130) at 2-3 and (240, 140) at 31-32;
    the needle asked at 56 (answers at 57-60), the pairs' keys at 62 (140) and 65 (130)."""
    t = np.full(80, 20, np.int64)
    t[0] = BOS
    t[20:24] = PASSKEY
    t[2:4] = (230, 130)
    t[31:33] = (240, 140)
    t[56], t[57:61] = NEEDLE_Q, PASSKEY
    t[61:64] = (RECALL_Q, 140, 240)
    t[64:67] = (RECALL_Q, 130, 230)
    return Document(t, needle_at=(56, 57, 58, 59), recall_at=(62, 65), ppl_at=tuple(range(50, 56)), prompt_len=50)


def test_answer_sources_are_the_passkey_tokens_and_the_pairs() -> None:
    assert answer_sources(_doc()) == {56: (20,), 57: (21,), 58: (22,), 59: (23,), 62: (31, 32), 65: (2, 3)}


def test_a_doubled_answer_token_is_refused() -> None:
    doc = _doc()
    doc.tokens[40] = PASSKEY[0]
    with pytest.raises(ValueError, match="answer token 193 occurs 2 times in the body"):
        answer_sources(doc)


def _hot_log() -> ReadLog:
    """Pages of 4 tokens: the needle's page 5, the pair (31, 32) on pages 7 and 8, the pair (2, 3)
    in the sink page 0 (always read)."""
    log = ReadLog(answer_sources(_doc()), layers=2, block_tokens=4, values=value_positions(_doc()),
                  tail=_doc().ppl_at)
    steps = {55: ([[0, 3], [5, 7]], [[1, 2], [9, 8]]),  # a tail step: 4 of the 8 pages chosen hold a fact
             56: ([[4, 9], [1, 2]], [[5, 1], [1, 2]]),  # neither head of layer 0 reads the passkey page
             62: ([[7, 8], [1, 2]], [[7, 9], [9, 8]]),  # layer 1's heads read page 7 or 8, not both
             65: ([[3], [4]], [[3], [4]])}  # the sink holds the pair
    for p in range(55, 66):
        log.before(p)
        for layer, pages in enumerate(steps.get(p, ([[5], [5]], [[5], [5]]))):
            log.record(layer, np.array([pages]))
    return log


def test_the_log_says_per_layer_whether_some_kv_head_read_the_sources() -> None:
    log = _hot_log()
    assert log.per_layer((56, 57, 58, 59)) == (False, True)
    assert log.per_layer((57, 58, 59)) == (True, True)
    assert [log.read[62][layer].tolist() for layer in (0, 1)] == [[True, False], [False, False]]
    assert log.per_layer((62,)) == (True, False)
    assert log.per_layer((65,)) == (True, True)


def test_the_share_of_the_documents_values_read_at_recall() -> None:
    """Values 230 (page 0, the sink) and 240 (page 7): at 62 layer 0's head 0 and layer 1's head 0
    read page 7 (3 of the 4 heads' value pages: 1 / 0.5 + 1 / 0.5); at 65 none: half of them."""
    assert value_positions(_doc()) == {62: (2, 31), 65: (2, 31)}
    assert values_read([_hot_log()], 2) == [0.625, 0.625]
    assert values_read([], 2) is None


def test_the_share_of_fact_pages_among_those_chosen_on_the_perplexity_tail() -> None:
    """The facts' pages are 0, 5, 7, 8; at the tail step 55 the heads chose (0, 3), (5, 7), (1, 2),
    (9, 8)."""
    log = _hot_log()
    assert log.facts.tolist() == [0, 5, 7, 8] and log.tail_fact == [(1, 2), (2, 2), (0, 2), (1, 2)]
    assert tail_fact_share([log]) == (0.5, 2.0) and tail_fact_share([]) is None


def test_counts_on_the_hand_made_document() -> None:
    doc = _doc()
    mine = DocScore(False, 1, 2, 0.0, 6, (), (False, True))
    dense = DocScore(True, 1, 2, 0.0, 6, (), (True, False))
    found = answers(doc, mine, dense, _hot_log())
    assert found == [Answer("needle", False, True, (False, True)), Answer("recall", False, True, (True, False)),
                     Answer("recall", True, False, (True, True))]
    assert diagnose(found) == {
        "needle_lost": 1, "needle_gained": 0, "needle_page_read": 0.0, "needle_miss_unread": 1,
        "needle_miss_read": 0, "needle_lost_unread": 1,
        "recall_lost": 1, "recall_gained": 1, "recall_page_read": 0.5, "recall_miss_unread": 1,
        "recall_miss_read": 0, "recall_lost_unread": 1,
        "answer_page_read": pytest.approx(1 / 3), "answer_page_read_by_layer": [pytest.approx(2 / 3)] * 2}


def test_a_miss_read_is_told_from_one_not_read_and_dense_pairs_without_reads() -> None:
    found = [Answer("recall", False, True, (True, True)), Answer("recall", False, False, (True, True)),
             Answer("recall", False, False, (False, True)), Answer("recall", True, True, (True, True)),
             Answer("needle", True, True, (True, True))]
    got = diagnose(found)
    assert (got["recall_miss_read"], got["recall_miss_unread"], got["recall_lost"], got["recall_lost_unread"],
            got["recall_page_read"], got["needle_page_read"]) == (2, 1, 1, 0, 0.75, 1.0)
    unlogged = diagnose([Answer("needle", True, False, None), Answer("recall", False, True, None)])
    assert (unlogged["needle_gained"], unlogged["recall_lost"], unlogged["answer_page_read"],
            unlogged["recall_miss_read"]) == (1, 1, None, None)


def test_h2o_reads_are_token_positions_and_a_source_in_the_window_is_refused() -> None:
    log = ReadLog(answer_sources(_doc()), layers=1, block_tokens=None)
    log.before(62)
    log.record(0, np.array([[[31, 32, 61], [31, 60, 61]]]))  # head 1 evicted token 32
    assert log.read[62][0].tolist() == [True, False]
    near = ReadLog({62: (55,)}, layers=1, block_tokens=4)  # page 13 of the 15 complete at 62: the window
    near.before(62)
    with pytest.raises(ValueError, match=r"may lie in the recent window at position 62"):
        near.record(0, np.array([[[13]]]))


def test_recall_answers_are_told_apart_from_guesses() -> None:
    """The queries ask 140 (answer 240) then 130 (answer 230); the body's values are 230 and 240."""
    doc = _doc()

    def with_recall(first: int, second: int) -> DocScore:
        return DocScore(True, 0, 2, 0.0, 6, (20,) * 6 + PASSKEY + (first, second), (False, False))

    assert recall_guesses(doc, with_recall(230, 240)) == ["unasked", "answered"]
    assert recall_guesses(doc, with_recall(250, 20)) == ["foreign", "other"]
    assert recall_guesses(doc, with_recall(240, 230)) == ["right", "right"]
    assert guess_chance(2) == 0.75 and guess_chance(8) == pytest.approx(761 / 280 / 8)


def test_sign_test_is_mcnemars_exact_p() -> None:
    """7 lost against 3 gained: 2 * (1 + 10 + 45 + 120) / 1024; an even split, or none, is 1."""
    assert sign_test(7, 3) == sign_test(3, 7) == pytest.approx(352 / 1024)
    assert sign_test(5, 5) == sign_test(0, 0) == 1.0 and sign_test(16, 0) == pytest.approx(2 / 2 ** 16)
