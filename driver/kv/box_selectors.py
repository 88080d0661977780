"""Page selectors that narrow Quest's box: plug-ins for hot attention (``selector="driver.kv.box_selectors:CenterSelector"``).

Quest's bound of ``q . k`` over a page (``driver.kv.selectors.quest_bound``) is, per channel,
``q_d c_d + |q_d| r_d`` (``c``: the box's centre, ``r``: its half-width): the centre's score plus a
width term that grows with the page's spread whatever the query. One out-of-distribution token
(a fact in filler) widens its page's box in many channels, so such pages top the bound at every
step (``cxlemu bench quality``'s ``tail_fact_share``). These selectors rank by a box shrunk about
its centre by ``SHRINK`` (1: Quest; 0: the centre's score, an estimate of the page's mean key
score) and otherwise choose as Quest does (its ordering and tie-breaks, reused).
"""
from __future__ import annotations

import torch

from driver.kv.selectors import QuestSelector

__all__ = ["CenterSelector", "HalfBoxSelector"]


class _ShrunkBox:
    """Quest over each page's box shrunk by ``SHRINK`` about its centre."""

    name = "shrunk-box"
    SHRINK = 1.0

    def select(self, query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, candidates: torch.Tensor,
               k: int, hotness: torch.Tensor) -> torch.Tensor:
        centre, half = (kmax + kmin) / 2, (kmax - kmin) / 2 * self.SHRINK
        return QuestSelector().select(query, centre - half, centre + half, candidates, k, hotness)


class CenterSelector(_ShrunkBox):
    """The pages whose box centre scores highest: the width term dropped."""

    name = "center"
    SHRINK = 0.0


class HalfBoxSelector(_ShrunkBox):
    """Quest over boxes of half the width."""

    name = "half-box"
    SHRINK = 0.5
