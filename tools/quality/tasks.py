"""The quality yardstick's documents: filler with far facts buried in it, asked at the end.

Token ids over a small vocabulary (no tokenizer): the ranges below. One document of ``context``
tokens, all drawn from one seed:

    BOS  body (filler, with the needle and the recall pairs inserted between phrases)
         ... the last PPL_TOKENS of the body: filler only (the perplexity is measured there)
    NEEDLE_Q p1 p2 p3 p4                    the passkey asked; its 4 tokens answer
    RECALL_Q k v  (x RECALL_PAIRS)          each recall pair's key asked; its value answers

* **filler**: phrases of PHRASE_LEN tokens drawn from a per-document book of PHRASES phrases
  (first tokens distinct), so after a phrase's first token the rest is predictable from an
  earlier occurrence; inside a phrase most tokens follow a fixed grammar from the token two
  back (``SKIP_MAP``): perplexity rewards reading the recent tokens right.
* **needle** (passkey): ``p1 p2 p3 p4`` at a random depth (5-90 % of the body), token i from
  passkey range i (8^4 passkeys): each answer token is the one token of its range in the body.
* **recall** (multi-query associative recall): RECALL_PAIRS pairs ``v k`` (the value first, so
  the key's position carries it: a query finds the key by its own token and reads the value
  beside it) at random depths, asked in a random order as ``k`` -> ``v``.

Keys and values are distinct within a document, so each answer is determined by the context
alone. Answers are scored exactly: the needle right when all 4 tokens are, a recall query when
its value is.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PAD, BOS, NEEDLE_Q, RECALL_Q = 0, 1, 3, 4
FILLER = (16, 128)  # [lo, hi) token ranges
KEYS = (128, 192)
PASSKEY = (192, 224)  # NEEDLE_VALUE ranges of 8: token i of the passkey from the i-th
VALUES = (224, 256)
VOCAB = 256
PHRASES, PHRASE_LEN = 8, 8
NEEDLE_VALUE = 4
RECALL_PAIRS = 8
PPL_TOKENS = 64  # filler at the end of the body the perplexity is measured on
NEEDLE_DEPTH = (0.05, 0.90)
# A fixed grammar inside phrases: with probability SKIP_SHARE a token is SKIP_MAP of the token two
# back. Predicting it needs the previous token's identity at the current position, so the
# previous-token attention that copying (induction) is built on gets a gradient from the start.
SKIP_SHARE = 0.8
SKIP_MAP = np.random.default_rng(20261203).permutation(np.arange(*FILLER))


@dataclass(frozen=True)
class Document:
    """One example: its tokens and where the scored predictions are.

    ``needle_at``: the positions whose *next* token is a needle answer token (the model's
    prediction there is scored); ``recall_at`` likewise for the recall values; ``ppl_at`` for the
    perplexity tail. ``prompt_len``: the tokens before the first scored position (prefilled at once;
    every later one is fed alone, as decode steps)."""

    tokens: np.ndarray  # int64, shape (context,)
    needle_at: tuple[int, ...]
    recall_at: tuple[int, ...]
    ppl_at: tuple[int, ...]
    prompt_len: int

    def answers(self, positions: tuple[int, ...]) -> list[int]:
        """The tokens expected after ``positions``."""
        return [int(self.tokens[p + 1]) for p in positions]


def _filler(rng: np.random.Generator, n: int, phrases: int) -> list[int]:
    """``n`` filler tokens: whole phrases of a fresh book of ``phrases`` (the last one cut)."""
    firsts = rng.choice(np.arange(*FILLER), size=phrases, replace=False)
    book = rng.integers(*FILLER, size=(phrases, PHRASE_LEN))
    book[:, 0] = firsts
    follow = rng.random((phrases, PHRASE_LEN)) < SKIP_SHARE
    for j in range(2, PHRASE_LEN):  # the grammar: some tokens are the skip-map of the one two back
        book[:, j] = np.where(follow[:, j], SKIP_MAP[book[:, j - 2] - FILLER[0]], book[:, j])
    picks = rng.integers(0, phrases, size=n // PHRASE_LEN + 1)
    return book[picks].reshape(-1)[:n].tolist()


def query_tokens(pairs: int = RECALL_PAIRS) -> int:
    """Tokens of a document's queries and answers."""
    return 1 + NEEDLE_VALUE + 3 * pairs


def make_document(context: int, seed: int, *, pairs: int = RECALL_PAIRS, tail: int = PPL_TOKENS,
                  phrases: int = PHRASES) -> Document:
    """The document of ``context`` tokens drawn from ``seed`` (same arguments, same tokens);
    ``pairs`` recall pairs, a perplexity tail of ``tail`` tokens and a phrase book of ``phrases``
    (training's short documents take fewer)."""
    inserted = NEEDLE_VALUE + 2 * pairs
    body_len = context - 1 - query_tokens(pairs)
    slots = (body_len - inserted - tail) // PHRASE_LEN  # facts go between phrases, before the tail
    if pairs < 1 or tail < 1 or slots < 2 * (pairs + 1):
        raise ValueError(f"a context of {context} tokens has no room for {pairs} recall pairs (>= 1) and a "
                         f"tail of {tail} (>= 1): give a longer context or fewer pairs")
    rng = np.random.default_rng(seed)
    keys = rng.choice(np.arange(*KEYS), size=pairs, replace=False).tolist()
    values = rng.choice(np.arange(*VALUES), size=pairs, replace=False).tolist()
    span = (PASSKEY[1] - PASSKEY[0]) // NEEDLE_VALUE
    needle = (PASSKEY[0] + span * np.arange(NEEDLE_VALUE) + rng.integers(0, span, NEEDLE_VALUE)).tolist()
    facts = [[v, k] for k, v in zip(keys, values)]
    filler = _filler(rng, body_len - inserted, phrases)
    lo, hi = (int(slots * d) for d in NEEDLE_DEPTH)
    needle_slot = int(rng.integers(lo, max(lo + 1, hi)))
    pair_slots = rng.choice(np.arange(1, slots), size=pairs, replace=False).tolist()
    inserts = sorted([(needle_slot, 0, needle)] + [(s, 1 + i, p) for i, (s, p) in enumerate(zip(pair_slots, facts))],
                     key=lambda t: (t[0], t[1]))
    body: list[int] = []
    prev = 0
    for slot, _, fact in inserts:
        body += filler[prev * PHRASE_LEN:slot * PHRASE_LEN] + fact
        prev = slot
    body += filler[prev * PHRASE_LEN:]
    tokens = [BOS] + body + [NEEDLE_Q] + needle
    start = len(tokens) - NEEDLE_VALUE - 1  # predicting p1 from NEEDLE_Q
    needle_at = tuple(range(start, start + NEEDLE_VALUE))
    recall_at = []
    for i in rng.permutation(pairs).tolist():
        tokens += [RECALL_Q] + facts[i][::-1]
        recall_at.append(len(tokens) - 2)
    ppl_end = 1 + len(body)
    ppl_at = tuple(range(ppl_end - tail - 1, ppl_end - 1))
    assert len(tokens) == context
    return Document(np.asarray(tokens, dtype=np.int64), needle_at, tuple(recall_at), ppl_at,
                    prompt_len=ppl_at[0])


def value_positions(doc: Document) -> dict[int, tuple[int, ...]]:
    """Each recall query position -> the body positions of all the document's recall values."""
    body = doc.tokens[:doc.needle_at[0]]
    where = tuple(int(i) for i in np.flatnonzero((body >= VALUES[0]) & (body < VALUES[1])))
    return dict.fromkeys(doc.recall_at, where)


def answer_sources(doc: Document) -> dict[int, tuple[int, ...]]:
    """Each scored answer position -> the body positions its answer is read from: a needle
    position's passkey token; a recall query's pair ``v k`` (the value, and the key beside it,
    whose position a model that retrieves finds by the queried key). Passkey tokens and recall
    values each occur once in the body; a document where one does not is refused (``ValueError``)."""
    body = doc.tokens[:doc.needle_at[0]]  # BOS and the body: the queries start at NEEDLE_Q

    def where(token: int) -> int:
        found = np.flatnonzero(body == token)
        if found.size != 1:
            raise ValueError(f"answer token {token} occurs {found.size} times in the body, not once")
        return int(found[0])

    out: dict[int, tuple[int, ...]] = {p: (where(a),) for p, a in zip(doc.needle_at, doc.answers(doc.needle_at))}
    for p, a in zip(doc.recall_at, doc.answers(doc.recall_at)):
        v = where(a)
        if int(body[v + 1]) != int(doc.tokens[p]):
            raise ValueError(f"recall value at {v} is not followed by its key {int(doc.tokens[p])}")
        out[p] = (v, v + 1)
    return out
