"""What `resume` reads of Kafka, each from where it is still needed, not from the start (issue 30).

- the finalized topic from each partition's cut (the checkpoint's marks, else the trainer's commits):
  what lies before was resolved by the checkpoint and is never read again;
- the state topic from each partition's restore point, as a reassembler's restore reads it
  (`workers/reassembler/changelog.py`): the groups the reassemblers still remember;
- the receipts topic from the reassemblers' committed offsets: the groups still open.

Records a topic's retention deleted before anyone read them (the job was down longer than
`retention.ms`) are counted apart (`Expired`), never waited for: their groups are lost, and resume
goes on. `retention_warnings` names the topics resume needs that keep records for a limited time.
Each read's clients come from the `KafkaApi` given and its waits are on the `Runtime` given (the real
ones by default).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from confluent_kafka.admin import ConfigResource

from schemas.errors import SchemaError
from schemas.finalized import FinalizedGroup
from schemas.receipt import Receipt
from schemas.state import OPEN, GroupState, PartitionProgress
from streams.config import KafkaConfig
from streams.consumer import end_offsets, read_topic
from streams.kafka_api import REAL_KAFKA, KafkaApi
from streams.runtime import REAL_RUNTIME, Runtime
from workers.reassembler.changelog import read_changelog


@dataclass
class Expired:
    """Offsets a topic's retention deleted before they were read: (topic, partition, first, end)."""

    ranges: list[tuple[str, int, int, int]] = field(default_factory=list)

    def add(self, topic: str, start: dict[int, int], lows: dict[int, int]) -> dict[int, int]:
        """Note the partitions whose log starts past `start`; returns where each is read from."""
        begin = {}
        for part, low in lows.items():
            want = start.get(part, 0)
            if low > want:
                self.ranges.append((topic, part, want, low))
            begin[part] = max(want, low)
        return begin

    def where(self) -> str:
        return ", ".join(f"{t}[{p}] offsets {a}..{b - 1}" for t, p, a, b in self.ranges)


@dataclass
class FinalizedRead:
    """The finalized records read, sorted as they stream by (none is kept whole: a read from the start
    of a topic of 1M groups would hold them all): each group's first record and whether the cut
    resolved it; the records not resolved, with their sample ids; the duplicates of resolved groups;
    and per partition where reading began."""

    first: dict[str, tuple[int, int, bool]] = field(default_factory=dict)
    untrained: list[tuple[str, int, int, tuple[str, ...]]] = field(default_factory=list)
    resolved: int = 0
    # (group id, partition, offset) of a resolved original with a duplicate past the cut.
    originals: list[tuple[str, int, int]] = field(default_factory=list)
    records: int = 0
    begin: dict[int, int] = field(default_factory=dict)

    def take(self, partition: int, offset: int, group: FinalizedGroup, resolved: bool) -> None:
        """One record, in log order per partition; `resolved`: the cut's marks resolve it."""
        self.records += 1
        gid = group.group_id
        first = self.first.get(gid)
        if first is not None:
            # A duplicate. Past the cut, of an original before it (read from the start), the restored trainer
            # never reads that original again: told of it (the checkpoint's resolved groups), it resolves the
            # duplicate with it instead of taking it for a group whose rows are lost, and handing it back.
            if first[2] and not resolved:
                self.originals.append((gid, first[0], first[1]))
            return
        self.first[gid] = (partition, offset, resolved)
        if resolved:
            self.resolved += 1
        else:
            self.untrained.append((gid, partition, offset, group.sample_ids))


def read_finalized(
    kafka: KafkaConfig,
    topic: str,
    start: dict[int, int],
    expired: Expired,
    is_trained: Callable[[int, int], bool],
    *,
    api: KafkaApi = REAL_KAFKA,
    runtime: Runtime = REAL_RUNTIME,
) -> FinalizedRead:
    """Read `topic` from `start` (from its log start where retention deleted more), sorting records by
    `is_trained(partition, offset)`: the cut's marks."""
    lows = {p: low for p, (low, _) in end_offsets(kafka, topic, api=api).items()}
    out = FinalizedRead(begin=expired.add(topic, start, lows))
    for r in read_topic(kafka, topic, start=out.begin, api=api, runtime=runtime):
        try:
            group = FinalizedGroup.from_bytes(r.value)
        except SchemaError:
            continue  # the trainer dead-letters it as undecodable
        out.take(r.partition, r.offset, group, is_trained(r.partition, r.offset))
    return out


@dataclass
class StateRead:
    """The state topic as the reassemblers restore it: each remembered group's latest entry, each
    receipts partition's latest progress entry, and how many state records were read."""

    groups: dict[str, GroupState] = field(default_factory=dict)
    progress: dict[int, PartitionProgress] = field(default_factory=dict)
    records: int = 0

    def receipts_start(self, partition: int) -> int | None:
        """Where the reassemblers' committed offset on receipts `partition` can be no later than, from the
        state alone: the first receipt of a group still open there, else past what its progress says was
        emitted. None when the state says nothing of the partition (nothing committed for it)."""
        progress = self.progress.get(partition)
        if progress is None:
            return None
        opened = [g.first_offset for g in self.groups.values() if g.partition == partition and g.status == OPEN]
        return min([progress.emitted_through + 1, *opened])


def latest_states(
    kafka: KafkaConfig,
    topic: str,
    partitions: list[int],
    *,
    api: KafkaApi = REAL_KAFKA,
    runtime: Runtime = REAL_RUNTIME,
) -> StateRead:
    """Each state partition read from its restore point."""
    out = StateRead()
    for part in partitions:
        changelog = read_changelog(kafka, topic, part, api=api, runtime=runtime)
        out.records += len(changelog.entries)
        for e in changelog.entries:
            if e.entry is None:
                out.groups.pop(e.key.decode(errors="replace"), None)  # a tombstone: forgotten behind the horizon
            elif isinstance(e.entry, GroupState):
                out.groups[e.entry.group_id] = e.entry
            elif isinstance(e.entry, PartitionProgress):
                out.progress[e.entry.partition] = e.entry
    return out


def open_receipts(
    kafka: KafkaConfig,
    topic: str,
    start: dict[int, int],
    expired: Expired,
    *,
    api: KafkaApi = REAL_KAFKA,
    runtime: Runtime = REAL_RUNTIME,
) -> dict[str, list[Receipt]]:
    """Receipts from the reassemblers' committed offsets on, by group (offsets never pass an open group)."""
    lows = {p: low for p, (low, _) in end_offsets(kafka, topic, api=api).items()}
    begin = expired.add(topic, start, lows)
    groups: dict[str, list[Receipt]] = {}
    for r in read_topic(kafka, topic, start=begin, api=api, runtime=runtime):
        try:
            receipt = Receipt.from_bytes(r.value)
        except SchemaError:
            continue  # a reassembler dead-letters it again
        groups.setdefault(receipt.group_id, []).append(receipt)
    return groups


def retention_warnings(
    kafka: KafkaConfig, topics: list[str], log: Callable[[str], None], *, api: KafkaApi = REAL_KAFKA
) -> None:
    """A line for each topic resume needs whose records expire (`retention.ms` not -1): a job down longer
    than that loses the records it had not read. Topics created before rlstream set -1 keep the default."""
    admin = api.AdminClient(kafka.admin())
    try:
        futures = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, t) for t in topics])
        for resource, fut in futures.items():
            entry = fut.result(timeout=30).get("retention.ms")
            if entry is None or entry.value in (None, "-1"):
                continue
            days = int(entry.value) / 86_400_000
            log(
                f"resume: {resource.name} keeps records {days:.1f} days (retention.ms={entry.value}): a job down"
                " longer loses what it had not read (`kafka-configs.sh --alter --entity-type topics --entity-name"
                f" {resource.name} --add-config retention.ms=-1` keeps them)"
            )
    except Exception as exc:  # noqa: BLE001 - a warning's lookup must not stop a resume (ACLs may refuse it)
        log(f"resume: could not read the topics' retention ({exc})")
    finally:
        admin.poll(0)
