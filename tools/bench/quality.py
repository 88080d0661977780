"""`cxlemu bench quality`: what each KV mode of ``CxlCache`` costs in answers, on a model that has
learned to attend (the yardstick, ``tools.quality``).

For each context, the same held-out documents (``tools.quality.tasks``: a needle and 8 recall
pairs buried in filler, asked at the end) go through every mode; the prompt is prefilled, then
every token from the perplexity tail on is a decode step through the mode's cache
(``tools.quality.evaluate``). Each mode is one ``CxlCache`` configuration (``MODES``); every
mode's argmax at every scored position is compared with ``DynamicCache``'s (``agreement``), and
``dense`` must agree exactly. A mode whose keyword this checkout's ``CxlCache`` lacks is refused
(``ModeUnavailable``), never approximated.

The goals (issue 26, item 4) against ``dense`` at the same context: ``hot`` at the page budget:
needle and recall accuracy >= 99 % of dense's, perplexity <= +1 %; ``int8``: perplexity <= +0.5 %,
accuracies >= 99 %; ``int4``: perplexity <= +3 %. ``h2o`` is measured beside them (no goal).
"""
from __future__ import annotations

import inspect
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from tools.common import CliError
from tools.quality.evaluate import DocScore, score, totals
from tools.quality.tasks import make_document

EVAL_SEED = 1 << 62  # training draws its documents' seeds below this: these are held out
ALL_RESIDENT = 1 << 30  # an HBM budget above the yardstick's KV: dense attention moves nothing


@dataclass(frozen=True)
class Mode:
    """One ``CxlCache`` configuration: the keywords it adds (``page_budget`` filled in when
    ``budgeted``), the keyword that must exist, and whether the KV must live on the device (the
    HBM budget at its minimum: a format applied on the device side changes only what crosses)."""

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    needs: str | None = None
    budgeted: bool = False
    kv_format: str = "native"
    on_device: bool = False


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("dense"),
    Mode("hot", {"attention": "hot"}, needs="attention", budgeted=True),
    Mode("h2o", {"attention": "h2o"}, needs="attention", budgeted=True),
    Mode("int8", {"kv_format": "int8"}, needs="kv_format", kv_format="int8", on_device=True),
    Mode("int4", {"kv_format": "int4"}, needs="kv_format", kv_format="int4", on_device=True),
)}

#: goals against dense: (mode, accuracy ratio floor or None, perplexity ratio ceiling)
GOALS: dict[str, tuple[float | None, float]] = {"hot": (0.99, 1.01), "int8": (0.99, 1.005), "int4": (None, 1.03)}


class ModeUnavailable(CliError):
    """A mode whose ``CxlCache`` keyword this checkout lacks."""


def check_modes(names: list[str]) -> None:
    """Every name a known mode whose keyword ``CxlCache`` takes, or ``ModeUnavailable``."""
    from driver.kv.cache import CxlCache

    params = inspect.signature(CxlCache.__init__).parameters
    for name in names:
        mode = MODES.get(name)
        if mode is None:
            raise CliError(f"unknown mode {name!r}: choose from {', '.join(MODES)}")
        if mode.needs is not None and mode.needs not in params:
            raise ModeUnavailable(f"mode {name!r} needs CxlCache({mode.needs}=...), which this checkout's "
                                  f"driver.kv lacks (issue 26 item {2 if mode.needs == 'attention' else 3})")


@dataclass(frozen=True)
class QualityRow:
    mode: str
    page_budget: float
    kv_format: str
    context: int
    examples: int
    needle_acc: float
    recall_acc: float
    perplexity: float
    agreement: float  # scored argmax equal to DynamicCache's
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cache(mode: Mode, model: Any, device: str, context: int, page_budget: float) -> Any:
    from driver.kv import KVLayout
    from driver.kv.cache import CxlCache

    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    budget = ALL_RESIDENT
    if mode.on_device:
        budget = KVLayout(batch=1, kv_heads=cfg.num_key_value_heads, head_dim=head_dim, itemsize=4,
                          block_tokens=16).min_budget(context)
    kw = dict(mode.kwargs) | ({"page_budget": page_budget} if mode.budgeted else {})
    if mode.needs == "attention":
        kw["model"] = model  # hot / h2o route the model's attention through driver.kv
    return CxlCache(budget, device=device, max_seq_len=context, prefix_sharing=False, **kw)


def _run_mode(model: Any, docs: list, cache_for: Any) -> list[DocScore]:
    out = []
    for doc in docs:
        cache = cache_for()
        try:
            out.append(score(model, doc, cache))
        finally:
            close = getattr(cache, "close", None)
            if close is not None:
                close()
    return out


def run(model: Any, *, contexts: list[int], examples: int, modes: list[str], page_budget: float,
        progress: Any = None) -> list[QualityRow]:
    """Every mode at every context over ``examples`` held-out documents (dense first)."""
    from transformers import DynamicCache

    from emulator.device import DeviceConfig, serve

    check_modes(modes)
    rows: list[QualityRow] = []
    with serve(DeviceConfig(name=f"benchq-{time.monotonic_ns() % 10**8}", capacity=1 << 30)) as dev:
        for ctx in contexts:
            docs = [make_document(ctx, EVAL_SEED + i) for i in range(examples)]
            if progress:
                progress(f"context {ctx}: DynamicCache")
            ref = _run_mode(model, docs, DynamicCache)
            for name in modes:
                if progress:
                    progress(f"context {ctx}: {name}")
                mode = MODES[name]
                t0 = time.perf_counter()
                scores = _run_mode(model, docs, lambda m=mode: _cache(m, model, dev.name, ctx, page_budget))
                tot = totals(scores)
                same = sum(a == b for s, r in zip(scores, ref) for a, b in zip(s.argmax, r.argmax))
                rows.append(QualityRow(name, page_budget if mode.budgeted else 1.0, mode.kv_format, ctx,
                                       tot.examples, tot.needle_acc, tot.recall_acc, tot.perplexity,
                                       same / sum(len(r.argmax) for r in ref), time.perf_counter() - t0))
    return rows


@dataclass(frozen=True)
class QualityGoal:
    mode: str
    context: int
    needle_ratio: float
    recall_ratio: float
    ppl_ratio: float
    met: bool


def goals(rows: list[QualityRow]) -> list[QualityGoal]:
    """Each goal mode's row against dense's at the same context (pure)."""
    dense = {r.context: r for r in rows if r.mode == "dense"}
    out = []
    for r in rows:
        if r.mode not in GOALS or r.context not in dense:
            continue
        d, (acc_floor, ppl_ceiling) = dense[r.context], GOALS[r.mode]
        needle = r.needle_acc / d.needle_acc if d.needle_acc else float(r.needle_acc >= d.needle_acc)
        recall = r.recall_acc / d.recall_acc if d.recall_acc else float(r.recall_acc >= d.recall_acc)
        ppl = r.perplexity / d.perplexity
        met = ppl <= ppl_ceiling and (acc_floor is None or (needle >= acc_floor and recall >= acc_floor))
        out.append(QualityGoal(r.mode, r.context, needle, recall, ppl, met))
    return out
