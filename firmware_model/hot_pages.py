"""What hot-page attention keeps resident whatever its page budget: one home for the KV shim
(``driver.kv._hot``, which runs it) and the serving simulator (``tools.sim.hot``, which models it),
so the simulator's working set is the shim's.

A page is a KV block (``block_tokens`` tokens). The first ``SINK_PAGES`` pages hold the attention
sinks (StreamingLLM: the first tokens draw attention whatever the query), and the last
``WINDOW_PAGES`` complete pages, with the partial page being filled, are the recent window; both
are read at every step beside the pages the selector chooses.
"""
from __future__ import annotations

__all__ = ["SINK_PAGES", "WINDOW_PAGES"]

SINK_PAGES = 1
WINDOW_PAGES = 2
