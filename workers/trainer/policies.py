"""Consumption policies of the trainer, by the names async-RL users know them.

A policy looks at a finalized group's lowest weight version and the trainer's current version and
says whether the group is usable now, must wait, or is too stale to ever be used.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from schemas.errors import InvalidArgument
from schemas.finalized import FinalizedGroup


class Decision(enum.Enum):
    YIELD = "yield"
    HOLD = "hold"
    EVICT = "evict"


class Policy(Protocol):
    name: str

    def decide(self, group: FinalizedGroup, version: int) -> Decision: ...

    def order(self, ready: Sequence[FinalizedGroup]) -> list[FinalizedGroup]: ...

    def too_far_ahead(self, group: FinalizedGroup, version: int) -> bool: ...


@dataclass(frozen=True)
class Windowed:
    """Yield groups at most `max_staleness_versions` behind the trainer, in arrival order; evict older ones."""

    max_staleness_versions: int
    name: str = "windowed"

    def decide(self, group: FinalizedGroup, version: int) -> Decision:
        return Decision.YIELD if version - group.group_min_wv <= self.max_staleness_versions else Decision.EVICT

    def order(self, ready: Sequence[FinalizedGroup]) -> list[FinalizedGroup]:
        return list(ready)

    def too_far_ahead(self, group: FinalizedGroup, version: int) -> bool:
        return False


@dataclass(frozen=True)
class WeightFifo:
    """Windowed's bound, but the oldest weight version first (arrival order within a version).

    The groups nearest their eviction go first, so a steady stream of fresh groups never starves
    older ones into eviction (a freshest-first order would: it trains on fast, short rollouts).
    """

    max_staleness_versions: int
    name: str = "weight_fifo"

    def decide(self, group: FinalizedGroup, version: int) -> Decision:
        return Decision.YIELD if version - group.group_min_wv <= self.max_staleness_versions else Decision.EVICT

    def order(self, ready: Sequence[FinalizedGroup]) -> list[FinalizedGroup]:
        return sorted(ready, key=lambda g: g.group_min_wv)  # stable: arrival order within a version

    def too_far_ahead(self, group: FinalizedGroup, version: int) -> bool:
        return False


@dataclass(frozen=True)
class InOrder:
    """Yield only groups of exactly the current version; hold later ones; evict earlier ones."""

    max_lookahead_versions: int
    name: str = "in_order"

    def decide(self, group: FinalizedGroup, version: int) -> Decision:
        if group.group_min_wv == version:
            return Decision.YIELD
        if group.group_min_wv < version:
            return Decision.EVICT
        return Decision.HOLD

    def order(self, ready: Sequence[FinalizedGroup]) -> list[FinalizedGroup]:
        return list(ready)

    def too_far_ahead(self, group: FinalizedGroup, version: int) -> bool:
        # Still held (it will be usable later), but reported: it is the in_order trainer's lag signal.
        return group.group_min_wv - version > self.max_lookahead_versions


@dataclass(frozen=True)
class ReadyFirst:
    """Yield any group not produced by a policy newer than the trainer's."""

    name: str = "ready_first"

    def decide(self, group: FinalizedGroup, version: int) -> Decision:
        return Decision.YIELD if group.group_min_wv <= version else Decision.HOLD

    def order(self, ready: Sequence[FinalizedGroup]) -> list[FinalizedGroup]:
        return list(ready)

    def too_far_ahead(self, group: FinalizedGroup, version: int) -> bool:
        return False


def windowed(max_staleness_versions: int) -> Windowed:
    if max_staleness_versions < 0:
        raise InvalidArgument(f"max_staleness_versions must be >= 0, got {max_staleness_versions}")
    return Windowed(max_staleness_versions)


def weight_fifo(max_staleness_versions: int) -> WeightFifo:
    if max_staleness_versions < 0:
        raise InvalidArgument(f"max_staleness_versions must be >= 0, got {max_staleness_versions}")
    return WeightFifo(max_staleness_versions)


def in_order(max_lookahead_versions: int) -> InOrder:
    if max_lookahead_versions < 0:
        raise InvalidArgument(f"max_lookahead_versions must be >= 0, got {max_lookahead_versions}")
    return InOrder(max_lookahead_versions)


def ready_first() -> ReadyFirst:
    return ReadyFirst()


def policy_by_name(name: str, **params) -> Policy:
    """Build a policy from its name, e.g. policy_by_name("windowed", max_staleness_versions=2)."""
    makers = {"windowed": windowed, "in_order": in_order, "ready_first": ready_first, "weight_fifo": weight_fifo}
    if name not in makers:
        raise InvalidArgument(f"unknown consumption policy {name!r}; choose one of {', '.join(makers)}")
    accepted = inspect.signature(makers[name]).parameters
    unknown = sorted(set(params) - set(accepted))
    missing = [p for p, v in accepted.items() if v.default is inspect.Parameter.empty and p not in params]
    if unknown or missing:
        raise InvalidArgument(
            f"policy {name!r} takes {', '.join(accepted) or 'no parameters'}"
            + (f"; unknown: {', '.join(unknown)}" if unknown else "")
            + (f"; missing: {', '.join(missing)}" if missing else "")
        )
    return makers[name](**params)
