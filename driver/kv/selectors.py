"""Page selectors for hot-page attention: which KV pages a decode query reads from the device.

``CxlCache(..., attention="hot", page_budget=0.1, selector="quest")`` keeps per-page key
metadata resident and, for each decode query, asks its selector for the ``k`` pages (of the
candidates: pages neither in the attention sink nor in the recent window) to load and attend to.
The selector is a plug point like the eviction policies: a built-in name, your own class as
``"package.module:Class"``, or the class itself, checked by :func:`resolve_selector`;
``driver.kv.testing.check_selector`` checks its behaviour.

The contract (:class:`PageSelector`)::

    class MySelector:
        name = "mine"                                # a label for reports
        def select(self, query, kmin, kmax, candidates, k, hotness) -> torch.Tensor: ...

* ``query``: ``(B, Hkv, G, D)``: the decode query of every query head, grouped by the KV head
  it reads (G = query heads per KV head; rotary embedding applied, not scaled);
* ``kmin`` / ``kmax``: ``(B, Hkv, P, D)``: per-channel min / max of the keys of each complete page;
* ``candidates``: ``(C,)`` int64, ascending: the pages it may choose from;
* ``k``: how many to choose, ``0 <= k <= C``;
* ``hotness``: ``(B, Hkv, P)`` int64: the hotness unit's (CHMU) count of reads of each page;
* returns ``(B, Hkv, k)`` int64: for every (sequence, KV head) ``k`` distinct candidates,
  ascending; the same inputs give the same pages (no random draw, no wall clock).
"""
from __future__ import annotations

import inspect
from typing import Protocol

import torch

from firmware_model.hot_pages import quest_topk
from firmware_model.policies.base import PolicyProtocolError, import_spec, spec_label

__all__ = ["SELECTORS", "SELECT_SIGNATURE", "PageSelector", "QuestSelector", "SelectorProtocolError",
           "of_candidates", "quest_bound", "resolve_selector", "top_pages"]

SELECT_SIGNATURE = "select(self, query, kmin, kmax, candidates, k, hotness) -> (B, Hkv, k) int64 tensor"


class SelectorProtocolError(PolicyProtocolError):
    """A class named as a page selector does not fit :class:`PageSelector` (or returned a choice
    that breaks the contract); a ``TypeError`` and a ``ValueError``, as a policy's."""


class PageSelector(Protocol):
    """What hot-page attention calls; see the module docstring for the shapes."""

    name: str

    def select(self, query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, candidates: torch.Tensor,
               k: int, hotness: torch.Tensor) -> torch.Tensor: ...


def quest_bound(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound of ``q . k`` over the keys of each page, ``(B, Hkv, G, P)``:
    ``sum_d max(q_d * kmin_d, q_d * kmax_d)`` (every key of the page lies in the box), which is
    ``q+ . kmax + q- . kmin`` (q+ / q-: q's positive / negative channels): two matrix products."""
    return (torch.matmul(query.clamp(min=0), kmax.transpose(-1, -2))
            + torch.matmul(query.clamp(max=0), kmin.transpose(-1, -2)))


class QuestSelector:
    """Quest (ICML'24): the ``k`` pages with the highest upper bound on the attention score.

    A KV head serves G query heads and loads one set of pages for them, so a page's score is the
    largest of its group's bounds (a page any head may need is kept). Ties, exact on equal
    metadata, go to the page the hotness unit counted more reads of, then to the later page."""

    name = "quest"

    def select(self, query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, candidates: torch.Tensor,
               k: int, hotness: torch.Tensor) -> torch.Tensor:
        fast = _quest_in_c(query, kmin, kmax, candidates, k, hotness)
        if fast is not None:
            return fast
        score = quest_bound(query, kmin, kmax).amax(2)  # (B, Hkv, P)
        return top_pages(of_candidates(score, candidates), of_candidates(hotness, candidates), candidates, k)


def _quest_in_c(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, candidates: torch.Tensor, k: int,
                hotness: torch.Tensor) -> torch.Tensor | None:
    """:meth:`QuestSelector.select` in one C call (``firmware_model.hot_pages.quest_topk``: the
    same bound and order, its sums in another order, so a bound within rounding of another may
    rank the other way) for CPU float32 metadata and a run of candidates; None otherwise."""
    c0 = _run_start(candidates)
    if c0 is None or query.device.type != "cpu" or kmin.device.type != "cpu" or hotness.device.type != "cpu":
        return None
    b, h, g, d = query.shape
    try:
        rows = [t.view(b * h, *t.shape[2:]).numpy() for t in (kmin, kmax, hotness)]
    except RuntimeError:  # rows not one stride apart, or a tensor numpy cannot view
        return None
    got = quest_topk(query.contiguous().view(b * h, g, d).numpy(), *rows, c0, c0 + candidates.numel(), k)
    return None if got is None else torch.from_numpy(got).view(b, h, k)


def _run_start(candidates: torch.Tensor) -> int | None:
    """The first page when ``candidates`` are a run of pages (the engine's always are: the pages
    between the sink and the window), else None."""
    n = candidates.numel()
    if n and int(candidates[-1]) - int(candidates[0]) + 1 == n:
        return int(candidates[0])
    return None


def of_candidates(t: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """``t``'s last axis at ``candidates``: a view when they are a run of pages, else a gather."""
    start = _run_start(candidates)
    return t.index_select(-1, candidates) if start is None else t.narrow(-1, start, candidates.numel())


def top_pages(score: torch.Tensor, hot: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` of ``candidates`` ``(C,)`` with the highest ``score`` ``(B, Hkv, C)``, ties to the
    higher ``hot`` count, then to the later page; ``(B, Hkv, k)`` ascending. One top-k when no
    tie crosses the k-th place (scores of real keys rarely tie); else every page scoring above
    the k-th score is in, and the pages tied at it are ranked by (count, page) in one int64 key."""
    c = score.shape[-1]
    if k == 0:
        return candidates.new_empty((*score.shape[:-1], 0))
    if k == c:
        return candidates.expand(*score.shape[:-1], c)
    vals, idx = torch.topk(score, k + 1, dim=-1)
    if bool((vals[..., k - 1] > vals[..., k]).all()):
        return torch.sort(candidates[idx[..., :k]], dim=-1)[0]
    kth = vals[..., k - 1:k]
    tie_key = hot * c + torch.arange(c)  # hotter, then later
    key = torch.where(score > kth, torch.iinfo(torch.int64).max, torch.where(score == kth, tie_key, -1))
    return torch.sort(candidates[torch.topk(key, k, dim=-1, sorted=False).indices], dim=-1)[0]


SELECTORS: dict[str, type] = {"quest": QuestSelector}
"""The built-in selectors by name."""


def _problems(cls: type) -> list[str]:
    problems = []
    select = getattr(cls, "select", None)
    if select is None or not callable(select):
        problems.append(f"no method select (expected {SELECT_SIGNATURE})")
    else:
        try:
            sig = inspect.signature(select)
        except (TypeError, ValueError):
            sig = None
        if sig is not None:
            try:
                sig.bind(None, None, None, None, None, 0, None)
            except TypeError:
                problems.append(f"select{sig} cannot be called as select(self, query, kmin, kmax, candidates, "
                                f"k, hotness) (expected {SELECT_SIGNATURE})")
    if not isinstance(getattr(cls, "name", ""), str):
        problems.append(f"its name is {getattr(cls, 'name')!r}, not a str (expected name = \"a label for reports\")")
    return problems


def resolve_selector(spec: str | type) -> PageSelector:
    """A selector built from ``spec``: a built-in name (:data:`SELECTORS`), ``"package.module:Class"``
    or the class; its constructor takes no argument. ``ValueError`` for an unknown name or a module
    that does not import; :class:`SelectorProtocolError` for a class that lacks the contract,
    naming every missing piece."""
    if isinstance(spec, str) and ":" not in spec:
        if spec not in SELECTORS:
            raise ValueError(f"unknown page selector {spec!r}: choose from {', '.join(SELECTORS)}, or "
                             "your own class as 'package.module:Class'")
        return SELECTORS[spec]()
    cls = import_spec(spec, "page selector", "'package.module:Class'") if isinstance(spec, str) else spec
    label = spec_label(spec)
    if not isinstance(cls, type):
        raise SelectorProtocolError(f"page selector {label} is {cls!r}, not a class (expected a class with "
                                    f"name: str and {SELECT_SIGNATURE})")
    problems = _problems(cls)
    if problems:
        raise SelectorProtocolError(f"page selector {label} does not fit the PageSelector protocol "
                                    f"(driver.kv.selectors): {'; '.join(problems)}")
    try:
        selector = cls()
    except TypeError as exc:
        raise SelectorProtocolError(f"page selector {label} cannot be built without arguments: {exc}") from None
    if not isinstance(getattr(selector, "name", None), str):
        raise SelectorProtocolError(f"page selector {label} has no str attribute name (expected name = "
                                    "\"a label for reports\")")
    return selector
