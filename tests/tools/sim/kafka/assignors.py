"""Partition assignment strategies, as a group's leader computes them: range, roundrobin, cooperative-sticky.

Deterministic given the members (sorted by member id), their subscriptions and what they own. The
sticky one keeps each member's owned partitions up to its fair share (balanced: counts differ by at
most one) and hands out the rest to the members with the fewest; librdkafka's port of the Java
StickyAssignor can choose differently among equally balanced answers, so the differential tests
hold the model to the invariants (balanced, sticky, every partition once), not to exact choices.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

TP = tuple[str, int]
COOPERATIVE = "cooperative-sticky"


def assign(
    strategy: str,
    members: Sequence[str],
    subscriptions: Mapping[str, Sequence[str]],
    partitions: Mapping[str, int],
    owned: Mapping[str, set[TP]],
) -> dict[str, set[TP]]:
    members = sorted(members)
    if strategy == "range":
        return _range(members, subscriptions, partitions)
    if strategy == "roundrobin":
        return _roundrobin(members, subscriptions, partitions)
    if strategy == COOPERATIVE:
        return _sticky(members, subscriptions, partitions, owned)
    raise ValueError(f"unknown partition.assignment.strategy {strategy!r}")


def _topic_partitions(topic: str, partitions: Mapping[str, int]) -> list[TP]:
    return [(topic, p) for p in range(partitions.get(topic, 0))]


def _range(members, subscriptions, partitions) -> dict[str, set[TP]]:
    out: dict[str, set[TP]] = {m: set() for m in members}
    topics = sorted({t for m in members for t in subscriptions[m]})
    for topic in topics:
        takers = [m for m in members if topic in subscriptions[m]]
        tps = _topic_partitions(topic, partitions)
        each, extra = divmod(len(tps), len(takers))
        at = 0
        for i, m in enumerate(takers):
            n = each + (1 if i < extra else 0)
            out[m].update(tps[at : at + n])
            at += n
    return out


def _roundrobin(members, subscriptions, partitions) -> dict[str, set[TP]]:
    out: dict[str, set[TP]] = {m: set() for m in members}
    tps = [
        tp for t in sorted({t for m in members for t in subscriptions[m]}) for tp in _topic_partitions(t, partitions)
    ]
    i = 0
    for tp in tps:
        for _ in range(len(members)):
            m = members[i % len(members)]
            i += 1
            if tp[0] in subscriptions[m]:
                out[m].add(tp)
                break
    return out


def _sticky(members, subscriptions, partitions, owned) -> dict[str, set[TP]]:
    out: dict[str, set[TP]] = {m: set() for m in members}
    every = sorted(
        tp for t in {t for m in members for t in subscriptions[m]} for tp in _topic_partitions(t, partitions)
    )
    eligible = {tp: [m for m in members if tp[0] in subscriptions[m]] for tp in every}
    base, extra = divmod(len(every), len(members))
    # Members owning the most keep one more than the base share, while the extras last.
    by_owned = sorted(members, key=lambda m: (-len(owned.get(m, ())), m))
    cap = {m: base + (1 if i < extra else 0) for i, m in enumerate(by_owned)}
    taken: set[TP] = set()
    for m in by_owned:
        for tp in sorted(owned.get(m, ())):
            if tp in eligible and m in eligible[tp] and tp not in taken and len(out[m]) < cap[m]:
                out[m].add(tp)
                taken.add(tp)
    for tp in every:
        if tp in taken:
            continue
        takers = [m for m in eligible[tp] if len(out[m]) < cap[m]] or eligible[tp]
        if not takers:
            continue
        m = min(takers, key=lambda m: (len(out[m]), m))
        out[m].add(tp)
        taken.add(tp)
    return out
