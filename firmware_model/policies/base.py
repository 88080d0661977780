"""The one seam every eviction policy sits behind.

The shape follows vLLM's offloading policy API (``insert / touch / remove / evict(protected)``) and
LMCache's (``update_on_put / update_on_hit / update_on_force_evict / get_evict_candidates``): the
cache owner decides *when* something becomes resident or leaves, the policy only keeps order and
answers "who goes next". ``protected`` carries the keys the caller must not lose right now (pinned
blocks, blocks of the step being computed), so a policy never has to know about pins.

Times (``now``) are simulated integers supplied by the caller; no policy reads a clock.
"""
from __future__ import annotations

from collections.abc import Container, Hashable
from typing import Protocol, runtime_checkable

__all__ = ["EvictionPolicy", "NoVictimError", "check_capacity"]


class NoVictimError(LookupError):
    """Every resident key is protected (or nothing is resident): no victim can be chosen."""


@runtime_checkable
class EvictionPolicy(Protocol):
    """Order of resident keys and the choice of the next victim."""

    name: str

    def insert(self, key: Hashable, now: int = 0) -> None:
        """``key`` became resident (after a miss, a prefetch, or a store)."""

    def touch(self, key: Hashable, now: int = 0) -> None:
        """A resident ``key`` was accessed (a hit)."""

    def remove(self, key: Hashable) -> None:
        """``key`` left for a reason other than :meth:`evict` (freed, invalidated)."""

    def evict(self, protected: Container[Hashable] = ()) -> Hashable:
        """Choose a resident key not in ``protected``, forget it, and return it.

        Raises :class:`NoVictimError` (a ``LookupError``) when there is none.
        """

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...


def check_capacity(capacity: int) -> int:
    """Validate a policy capacity (in blocks); returns it."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be a positive number of blocks, got {capacity!r}")
    return capacity


def missing(policy_name: str, key: Hashable) -> KeyError:
    """The error every policy raises when asked to touch or remove a key it does not hold."""
    return KeyError(f"{policy_name}: key {key!r} is not resident (insert it before touch/remove)")


def duplicate(policy_name: str, key: Hashable) -> KeyError:
    """The error every policy raises when a resident key is inserted again."""
    return KeyError(f"{policy_name}: key {key!r} is already resident (use touch for a hit)")
