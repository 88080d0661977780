"""An object named as a policy that is no policy (a function of other arguments, a constant) is a
PolicyProtocolError saying what the contract needs, before and when it is built."""
from __future__ import annotations

import os

import pytest

from firmware_model.policies import PolicyProtocolError, make_policy, resolve_policy
from firmware_model.policies.base import protocol_summary

CONTRACT = ("a class implementing EvictionPolicy (firmware_model.policies.base) with name: str; "
            "insert(self, key, now=0) -> None; touch(self, key, now=0) -> None; remove(self, key) -> None; "
            "evict(self, protected=()) -> key, raising NoVictimError when none; __contains__(self, key) -> bool; "
            "__len__(self) -> int; built as __init__(self, capacity, **options), or a factory "
            "f(capacity, **options) returning one")


def test_protocol_summary_names_every_member() -> None:
    assert protocol_summary() == CONTRACT


def test_a_function_without_capacity_is_refused_with_the_contract() -> None:
    with pytest.raises(PolicyProtocolError) as exc:
        resolve_policy("os:getcwd")
    assert str(exc.value) == (f"eviction policy os:getcwd is {os.getcwd!r}, which cannot be called as "
                              f"f(capacity) (its signature is ()): expected {CONTRACT}")
    assert isinstance(exc.value, ValueError) and isinstance(exc.value, TypeError)


def test_a_constant_is_refused_with_the_contract() -> None:
    with pytest.raises(PolicyProtocolError) as exc:
        resolve_policy("os:sep")
    assert str(exc.value) == f"eviction policy os:sep is {os.sep!r}, not callable: expected {CONTRACT}"


def test_a_one_argument_function_that_builds_no_policy_is_refused_when_built() -> None:
    with pytest.raises(PolicyProtocolError) as exc:
        make_policy("os:getenv", 4)
    assert str(exc.value) == ("eviction policy os:getenv: calling it as f(4) raised TypeError: str expected, "
                              f"not int; expected {CONTRACT}")
