"""`CxlCache`: a transformers ``Cache`` whose KV lives on a cxlemu device.

    model.generate(input_ids, attention_mask=mask, max_new_tokens=32,
                   past_key_values=CxlCache(hbm_budget_bytes=64 << 20, policy="hotness"))
    # transformers >= 5.24 also: model.generate(..., cache=cache)

Each attention layer calls ``update(k, v, layer_idx, ...)``; the call goes to the residency
engine (``_engine.py``), which returns zero-copy views of the layer's frame on the accelerator
after making it resident. All transformers versions from 4.57 on are served by the same
``update(key_states, value_states, layer_idx, *args, **kwargs)`` signature (4.57 passes
``cache_kwargs`` positionally, 5.12+ by keyword, 5.24 as ``kwargs=``; none of it is needed: the
cache position is the layer's current length). The layer class also speaks 4.57's names
(``get_max_cache_shape``, ``get_mask_sizes(cache_position)``, one-argument
``lazy_initialization``).
"""
from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any, cast

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from driver.kv import _attention
from driver.kv._codec_store import check_kv_format, compressed, link_stats
from driver.kv._engine import ResidencyEngine
from driver.kv._recompute import ForwardRecorder
from driver.kv._store import BlockStore
from emulator.spec.errors import ConfigError
from firmware_model.clock import Clock

__all__ = ["CxlCache"]

DEFAULT_DEVICE_CAPACITY = 256 << 20  # a private device; its chunk pool is built up front
_serial = itertools.count()


class _CxlLayer(CacheLayerMixin):
    """One model layer's view of the shared engine."""

    is_sliding = False

    def __init__(self, owner: CxlCache, index: int) -> None:
        super().__init__()
        self._owner = owner
        self._index = index

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        # 4.57 passes key_states only; 5.x both
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self._owner._engine_for(key_states).update(self._index, key_states, value_states)

    def get_seq_length(self) -> int:
        engine = self._owner._engine
        return engine.seq_length(self._index) if engine is not None else 0

    def get_mask_sizes(self, query: int | torch.Tensor) -> tuple[int, int]:
        """(kv_length, kv_offset); 5.x passes the query length, 4.57 the cache positions."""
        query_length = query.shape[0] if isinstance(query, torch.Tensor) else int(query)
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        """No maximum: the device holds what the budget does not (5.x name)."""
        return -1

    def get_max_cache_shape(self) -> int:
        """4.57's name of :meth:`get_max_length`."""
        return -1

    def offload(self) -> None:
        """Residency is the engine's decision; transformers' layer offload does not apply."""

    def prefetch(self) -> None:
        """See :meth:`offload`."""

    def reset(self) -> None:
        raise NotImplementedError("CxlCache cannot be reset in place: close() it and make a new one")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("CxlCache does not support beam search (reorder_cache); use greedy "
                                  "or sampling, or a DynamicCache for beams")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("CxlCache does not support crop (assisted decoding)")


class CxlCache(Cache):
    """KV cache on a cxlemu device with an HBM budget; see the module docstring.

    * ``hbm_budget_bytes``: KV bytes allowed on the accelerator, working buffers included; at
      least two layers of the batch's KV (else ``BudgetTooSmall`` names the minimum). Any larger
      int works: a budget beyond all the KV keeps every layer resident (one frame per layer is
      the most ever made) and moves nothing through the device (outgrown frames grow in place).
      The KV shape (batch, kv heads, head dim, dtype) first reaches the cache
      with the first forward, so ``BudgetTooSmall`` comes at the prefill's first layer, before any
      token is produced: for ``max_seq_len`` tokens if given, else for the prompt; without
      ``max_seq_len`` a budget the growing sequences outgrow is found only then, mid-generation.
    * ``policy``: the firmware model's eviction policy: a name (``firmware_model.policies``), your
      own class as ``"package.module:Class"`` or the class itself (``resolve_policy`` checks it).
    * ``block_tokens``: tokens per device chunk (prefix-sharing and transfer granularity).
    * ``device``: None serves a private in-process device (stopped by :meth:`close`); a name
      opens and claims that served device here, at construction (``DeviceNotFound``, or
      ``DeviceInUse`` when another process's cache holds it); caches of one process on one device
      share its chunk pool.
    * ``prefetch_depth``: layers loaded ahead; ``"auto"`` sizes it from the link and the
      measured compute per layer (``firmware_model.prefetch.window_points``); a window function
      of your own, ``"package.module:function"`` or the callable, sizes it from the same
      arguments, ``f(link, layer_bytes, compute_ns_per_layer, layers) -> int >= 0``
      (``firmware_model.prefetch.resolve_window`` checks it).
    * ``model``: records the forward calls so chunks lost to a fault are recomputed from the
      tokens; without it such a loss raises ``KVLoadError``.
    * ``max_seq_len``: the final length, if known: frames are sized once (no regrowth), and a
      budget too small for it is refused at the prefill, before any token is produced.
    * ``max_retries``: retries of a failed load before its chunks are recomputed (int >= 0).
    * ``store``: any ``BlockStore`` instead of a device (tests).
    * ``clock``: what the engine measures compute on (default the wall clock; tests pass a
      simulated one, so the ``"auto"`` prefetch window is deterministic).
    * ``kv_format``: how KV is kept on the device: ``"native"`` (its own bytes, tokens exactly
      as ``DynamicCache``), ``"int8"`` or ``"int4"`` (quantized by the device side on write,
      decoded on load, the link moving the encoded bytes: ``firmware_model.kv_codec``); stats
      then report ``link_bytes_loaded`` / ``link_bytes_offloaded`` and ``device_bytes_used``.
    * ``attention``: ``"dense"`` (every token, as above), ``"hot"`` (hot-page attention: the KV
      lives on the device and each decode query reads only the pages its ``selector`` chooses
      within ``page_budget``, a fraction of the sequence's pages; ``driver.kv._hot``) or
      ``"h2o"`` (H2O heavy-hitter eviction keeping ``page_budget`` of the tokens, which drops
      the rest: for comparison; ``driver.kv._h2o``). Both need ``model=``, whose attention they
      route through ``driver.kv``'s attention function until :meth:`close`.
      ``page_budget=1.0`` with ``"hot"`` reads every page: the tokens of dense attention.
    * ``selector``: hot attention's page selector: ``"quest"`` (``driver.kv.selectors``), your
      own class as ``"package.module:Class"`` or the class (``resolve_selector`` checks it).
    * ``record``: what each attention over the cache read, for diagnostics (``cxlemu bench
      quality``): ``record(layer, read)`` with a numpy int64 ``(B, Hkv, n)``; ``"hot"``: at every
      attention past the prefill, the pages chosen beyond the resident sink and window;
      ``"h2o"``: at every attention, the positions of the tokens it reads (those kept).
    """

    def __init__(self, hbm_budget_bytes: int, policy: str | type = "reuse", block_tokens: int = 16,
                 device: str | None = None, *, prefetch_depth: int | str | Callable[..., int] = "auto", model: torch.nn.Module | None = None,
                 store: BlockStore | None = None, max_seq_len: int | None = None,
                 prefix_sharing: bool = True, max_retries: int = 2,
                 device_capacity: int = DEFAULT_DEVICE_CAPACITY, full_writeback: bool = False,
                 clock: Clock | None = None, kv_format: str = "native", attention: str = "dense",
                 page_budget: float = 1.0, selector: str | type = "quest",
                 record: Callable[[int, Any], None] | None = None) -> None:
        super().__init__(layers=[])
        check_kv_format(kv_format, prefix_sharing)
        _check_attention(attention, page_budget, selector, model)
        if record is not None and (attention == "dense" or not callable(record)):
            raise ConfigError(f"record applies to attention='hot' or 'h2o' and is a callable record(layer, read), "
                              f"got {record!r} with attention={attention!r}")
        self._kv_format = kv_format
        if isinstance(hbm_budget_bytes, bool) or not isinstance(hbm_budget_bytes, int) or hbm_budget_bytes <= 0:
            raise ConfigError(f"hbm_budget_bytes must be a positive int, got {hbm_budget_bytes!r}")
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
            raise ConfigError(f"block_tokens must be an int >= 1, got {block_tokens!r}")
        if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int)
                                        or max_seq_len < 1):
            raise ConfigError(f"max_seq_len must be None or an int >= 1 (the final length), got {max_seq_len!r}")
        if device is not None and store is not None:
            raise ConfigError("give device= or store=, not both")
        if (isinstance(prefetch_depth, str) and ":" in prefetch_depth) or (
                callable(prefetch_depth) and not isinstance(prefetch_depth, type)):
            from firmware_model.prefetch import resolve_window

            resolve_window(prefetch_depth)  # a module that does not import, or a wrong signature, fails here
        elif prefetch_depth != "auto" and (isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int)
                                           or prefetch_depth < 0):
            raise ConfigError(f"prefetch_depth must be an int >= 0, 'auto', or a window function "
                              f"('package.module:function' or a callable f(link, bytes_per_point, "
                              f"compute_ns_per_point, max_window) -> int), got {prefetch_depth!r}")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ConfigError(f"max_retries must be an int >= 0 (retries of a failed load before its "
                              f"chunks are recomputed; 0 = none), got {max_retries!r}")
        from firmware_model.policies import make_policy
        # unknown names, and a module:Class that does not import or fit the protocol, fail here
        make_policy(policy, 1)
        self._kw: dict[str, Any] = dict(budget=hbm_budget_bytes, policy=policy, block_tokens=block_tokens,
                        prefetch_depth=prefetch_depth, prefix_sharing=prefix_sharing,
                        max_retries=max_retries, max_seq_len=max_seq_len, full_writeback=full_writeback,
                        clock=clock)
        self._attention = (attention, page_budget, selector)
        self._record = record
        self._closed = True  # until constructed: __del__ has nothing to release
        self._backing = _Backing(device, store, device_capacity)
        if device is not None:
            # a missing or unusable device, or one another process's cache holds (DeviceInUse),
            # fails here, not in generate(); the claim is held until close()
            from emulator.device import load_config

            load_config(device)
            self._backing.store()
        try:
            self._recorder = ForwardRecorder(model, self) if model is not None and attention == "dense" else None
            self._routed = model if attention != "dense" else None
            if self._routed is not None:
                _attention.route(self._routed)
        except BaseException:
            self._backing.close()
            raise
        self._engine: Any = None  # a ResidencyEngine, or hot attention's / H2O's engine
        self._telemetry: Any = None  # the device's HostPublisher (none for a store passed in)
        self._closed = False

    # -- transformers Cache API ------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        engine = self._engine
        if (engine is not None and layer_idx and layer_idx < len(self.layers) and not self._closed
                and cast(_CxlLayer, self.layers[layer_idx]).is_initialized):
            # a layer already set up, past layer 0 (which publishes telemetry): straight to the engine
            return engine.update(layer_idx, key_states, value_states)
        while len(self.layers) <= layer_idx:
            self.layers.append(_CxlLayer(self, len(self.layers)))
        out = cast(_CxlLayer, self.layers[layer_idx]).update(key_states, value_states)
        if layer_idx == 0 and self._telemetry is not None:
            self._telemetry.publish()
        return out

    def _engine_for(self, key_states: torch.Tensor) -> Any:
        if self._closed:
            raise RuntimeError("CxlCache is closed: make a new one")
        if self._engine is None and self._attention[0] != "dense":
            self._engine = _sparse_engine(self, key_states)
        if self._engine is None:
            store = compressed(self._backing.store(), self._kv_format, block_tokens=self._kw["block_tokens"],
                               head_dim=key_states.shape[-1], dtype=key_states.dtype)
            timing = getattr(store, "timing", None)  # a device's; a memory store has no link
            self._engine = ResidencyEngine(
                store=store, device=key_states.device, dtype=key_states.dtype,
                link=timing.link_params() if timing is not None else None,
                recompute=self._recorder.recompute if self._recorder else None, **self._kw)
            self._telemetry = getattr(store, "telemetry", None)
            if self._telemetry is not None:
                self._telemetry.attach(self._engine)
        return self._engine

    # -- cxlemu API --------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Counters: loads, offloads, hits, misses, prefetch_late, stall_ns, hbm_peak_bytes, ..."""
        if self._engine is None:
            return dict.fromkeys(ResidencyEngine.COUNTERS, 0) | {"hbm_peak_bytes": 0}
        return self._engine.stats() | link_stats(self._engine)

    @property
    def device_name(self) -> str | None:
        return self._backing.name

    def close(self) -> None:
        """Release every frame, staging buffer and device chunk; stop a private device."""
        if self._closed:
            return
        self._closed = True
        if self._engine is not None:
            self._engine.close()
            if self._telemetry is not None:
                self._telemetry.detach(self._engine)
        if self._recorder is not None:
            self._recorder.remove()
        if self._routed is not None:
            _attention.unroute(self._routed)
        self._backing.close()

    def __enter__(self) -> CxlCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed:
                self.close()
        except Exception:  # interpreter shutdown: nothing left to release to
            pass


ATTENTION_MODES = ("dense", "hot", "h2o")


def _check_attention(attention: str, page_budget: float, selector: str | type, model: object) -> None:
    """``attention``, ``page_budget`` and ``selector`` (see :class:`CxlCache`), or ConfigError."""
    if attention not in ATTENTION_MODES:
        raise ConfigError(f"attention must be one of {', '.join(ATTENTION_MODES)}, got {attention!r}")
    if (isinstance(page_budget, bool) or not isinstance(page_budget, (int, float))
            or not 0 < page_budget <= 1):
        raise ConfigError(f"page_budget must be a fraction in (0, 1] of the pages attention reads, got {page_budget!r}")
    if attention == "dense":
        if page_budget != 1.0:
            raise ConfigError("page_budget applies to attention='hot' or 'h2o'; dense attention reads every token")
        return
    if model is None:
        raise ConfigError(f"attention={attention!r} needs model=: the cache routes that model's attention "
                          "through driver.kv's attention function (it chooses what the query reads)")
    if attention == "hot":
        from driver.kv.selectors import resolve_selector

        resolve_selector(selector)  # unknown names, and a class that lacks the protocol, fail here


def _sparse_engine(cache: CxlCache, key_states: torch.Tensor) -> Any:
    """Hot attention's engine on the cache's store, or H2O's (which keeps no KV off the accelerator)."""
    attention, page_budget, selector = cache._attention
    if attention == "h2o":
        from driver.kv._h2o import H2OEngine

        return H2OEngine(page_budget=page_budget, record=cache._record)
    from driver.kv._hot import HotEngine

    kw = cache._kw
    store = compressed(cache._backing.store(), cache._kv_format, block_tokens=kw["block_tokens"],
                       head_dim=key_states.shape[-1], dtype=key_states.dtype)
    return HotEngine(budget=kw["budget"], page_budget=page_budget, selector=selector,
                     block_tokens=kw["block_tokens"], store=store, device=key_states.device,
                     dtype=key_states.dtype, prefetch=kw["prefetch_depth"] != 0,
                     max_seq_len=kw["max_seq_len"], clock=kw["clock"], model=cache._routed, record=cache._record)


class _Backing:
    """Where the chunks go: a given store, a named device, or a private in-process one."""

    def __init__(self, device: str | None, store: BlockStore | None, capacity: int) -> None:
        self.name = device
        self._given = store
        self._capacity = capacity
        self._store: BlockStore | None = None

    def store(self) -> BlockStore:
        if self._store is None:
            self._store = self._given if self._given is not None else self._open()
        return self._store

    def _open(self) -> BlockStore:
        from driver.kv._device_store import open_device_store

        store, self.name = open_device_store(self.name, self._capacity, f"kv{os.getpid()}-{next(_serial)}")
        return store

    def close(self) -> None:
        if self._store is not None and self._given is None:
            self._store.close()  # a store passed in belongs to the caller
