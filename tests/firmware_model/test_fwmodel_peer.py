"""cxlemu's policies against an independent peer: libCacheSim (``pip install -e '.[peer]'``).

The same traces (Zipf of three skews and a Zipf + scan mix, several seeds) at 10, 25 and 50 % of
their distinct blocks through cxlemu's replay (the C loops and the Python policies) and through
libCacheSim's C simulator: LRU, LFU, ARC, S3-FIFO and Belady's OPT hit exactly as often.
"""
from __future__ import annotations

import pytest

from firmware_model.replay import replay_keys
from tools.trace.gen import scanmix, zipf
from tools.trace.peer import PEER_NAMES, available, peer_hits

pytestmark = pytest.mark.skipif(not available(), reason="libCacheSim not installed: pip install -e '.[peer]'")

TRACES = {
    **{f"zipf{a / 1000:g}-s{seed}": {"kind": zipf, "accesses": 20_000, "blocks": 2_000, "alpha_milli": a,
                                     "seed": seed} for a in (800, 1000, 1200) for seed in (0, 1)},
    **{f"scanmix-s{seed}": {"kind": scanmix, "accesses": 20_000, "blocks": 1_500, "scan_blocks": 800,
                            "scan_every": 4_000, "seed": seed} for seed in (0, 1, 2)},
}


@pytest.mark.parametrize("name", list(TRACES))
def test_hits_equal_libcachesim(name: str) -> None:
    """Every policy, every capacity: cxlemu's hits (C and Python) == libCacheSim's."""
    params = dict(TRACES[name])
    keys = [a.block for a in params.pop("kind")(**params)]
    unique = len(set(keys))
    rows = []
    for frac in (0.10, 0.25, 0.50):
        capacity = int(unique * frac)
        theirs = peer_hits(keys, list(PEER_NAMES), capacity)
        for policy in PEER_NAMES:
            ours = replay_keys(keys, policy, capacity, with_opt=False).hits
            ours_py = replay_keys(keys, policy, capacity, with_opt=False, impl="py").hits
            rows.append((capacity, policy, ours, ours_py, theirs[policy]))
    assert [r for r in rows if not r[2] == r[3] == r[4]] == []
