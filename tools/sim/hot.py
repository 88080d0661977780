"""Hot-page attention at serving scale: what a running request keeps in HBM, what crosses the link.

With ``attention="hot"`` (the KV shim's ``CxlCache(attention="hot")``, issue 26) a request's KV
lives in the CXL device once its prompt is computed. Per decode step and layer it attends to
the pages a selector chooses (Quest: an upper bound on each page's score from the per-channel
key min / max of the page), within a budget of ``page_budget`` of its pages; the shim predicts
layer l + 1's pages during layer l and reads them ahead (InfiniGen's speculation). A ``predicted``
share p of the chosen pages was predicted and arrives while layer l computes; the other 1 - p is read
on demand at layer l + 1's start, once its query is known, and its attention waits for it (the
link's latency and bytes, :class:`HotTier`); the prefetch also read as many predicted pages that were
not chosen, so the link carries (2 - p) x the chosen pages' bytes a step. p = 1 is exact prediction.
The engine (:mod:`tools.sim.engine`) takes from here, per request:

* **HBM held** (:meth:`HotAttention.resident_bytes`): the shim's working set
  (``driver.kv._hot.HotEngine._check_budget``) -- every layer's page metadata (key min and max
  per channel: 2 x kv_heads x head_dim x dtype bytes a page and layer) and its resident pages
  (``sink_pages`` + ``window_pages`` + the partial page + one being completed), plus the chosen
  pages of two layers (the one computing and the one arriving);
* **pages read** a layer and step (:meth:`HotAttention.pages_read`): as the shim's ``_choose``, what
  the budget leaves beyond the resident pages, in ``kv_format``'s encoded size on the link;
* **tokens attended** (:meth:`HotAttention.attended`): the resident and chosen tokens, plus one
  token's worth a candidate page for scoring its metadata (the same bytes and about the same
  FLOPs as one key and value): what the step's roofline reads from HBM and multiplies.

A prompt is prefilled densely (all of its KV in HBM, as the engine has it: attention over the
whole prompt); every complete page is written to the device as it fills. When the request goes
hot -- at its first decode step (``when="always"``), or only when the KV space is full and the
engine needs its blocks for another request (``when="full"``, instead of a preemption or a wait)
-- it shrinks to its hot working set. Prefill reads nothing from the device.

Bytes of a ``kv_format`` page (:func:`piece_bytes`): the controller's codec's
(``firmware_model.kv_codec.PieceCodec.encoded_bytes``): ``int8`` one fp16 scale a token and an
int8 code an element; ``int4`` a 4-byte header, an fp16 scale and zero per group (per channel or
per 32 channels of a token, whichever gives more: one size for every piece) and two codes a byte.
"""
from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import simpy

from firmware_model.dma import DmaScheduler
from firmware_model.hot_pages import SINK_PAGES, WINDOW_PAGES
from firmware_model.kv_codec import FORMATS, PieceCodec
from firmware_model.link import LinkParams
from tools.sim.layerwise import layerwise

__all__ = ["ATTENTIONS", "HOT_PREDICTED", "HOT_WHEN", "KV_FORMATS", "SINK_PAGES", "WINDOW_PAGES", "HotAttention",
           "HotConfig", "HotTier", "check_predicted", "piece_bytes", "quality_rows"]

ATTENTIONS = ("dense", "hot")
HOT_WHEN = ("always", "full")
KV_FORMATS = FORMATS

HOT_PREDICTED = 0.61
"""The share of a step's chosen pages that the KV shim had predicted and read a layer ahead: 0.61,
measured by ``cxlemu bench kv --attention hot --page-budget 0.1 --context 8192`` (its ``predicted``
column, BENCHMARKS.md "Hot-page attention") on the bench's random 16-layer Llama (0.61-0.62 from
4k to 32k); on the trained yardstick ``cxlemu bench quality`` measures 0.73 / 0.62 / 0.57 at 2k /
4k / 8k. The default of ``sim serve --hot-predicted``."""


def check_predicted(predicted: float) -> float:
    """``predicted`` if it is a share in (0, 1]; else ValueError."""
    if isinstance(predicted, bool) or not isinstance(predicted, (int, float)) or not 0 < predicted <= 1:
        raise ValueError(f"the predicted share of the chosen pages must be in (0, 1], got {predicted!r}")
    return float(predicted)


def piece_bytes(kv_format: str, tokens: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of one piece -- ``tokens`` x ``head_dim`` of one KV head's K or V -- in ``kv_format``:
    the controller's codec's (``firmware_model.kv_codec.PieceCodec.encoded_bytes``)."""
    elem = {2: "f16", 4: "f32"}.get(dtype_bytes)
    if elem is None:
        raise ValueError(f"the KV codec takes 2- or 4-byte elements, got {dtype_bytes}")
    try:
        return PieceCodec(kv_format, tokens, head_dim, elem).encoded_bytes
    except ValueError as exc:
        raise ValueError(f"kv_format {kv_format!r}: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class HotAttention:
    """Hot-page attention for one model shape (``layers``, ``kv_heads``, ``head_dim``, dtype)."""

    page_budget: float
    kv_format: str = "native"
    block_tokens: int = 16  # a page is a KV block
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    sink_pages: int = SINK_PAGES
    window_pages: int = WINDOW_PAGES

    def __post_init__(self) -> None:
        if not 0 < self.page_budget <= 1:
            raise ValueError(f"page_budget must be in (0, 1], got {self.page_budget}")
        piece_bytes(self.kv_format, self.block_tokens, self.head_dim, self.dtype_bytes)  # a bad format: refused
        for k in ("block_tokens", "layers", "kv_heads", "head_dim", "dtype_bytes"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k} must be >= 1, got {getattr(self, k)}")
        if self.sink_pages < 0 or self.window_pages < 0:
            raise ValueError("sink_pages and window_pages must be >= 0")

    @classmethod
    def for_shape(cls, shape: Any, **kw: Any) -> HotAttention:
        """For a ``tools.sim.hardware.ModelShape``."""
        return cls(layers=shape.layers, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                   dtype_bytes=shape.dtype_bytes, **kw)

    # --- sizes ---------------------------------------------------------------------------------
    def frame_bytes(self, tokens: int) -> int:
        """K and V of ``tokens`` tokens of one layer, in HBM (the model's dtype)."""
        return 2 * self.kv_heads * tokens * self.head_dim * self.dtype_bytes

    @property
    def page_bytes(self) -> int:
        """One page of one layer on the device and the link: K and V of every KV head, encoded."""
        return 2 * self.kv_heads * piece_bytes(self.kv_format, self.block_tokens, self.head_dim, self.dtype_bytes)

    @property
    def native_page_bytes(self) -> int:
        return self.frame_bytes(self.block_tokens)

    def pages(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    # --- per request -------------------------------------------------------------------------
    def candidates(self, tokens: int) -> int:
        """Pages on the device only (neither sink nor window) of a ``tokens``-token sequence."""
        tail_start = max(0, tokens // self.block_tokens - self.window_pages)
        return tail_start - min(self.sink_pages, tail_start)

    def pages_read(self, tokens: int) -> int:
        """Pages one layer reads from the device at a decode step over ``tokens`` tokens (the new one
        included): the budget's share of the pages, less the resident ones."""
        total, cand = self.pages(tokens), self.candidates(tokens)
        return min(cand, max(0, math.ceil(self.page_budget * total) - (total - cand)))

    def attended(self, tokens: int) -> int:
        """Tokens' worth of KV one decode step reads from HBM: the resident tokens, the chosen
        pages' and, when it chooses, a token's worth of metadata a candidate page."""
        cand, k = self.candidates(tokens), self.pages_read(tokens)
        return tokens - (cand - k) * self.block_tokens + (cand if k < cand else 0)

    def resident_bytes(self, tokens: int) -> int:
        """HBM a decoding request over ``tokens`` tokens holds: every layer's metadata and
        resident pages, the chosen pages of two layers (the shim's ``_check_budget``)."""
        pages = self.pages(tokens)
        meta = 2 * self.kv_heads * pages * self.head_dim * self.dtype_bytes
        kept = (self.sink_pages + self.window_pages + 2) * self.block_tokens
        chosen = max(kept, math.ceil(self.page_budget * pages) * self.block_tokens)
        return self.layers * (meta + self.frame_bytes(kept)) + 2 * self.frame_bytes(chosen)

    def resident_blocks(self, tokens: int) -> int:
        """:meth:`resident_bytes` in the KV space's blocks (``block_tokens`` tokens of every layer)."""
        block = self.layers * self.frame_bytes(self.block_tokens)
        return -(-self.resident_bytes(tokens) // block)

    def decode(self, tokens: int) -> tuple[int, int, int]:
        """A request decoding over ``tokens`` tokens: (KV-space blocks it holds, tokens' worth of
        KV it reads from HBM, link bytes it reads). A sequence whose whole KV takes no more blocks
        than its working set keeps it all in HBM and decodes densely, reading nothing."""
        pages, blocks = self.pages(tokens), self.resident_blocks(tokens)
        if blocks >= pages:
            return pages, tokens, 0
        return blocks, self.attended(tokens), self.read_bytes(tokens)

    def read_bytes(self, tokens: int) -> int:
        """Link bytes a decode step reads for one request over ``tokens`` tokens: every layer's pages."""
        return self.layers * self.pages_read(tokens) * self.page_bytes

    def write_bytes(self, pages: int) -> int:
        """Link bytes of writing ``pages`` complete pages of every layer to the device."""
        return self.layers * pages * self.page_bytes

    def describe(self) -> dict[str, Any]:
        return {"page_budget": self.page_budget, "kv_format": self.kv_format, "sink_pages": self.sink_pages,
                "window_pages": self.window_pages, "page_bytes": self.page_bytes,
                "native_page_bytes": self.native_page_bytes}


# --- the quality figures of `cxlemu bench quality` beside a configuration -----------------------
def quality_rows(rows: list[dict[str, Any]] | None, attention: str, page_budget: float,
                 kv_format: str) -> dict[str, Any]:
    """What ``cxlemu bench quality --json`` measured for this configuration: its exact rows
    (mode ``hot`` at ``page_budget`` with ``kv_format``; dense attention: mode ``dense`` or the
    format's own mode), and separately the rows measured for its parts (the budget in the native
    format, the format under dense attention), each labelled; nothing is combined or estimated."""
    out: dict[str, Any] = {"measured": [], "parts": []}
    if not rows:
        return out

    def match(r: dict[str, Any], mode: str, budget: float | None, fmt: str) -> bool:
        same_budget = budget is None or math.isclose(float(r.get("page_budget") or 0), budget)
        return r.get("mode") == mode and same_budget and (r.get("kv_format") or "native") == fmt

    if attention == "hot":
        out["measured"] = [r for r in rows if match(r, "hot", page_budget, kv_format)]
        if kv_format != "native":
            out["parts"] = [r for r in rows if match(r, "hot", page_budget, "native")
                            or match(r, kv_format, None, kv_format)]
    else:
        mode = "dense" if kv_format == "native" else kv_format
        out["measured"] = [r for r in rows if match(r, mode, None, kv_format)]
    return out


# --- the device side of a run ------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class HotConfig:
    """Hot-page attention in an engine: the model's arithmetic, the device's link and its size."""

    attention: HotAttention
    link: LinkParams
    capacity_bytes: int  # the CXL pool that holds every request's KV
    #: "always": every request attends hot once its prompt is computed; "full": a request decodes
    #: densely until the KV space is full, then the last running ones go hot one by one to make
    #: room (every request's complete pages are written to the device as they fill, either way)
    when: str = "always"
    #: the share of the chosen pages predicted a layer ahead; the rest are read on demand
    predicted: float = HOT_PREDICTED

    def __post_init__(self) -> None:
        check_predicted(self.predicted)
        if self.when not in HOT_WHEN:
            raise ValueError(f"when must be one of {', '.join(HOT_WHEN)}, got {self.when!r}")
        if self.capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {self.capacity_bytes}")


class HotTier:
    """The device's link under hot-page attention: each decode step's page reads, layer by layer
    with the next layer's predicted pages prefetched while one computes (:func:`layerwise`, window
    1: layer l + 1's pages are predicted during layer l, not earlier), the chosen pages that were
    not predicted read on demand at their layer's start, and the writes of completed pages (the
    other direction of the link, never waited for by a step). Per layer of a step whose chosen
    pages take ``b`` bytes a layer, with p = ``cfg.predicted``::

        prefetch (issued as the layer before starts computing)   b  : p x b chosen, (1 - p) x b not
        on demand (at the layer's start, after the prefetch)     (1 - p) x b, rounded to a byte
        compute                                                  once both landed
    """

    def __init__(self, env: simpy.Environment, cfg: HotConfig) -> None:
        self.env, self.cfg, self.attention = env, cfg, cfg.attention
        self.dma = DmaScheduler(env, cfg.link, channels=64, queue_depth=1 << 30)
        self.bytes_read = self.bytes_chosen = self.bytes_written = self.read_steps = self.max_step_read = 0
        self.stall_ns = self.demand_ns = 0.0
        self.late = self.demoted = 0

    def write(self, pages: int) -> simpy.Event:
        """Write ``pages`` complete pages (every layer's) to the device; fires when they landed."""
        nbytes = self.attention.write_bytes(pages)
        self.bytes_written += nbytes
        return self.dma.submit("write", nbytes).done

    def step(self, nbytes: int, compute_ns: float) -> Generator[simpy.Event, Any, None]:
        """A forward of ``compute_ns`` whose chosen pages take ``nbytes``, ``layers`` equal shares."""
        layers = self.attention.layers
        per_layer = max(1, nbytes // layers)
        demand = round((1 - self.cfg.predicted) * per_layer)  # 0 when every chosen page was predicted
        read = nbytes + layers * demand
        self.read_steps += 1
        self.bytes_chosen += nbytes
        self.bytes_read += read
        self.max_step_read = max(self.max_step_read, read)
        start = self.env.now
        done = yield from layerwise(self.env, self.dma, self.read_steps, per_layer, compute_ns, layers, 1, demand)
        self.late += done.late
        self.demand_ns += done.demand_ns
        self.stall_ns += self.env.now - start - compute_ns

    def counters(self) -> dict[str, Any]:
        steps = self.read_steps or 1
        return {"link_bytes_read": self.bytes_read,
                "link_bytes_written": self.bytes_written, "link_read_steps": self.read_steps,
                "link_max_step_read": self.max_step_read, "link_read_bytes_per_step": self.bytes_read / steps,
                "link_chosen_bytes_per_step": self.bytes_chosen / steps, "stall_s": self.stall_ns / 1e9,
                "demand_stall_s": self.demand_ns / 1e9, "demand_stall_ms_per_step": self.demand_ns / 1e6 / steps,
                "prefetch_late": self.late, "hot_demotions": self.demoted}
