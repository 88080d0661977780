"""HPA <-> DPA decode (emulator.hdm) against a brute-force reference that deals chunks round-robin."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emulator.hdm import (
    DecoderSettings,
    dpa_to_hpa,
    granularity_from_ig,
    hpa_to_dpa,
    ig_from_granularity,
    interleave_position,
    iw_from_ways,
    ways_from_iw,
)
from emulator.spec.errors import ConfigError

ALL_IW = [0, 1, 2, 3, 4, 8, 9, 10]
ALL_IG = list(range(7))
SZ_256M = 256 << 20


def reference_map(layout: list[tuple[int, int, int, int, int]]) -> dict[int, tuple[int, int, int]]:
    """Deal every chunk of every window, in order, to the next member; no division or modulo.

    layout: (base, size, ways, granularity, skip) per decoder.
    Returns chunk HPA -> (position, DPA of the chunk, granularity).
    """
    table: dict[int, tuple[int, int, int]] = {}
    cursor = 0
    for base, size, ways, gran, skip in layout:
        cursor += skip
        next_dpa = [cursor] * ways
        pos = 0
        hpa = base
        while hpa < base + size:
            table[hpa] = (pos, next_dpa[pos], gran)
            next_dpa[pos] += gran
            hpa += gran
            pos = pos + 1 if pos + 1 < ways else 0
        assert len(set(next_dpa)) == 1, "the reference needs whole rounds"
        cursor = next_dpa[0]
    return table


def check_against_reference(decoders: list[DecoderSettings], probe: int) -> None:
    """Every chunk: its first byte, its last byte and one byte `probe` in, both directions."""
    layout = [(d.base, d.size, d.ways, d.granularity, d.dpa_skip) for d in decoders]
    for chunk_hpa, (pos, chunk_dpa, gran) in reference_map(layout).items():
        for within in {0, gran - 1, probe % gran}:
            hpa, dpa = chunk_hpa + within, chunk_dpa + within
            dec = next(d for d in decoders if d.contains(hpa))
            assert interleave_position(hpa - dec.base, dec.ig, dec.iw) == pos
            assert hpa_to_dpa(decoders, hpa) == dpa
            assert dpa_to_hpa(decoders, dpa, pos) == hpa


@pytest.mark.parametrize("ig", ALL_IG)
@pytest.mark.parametrize("iw", ALL_IW)
def test_every_ways_and_granularity_matches_reference(iw: int, ig: int) -> None:
    """All 8 x 7 IW/IG pairs: three rounds after a 256 MiB skip, behind a decoder of other shape."""
    first = DecoderSettings(base=4 * SZ_256M, size=2 * 256 * 16, ig=0, iw=4)
    second = DecoderSettings(base=64 * SZ_256M, size=3 * ways_from_iw(iw) * (256 << ig), ig=ig, iw=iw,
                             dpa_skip=SZ_256M)
    check_against_reference([first, second], probe=0x5A5)


@st.composite
def decoder_layouts(draw: st.DrawFn) -> list[DecoderSettings]:
    decoders = []
    base = draw(st.integers(0, 1 << 20)) * SZ_256M
    for _ in range(draw(st.integers(1, 3))):
        iw, ig = draw(st.sampled_from(ALL_IW)), draw(st.sampled_from(ALL_IG))
        size = draw(st.integers(1, 4)) * ways_from_iw(iw) * (256 << ig)
        skip = draw(st.sampled_from([0, 256, 4096, SZ_256M]))
        decoders.append(DecoderSettings(base=base, size=size, ig=ig, iw=iw, dpa_skip=skip))
        base += draw(st.integers(1, 8)) * SZ_256M
    return decoders


@settings(max_examples=150, deadline=None)
@given(decoder_layouts(), st.integers(0, 1 << 14))
def test_random_layouts_match_reference(decoders: list[DecoderSettings], probe: int) -> None:
    check_against_reference(decoders, probe)


@settings(max_examples=150, deadline=None)
@given(decoder_layouts(), st.integers(0, 1 << 40))
def test_addresses_outside_every_window_do_not_decode(decoders: list[DecoderSettings], delta: int) -> None:
    last = decoders[-1]
    assert hpa_to_dpa(decoders, last.base + last.size + delta) is None
    if decoders[0].base > delta:
        assert hpa_to_dpa(decoders, decoders[0].base - 1 - delta) is None


def test_dpa_in_a_skip_hole_or_past_the_end_has_no_hpa() -> None:
    decoders = [DecoderSettings(base=0, size=SZ_256M), DecoderSettings(base=SZ_256M, size=SZ_256M,
                                                                       dpa_skip=SZ_256M)]
    assert dpa_to_hpa(decoders, SZ_256M - 1, 0) == SZ_256M - 1
    assert dpa_to_hpa(decoders, SZ_256M, 0) is None          # the skipped hole
    assert dpa_to_hpa(decoders, 2 * SZ_256M, 0) == SZ_256M    # second decoder starts after the hole
    assert dpa_to_hpa(decoders, 3 * SZ_256M, 0) is None


def test_known_values_two_and_three_ways() -> None:
    """Hand-computed: 2-way and 3-way at 256 B."""
    two = [DecoderSettings(base=0x10_0000_0000, size=2 * SZ_256M, ig=0, iw=1)]
    assert hpa_to_dpa(two, 0x10_0000_0100) == 0x0          # chunk 1 -> position 1, its first chunk
    assert hpa_to_dpa(two, 0x10_0000_0234) == 0x134        # chunk 2 -> position 0, second chunk
    three = [DecoderSettings(base=0, size=3 * SZ_256M, ig=0, iw=8)]
    assert [interleave_position(c * 256, 0, 8) for c in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert hpa_to_dpa(three, 0x5FF) == 0x1FF               # chunk 5 -> position 2, second chunk
    assert dpa_to_hpa(three, 0x1FF, 2) == 0x5FF


def test_encodings_round_trip_and_reserved_values_are_refused() -> None:
    assert [ways_from_iw(iw) for iw in ALL_IW] == [1, 2, 4, 8, 16, 3, 6, 12]
    assert [iw_from_ways(ways_from_iw(iw)) for iw in ALL_IW] == ALL_IW
    assert [granularity_from_ig(ig) for ig in ALL_IG] == [256, 512, 1024, 2048, 4096, 8192, 16384]
    assert [ig_from_granularity(granularity_from_ig(ig)) for ig in ALL_IG] == ALL_IG
    for iw in (5, 6, 7, 11, 15):
        with pytest.raises(ConfigError, match="reserved"):
            ways_from_iw(iw)
    with pytest.raises(ConfigError, match="reserved"):
        granularity_from_ig(7)
    with pytest.raises(ConfigError, match="must be one of"):
        ig_from_granularity(768)
    with pytest.raises(ConfigError, match="not supported"):
        iw_from_ways(5)


def test_decoder_settings_refuse_partial_rounds() -> None:
    with pytest.raises(ConfigError, match="multiple of ways x granularity"):
        DecoderSettings(base=0, size=256 * 5, iw=8)
