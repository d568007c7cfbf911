"""A step's read of its groups' staged rows: which keys each group owns (their tags), then one batched
get per kind (rlstream's rows: `staged_fetch.py`; NeMo Gym's: `gym_fetch.py`).

Reads only: nothing here changes TQ, so a read may run ahead of the step on another thread (the
pipelined step, `prefetch.py`) and be dropped unused. `read_staged` is what `finalize_groups` builds from.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from schemas.request import RolloutReassemblerActorConfig
from schemas.staged_rows import owned_by
from streams.errors import RowsUnsettled
from streams.tq import KVStore
from workers.reassembler.errors import StagingUnstable
from workers.reassembler.groups import OpenGroup
from workers.reassembler.gym_fetch import fetch_gym_rows, is_gym
from workers.reassembler.staged_fetch import Segments, fetch_segments


@dataclass(frozen=True)
class Owned:
    """A group's staging keys that its own receipts may use, by the kind of receipt that claimed them.

    A key is read the way its claim's receipt says (an rlstream receipt's as rlstream tensors, a NeMo
    Gym receipt's as a NeMo Gym call), so a claim of the other kind never changes how it is read.
    """

    rlstream: frozenset[str] = frozenset()
    gym: frozenset[str] = frozenset()

    @property
    def keys(self) -> frozenset[str]:
        return self.rlstream | self.gym


class Claim(NamedTuple):
    """One call a group's receipt names: whose it says it is, its key, and the receipt's kind."""

    group_id: str
    rollout_id: str
    staging_key: str
    gym: bool


def staging_claims(groups: Sequence[OpenGroup]) -> list[Claim]:
    """What the groups' receipts claim, in order: a snapshot, which a read on another thread can use
    while the groups themselves take receipts."""
    return [
        Claim(g.group_id, r.rollout_id, c.staging_key, is_gym(r))
        for g in groups
        for r in g.receipts.values()
        for c in r.manifest
    ]


def owned_keys(
    store: KVStore, staging_partition: str, groups: Sequence[OpenGroup]
) -> tuple[dict[str, Owned], dict[str, dict[str, Any]]]:
    """Per group, the staging keys of its receipts that were staged by that very group and rollout.

    A receipt is input: it could name another rollout's staged rows, whose tokens would become this
    group's rows and then be cleared under their owner. Staged rows carry the group and rollout they
    belong to in their tags (`stage_rollouts`); a row whose tags say otherwise is treated as missing.
    Two groups of one step may name the same key: each is judged on its own claim, and a key is
    owned per kind of the receipt that claimed it. Returns the owned keys per group and the tags
    looked up.
    """
    return _owned(store, staging_partition, [g.group_id for g in groups], staging_claims(groups))


def _owned(
    store: KVStore, staging_partition: str, group_ids: Sequence[str], claims: Sequence[Claim]
) -> tuple[dict[str, Owned], dict[str, dict[str, Any]]]:
    tags = store.tags(staging_partition, list(dict.fromkeys(c.staging_key for c in claims)))
    owned: dict[str, tuple[set[str], set[str]]] = {gid: (set(), set()) for gid in group_ids}
    for c in claims:
        if owned_by(tags.get(c.staging_key), c.group_id, c.rollout_id):
            owned[c.group_id][c.gym].add(c.staging_key)
    return {gid: Owned(frozenset(rl), frozenset(gym)) for gid, (rl, gym) in owned.items()}, tags


@dataclass(frozen=True)
class Fetched:
    """The staged rows a step read: rlstream's tensors and NeMo Gym's calls, each by key."""

    segments: Segments
    gym_rows: Segments
    # Keys found by the lookup whose rows the store then reported missing: gone or foreign under their
    # own key (someone else's clear by an index that changed hands: DESIGN "Zombies"), or cleared since.
    unread: frozenset[str] = frozenset()

    def of(self, owned: Owned) -> tuple[Segments, Segments]:
        """What one group may build from: the rows of its own keys, each as its claim's kind."""
        return (
            {k: v for k, v in self.segments.items() if k in owned.rlstream},
            {k: v for k, v in self.gym_rows.items() if k in owned.gym},
        )


@dataclass(frozen=True)
class Staged:
    """One staging read for a set of groups: per group the keys it owns, the tags looked up, the rows."""

    owned: dict[str, Owned]
    tags: dict[str, dict[str, Any]]
    fetched: Fetched
    fetch_ms: float  # how long the step waited for it (metrics only)


def read_staged(store: KVStore, groups: Sequence[OpenGroup], config: RolloutReassemblerActorConfig) -> Staged:
    """The ownership lookup and one batched fetch of the staged rows `groups` own (TQ reads only)."""
    return read_claims(store, [g.group_id for g in groups], staging_claims(groups), config)


def read_claims(
    store: KVStore, group_ids: Sequence[str], claims: Sequence[Claim], config: RolloutReassemblerActorConfig
) -> Staged:
    """`read_staged` of the groups `group_ids` whose receipts claimed `claims` (`staging_claims`)."""
    t0 = time.perf_counter()
    try:
        owned, tags = _owned(store, config.staging_partition, group_ids, claims) if group_ids else ({}, {})
    except RowsUnsettled as exc:  # which staged rows are there is not known now: the step is rebuilt
        raise StagingUnstable(f"staged rows could not be looked up now ({exc})") from exc
    # In the order the lookup asked for them: a store that keeps that lookup's row locations
    # (TQStore) then fetches the rows without looking them up again. Each key is read as the kind
    # of receipt that owns it claims it is (a foreign claim of the other kind owns nothing).
    lookup = list(dict.fromkeys(c.staging_key for c in claims))
    rl_keys = set().union(*(o.rlstream for o in owned.values()))
    gym_keys = set().union(*(o.gym for o in owned.values()))
    unread: set[str] = set()
    fetched = Fetched(
        fetch_segments(
            store,
            config.staging_partition,
            [k for k in lookup if k in rl_keys],
            routed_experts=config.router_replay_enabled,
            tags=tags,
            unread=unread,
        ),
        fetch_gym_rows(store, config.staging_partition, [k for k in lookup if k in gym_keys], tags, unread=unread),
        frozenset(unread),
    )
    return Staged(owned, tags, fetched, (time.perf_counter() - t0) * 1000.0)
