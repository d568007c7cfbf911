"""The invariants every run is held to, read from what the system wrote, never from what the harness meant.

The evidence is the models' state at the end: the committed records of the finalized, dead-letter,
trainer dead-letter and regenerate topics (read_committed, as a fresh consumer would see them), what
TQ's controller still maps, the trainer's model (the groups it trained, with a digest of every row
it read, as its last incarnation holds them), resume's reports, and how each component ended.

For every prompt group a rollout worker published (originals and regenerations):

- trained at most once, and never both trained and handed back (its regeneration would be trained too);
- dead-lettered whole only for a reason its input earns: every rollout failed (`all_rollouts_failed`
  of an `all_failed` group), a group regenerated `MAX_REGENERATIONS` times losing its rows again, or
  (`group_timeout`) a group whose receipts did not all land within `group_timeout_s` of its first,
  by the receipts topic's own timestamps;
- a `poison` group's receipts each dead-lettered (no group ever opens);
- trained on its own rows: every valid row's tokens are the ones its rollout staged (digests);
- and by the end it has an outcome (trained, handed back with its regeneration published, dead-lettered).

And for the run: nothing left in TQ, no component crashed on an error it should have handled (the
harness restarts it, as a pool does; three such crashes of one role is a crash loop), the trainer's
version kept up with what it trained, and every resume accounted for every group.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from schemas.deadletter import ALL_ROLLOUTS_FAILED, DECODE_ERROR, GROUP_TIMEOUT, INCONSISTENT_GROUP, DeadLetter
from schemas.errors import SchemaError
from schemas.finalized import FinalizedGroup
from schemas.receipt import Receipt
from schemas.regenerate import MAX_REGENERATIONS, Regenerate, regeneration_of
from streams.tq import STAGING, TRAIN
from tests.tools.explore.components import NAMES, reassembler_config
from tests.tools.explore.workload import expected_rows
from workers.trainer.deadletters import MISSING_ROWS

if TYPE_CHECKING:
    from tests.tools.explore.world import World

GROUP_LETTERS = (ALL_ROLLOUTS_FAILED, GROUP_TIMEOUT, INCONSISTENT_GROUP, MISSING_ROWS)
GROUP_TIMEOUT_MS = int(reassembler_config(0, False).group_timeout_s * 1000)
# A receipt stamped just inside the timeout may land just after a caught-up reassembler's deadline.
_LANDING_SLACK_MS = 1000


@dataclass
class Seen:
    """What the topics hold now, by group id."""

    finalized: Counter = field(default_factory=Counter)
    handed_back: dict[str, set[str]] = field(default_factory=dict)  # group id -> new group ids
    letters: dict[str, set[str]] = field(default_factory=dict)  # group id -> group-level letter kinds
    receipt_letters: Counter = field(default_factory=Counter)  # (group id, kind) of receipt letters
    # group id -> rollout index -> when its receipt first landed (the receipts log's timestamp, ms)
    landed: dict[str, dict[int, int]] = field(default_factory=dict)
    # group id -> the rollout indexes its `group_timeout` letters hold (what it had when it closed)
    timed_out_with: dict[str, set[int]] = field(default_factory=dict)

    def late(self, gid: str, group_size: int) -> bool:
        """Whether every rollout `gid` closed without landed `group_timeout_s` or more after its first
        receipt. One that never landed is no excuse: the rollout worker publishes every receipt."""
        times, had = self.landed.get(gid, {}), self.timed_out_with.get(gid, set())
        missing = set(range(group_size)) - had
        if not had or not missing or not missing <= set(times):
            return False
        first = min(times[i] for i in had if i in times)
        return all(times[i] - first >= GROUP_TIMEOUT_MS - _LANDING_SLACK_MS for i in missing)


def _records(world: World, topic: str) -> list:
    cluster = world.cluster
    if topic not in cluster.topics:
        return []
    return [e for p in range(len(cluster.topics[topic].logs)) for e in cluster.records(topic, p)]


def seen(world: World) -> Seen:
    out = Seen()
    for e in _records(world, NAMES.receipts):
        try:
            r = Receipt.from_bytes(e.value)
        except SchemaError:
            continue
        times = out.landed.setdefault(r.group_id, {})
        times[r.rollout_index] = min(times.get(r.rollout_index, e.timestamp_ms), e.timestamp_ms)
    for e in _records(world, NAMES.finalized):
        try:
            out.finalized[FinalizedGroup.from_bytes(e.value).group_id] += 1
        except SchemaError:
            continue
    for e in _records(world, NAMES.regenerate):
        try:
            back = Regenerate.from_bytes(e.value)
        except SchemaError:
            continue
        out.handed_back.setdefault(back.group_id, set()).add(back.new_group_id)
    for topic in (NAMES.deadletter, NAMES.trainer_deadletter):
        for e in _records(world, topic):
            try:
                letter = DeadLetter.from_bytes(e.value)
            except SchemaError:
                continue
            key = letter.source_key.decode(errors="replace")
            if letter.error_kind == GROUP_TIMEOUT:
                try:
                    had = Receipt.from_bytes(letter.original).rollout_index
                except SchemaError:
                    had = None  # not a receipt the group held: no excuse for its timeout (`Seen.late`)
                if had is not None:
                    out.timed_out_with.setdefault(key, set()).add(had)
            if letter.error_kind in GROUP_LETTERS:
                out.letters.setdefault(key, set()).add(letter.error_kind)
            else:
                out.receipt_letters[(key, letter.error_kind)] += 1
    return out


def _earned(kind: str, gid: str, letter: str, s: Seen, group_size: int) -> bool:
    if letter == ALL_ROLLOUTS_FAILED:
        return kind == "all_failed"
    if letter == GROUP_TIMEOUT:
        return s.late(gid, group_size)
    # A group regenerated as often as allowed whose rows are lost again is dead-lettered, not handed back.
    return regeneration_of(gid)[1] >= MAX_REGENERATIONS


def outcome(world: World, s: Seen, gid: str, trained: Counter) -> str | None:
    """How group `gid` ended, by the evidence: trained, handed back, dead-lettered, poison; None: not yet."""
    p = world.facts.published[gid]
    if trained[gid]:
        return "trained"
    if world.model is not None and gid in world.model.evicted:
        return "evicted"
    if gid in s.handed_back:
        return "handed back"
    if gid in s.letters:
        return "dead-lettered"
    if p.kind == "poison" and s.receipt_letters[(gid, DECODE_ERROR)] >= p.garbage:
        return "poison"
    return None


def outstanding(world: World) -> list[str]:
    """What keeps the run from its end: prompts not published, groups without an outcome, hand-backs
    not generated again, rows in TQ, a trainer whose model is not all checkpointed."""
    facts, out = world.facts, []
    if facts.cursor < world.workload.prompts:
        out.append(f"{world.workload.prompts - facts.cursor} prompt(s) not published")
    s = seen(world)
    trained = world.trained()
    pending = [g for g in facts.published if outcome(world, s, g, trained) is None]
    if pending:
        out.append(f"no outcome yet: {', '.join(sorted(pending)[:6])}")
    owed = sorted(n for news in s.handed_back.values() for n in news if n not in facts.published)
    if owed:
        out.append(f"hand-backs not generated again: {', '.join(owed[:6])}")
    left = tq_left(world)
    if left:
        out.append(f"TQ holds {left}")
    if world.workload.checkpointed and world.model is not None and world.model.saved < len(world.model.trained):
        out.append("the trainer's last groups are not checkpointed")
    return out


def tq_left(world: World) -> str:
    controller = world.tq.controller
    held = []
    for partition in (STAGING, TRAIN):
        keys = sorted(controller.kv_list(partition).get(partition, {}))
        if keys:
            held.append(f"{len(keys)} key(s) of {partition} (e.g. {', '.join(keys[:3])})")
    return "; ".join(held)


def _at_least_once(world: World, gid: str) -> bool:
    """A trainer without checkpoints trains at least once: a group it trained whose commit had not landed
    when the whole job died is read again with its rows lost with TQ, and handed back (DESIGN, "Rows go
    after the commit"; the whole-job guarantee is a checkpointing trainer's)."""
    at = world.facts.trained_at.get(gid)
    return not world.workload.checkpointed and at is not None and any(t >= at for t in world.facts.job_kills)


def violations(world: World, ended: str) -> list[str]:
    """Every invariant the run broke, one line each (empty: it held them all)."""
    facts = world.facts
    out: list[str] = []
    s = seen(world)
    trained = world.trained()
    for gid, n in sorted(trained.items()):
        if gid not in facts.published:
            out.append(f"trained a group never published: {gid}")
        elif n > 1 and world.workload.checkpointed:
            # Without checkpoints a trainer that dies before its commit trains those groups again (at
            # least once, DESIGN "Rows go after the commit"); only a record a commit named is never retrained.
            out.append(f"trained twice: {gid} ({n} times)")
    out += [f"trained again though its commit named it consumed: {r}" for r in facts.retrained_named]
    for gid, p in sorted(facts.published.items()):
        if trained[gid] and gid in s.handed_back and not _at_least_once(world, gid):
            out.append(f"trained and handed back: {gid} (regenerated as {', '.join(sorted(s.handed_back[gid]))})")
        for letter in sorted(s.letters.get(gid, ())):
            if not _earned(p.kind, gid, letter, s, world.workload.group_size):
                out.append(f"dead-lettered without cause: {gid} ({p.kind}) as {letter}")
        evicted = world.model.evicted.count(gid) if world.model is not None else 0
        # Without checkpoints a successor reads again what a trainer that died before its commit had
        # trained or evicted (at least once), and its policy may drop it as stale then: exact only with them.
        if evicted and (trained[gid] or evicted > 1) and world.workload.checkpointed:
            out.append(f"evicted and trained, or evicted twice: {gid} (trained {trained[gid]}, evicted {evicted})")
        if trained[gid] and p.kind in ("all_failed", "poison"):
            out.append(f"trained a group with no valid rollout: {gid} ({p.kind})")
    for gid, digests in world.model.trained if world.model is not None else []:
        p = facts.published.get(gid)
        if p is None:
            continue
        expected = expected_rows(p)
        wrong = [i for i, d in digests.items() if i in expected and d != expected[i]]
        if wrong:
            out.append(f"trained on rows not its own: {gid} rows {wrong}")
    for role, crashes in sorted(facts.crashes.items()):
        for c in crashes[:2]:
            out.append(f"crashed: {role}: {c}")
        if len(crashes) >= 3:
            out.append(f"crash loop: {role} crashed {len(crashes)} times")
    for report in facts.resume_reports:
        if report.unaccounted:
            out.append(f"resume left groups unaccounted for: {', '.join(report.unaccounted[:5])}")
    out += [f"resume failed: {e}" for e in facts.resume_errors]
    batch = world.workload.batch_groups
    if world.model is not None and facts.version < len(world.model.trained) // batch - 1:
        out.append(f"version stuck: {facts.version} after {len(world.model.trained)} group(s) trained")
    if ended != "done":
        why = "; ".join(outstanding(world)) or "no reason found"
        out.append(f"did not finish ({ended} at {world.sched.elapsed:.0f}s): {why}")
    out += [f"model timer failed: {t.splitlines()[-1]}" for t in world.sched.timer_errors[:2]]
    return out
