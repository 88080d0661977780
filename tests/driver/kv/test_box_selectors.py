"""The box selectors (driver.kv.box_selectors): Quest's ranking over each page's key box shrunk
about its centre; exact choices on hand-made keys, and the selector conformance kit."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from driver.kv.box_selectors import CenterSelector, HalfBoxSelector  # noqa: E402
from driver.kv.selectors import QuestSelector  # noqa: E402
from driver.kv.testing import check_selector  # noqa: E402

# pages 1-3 of 2-channel keys, as boxes [kmin, kmax] (page 0 unused):
#   page 1: (1, 0)-(3, 0), centre (2, 0);  page 2: (-1, 2)-(0, 4), centre (-0.5, 3);
#   page 3: (2, -1)-(2, 1), centre (2, 0)
KMIN = torch.tensor([[1.0, 1.0], [1.0, 0.0], [-1.0, 2.0], [2.0, -1.0]]).view(1, 1, 4, 2)
KMAX = torch.tensor([[1.0, 1.0], [3.0, 0.0], [0.0, 4.0], [2.0, 1.0]]).view(1, 1, 4, 2)


def choose(selector: object, query: list[float], k: int) -> list[int]:
    got = selector.select(torch.tensor(query).view(1, 1, 1, 2), KMIN, KMAX, torch.tensor([1, 2, 3]), k,
                          torch.zeros(1, 1, 4, dtype=torch.int64))
    return got.view(-1).tolist()


def test_the_box_width_decides_quest_and_not_the_centre() -> None:
    """q = (1, 0): Quest's bounds 3, 0, 2 (page 1's width adds 1); centres 2, -0.5, 2: a tie
    that goes to the later page; half boxes 2.5, -0.5, 2."""
    assert choose(QuestSelector(), [1.0, 0.0], 1) == [1]
    assert choose(CenterSelector(), [1.0, 0.0], 1) == [3]
    assert choose(HalfBoxSelector(), [1.0, 0.0], 1) == [1]
    assert choose(CenterSelector(), [1.0, 1.0], 2) == [2, 3]  # centres 2, 2.5, 2


@pytest.mark.parametrize("name", ["CenterSelector", "HalfBoxSelector"])
def test_box_selectors_pass_the_conformance_kit(name: str) -> None:
    check_selector(f"driver.kv.box_selectors:{name}", examples=20)
