"""A model of Kafka (one broker, Kafka 4.1) as confluent-kafka 2.16 / librdkafka 2.16 show it to rlstream.

`KafkaCluster(env)` is the broker; `SimKafka(cluster, process="w1")` is confluent-kafka's module as
one process sees it: `Consumer(conf)`, `Producer(conf)`, `AdminClient(conf)`, and the real `KafkaError`,
`KafkaException`, `TopicPartition` and `OFFSET_*`: a `streams.kafka_api.KafkaApi`, so rlstream's
own wrappers (`TransactionalProducer`, `AckedProducer`, `read_topic`, the changelog read, the
reassembler's `KafkaClients` and the trainer's `KafkaTrainerClients`, the publisher, the feed, the
gate) run on it unchanged when they are given it as their `api`.
What a test or explorer drives on the cluster: `create_topic`, `down`/`up` (the broker),
`freeze`/`thaw`/`kill` (a process's clients), `compact`, `expire` (retention), `records`.

Claimed behaviours (each held to the real broker by tests/integration/sim/test_kafka_differential.py;
codes and flags are compared, messages are librdkafka-like but not claimed):

- K1 Offsets: a partition's records take consecutive offsets; a transaction's commit or abort
  marker takes one offset in each partition it wrote.
- K2 read_committed reads committed records only, up to the last stable offset (the first offset
  of the earliest open transaction); read_uncommitted reads every record up to the high
  watermark; a reader's position moves past markers and aborted records.
- K3 Watermarks: `get_watermark_offsets` gives (log start, last stable offset) to a read_committed
  consumer and (log start, high watermark) to a read_uncommitted one; `cached=True` gives what the
  last fetch saw, (-1001, -1001) before any.
- K4 Fencing: `init_transactions` under a transactional id in use aborts the older producer's open
  transaction; the older one's next transactional call raises `_FENCED` (fatal, not retriable,
  not abortable); a record it produces is reported `INVALID_PRODUCER_EPOCH` and its next `poll`
  or `flush` raises `_FENCED` once.
- K5 Transactional calls out of turn raise `_STATE` (begin before init, commit or abort with no
  transaction, init twice); a produce outside a transaction raises `_STATE`. A transaction that
  registered nothing (no record, no offsets) ends without asking the coordinator, so it commits
  even after its producer was fenced.
- K6 Transaction timeout: a transaction with a partition added and open past
  `transaction.timeout.ms` is aborted by the coordinator at its next cleanup pass; the producer's
  next call raises `_FENCED` (fatal). A `begin_transaction` with nothing added never times out.
- K7 `send_offsets_to_transaction`: the offsets (with their metadata) commit with the
  transaction and vanish with an abort; the metadata of an older generation is refused
  `ILLEGAL_GENERATION`, of a member gone `UNKNOWN_MEMBER_ID`, of a replaced static member
  `FENCED_INSTANCE_ID`, each abortable; then commit, begin and send_offsets raise it again,
  produce raises `_STATE`, and `abort_transaction` clears it.
- K8 `committed()`: offset and metadata per partition, -1001 when none; a read_committed
  consumer's waits while a transaction holds offsets for the partition, and raises `_TIMED_OUT`
  (not retriable) at its timeout; a read_uncommitted consumer's answers at once.
- K9 `commit()`: a synchronous one returns the offsets; metadata of 4096 characters or more is
  refused `OFFSET_METADATA_TOO_LARGE`; a consumer that is not a member of a group with members is
  refused `UNKNOWN_MEMBER_ID`.
- K10 Consumer groups: under cooperative-sticky a member joining or leaving moves only partitions
  that change owner (revoked first, `on_revoke`, then given in a later round); `on_assign` is called
  after every round, with what was added (maybe nothing); the assignment ends balanced, disjoint
  and complete, and the generation in `consumer_group_metadata()` moves with each round. (Which
  partitions move is the assignor's choice: the invariants are compared, not the choice.)
- K11 Static membership: a consumer closed and replaced under its group.instance.id within the
  session timeout: the new one gets the same partitions in the same generation, no other member
  sees a callback. A second live consumer under the same instance id fences the first: its next
  consume returns `_FATAL` (`fatal()` False, naming group.instance.id), its assignment is empty,
  with no callback.
- K12 A static member closed (or a process frozen) is removed after its session timeout, and its
  partitions go to the others.
- K13 max.poll.interval.ms without a poll: a dynamic member leaves at once; its next consume calls
  `on_lost`, returns `_MAX_POLL_EXCEEDED` (not fatal), and it joins again.
- K14 Positions: -1001 before any record and after a seek; a seek of an unassigned partition
  raises `_STATE`; a pause survives unassign and assign; an offset past the end is reset by
  `auto.offset.reset`.
- K15 Metadata: `list_topics` names the partitions; an unknown topic comes back with
  `UNKNOWN_TOPIC_OR_PART` and no partitions; watermarks of an unknown partition raise
  `_UNKNOWN_PARTITION`; subscribing to an unknown topic gives an `UNKNOWN_TOPIC_OR_PART` event.
- K16 Compaction (`compact`): below the cleaner's point only the last record of each key is left
  (a tombstone included); records above it stay and shadow nothing; offsets do not change.
- K17 Retention (`expire`): records older than retention.ms leave from the start and the log start
  moves (the broker deletes whole segments, so it deletes at most what the model deletes).
- K18 Broker down: `committed()` raises `_TIMED_OUT` at its timeout; `flush` returns what is left
  and the record is reported `_MSG_TIMED_OUT` after message.timeout.ms; `init_transactions` and
  `commit_transaction` raise a retriable `_TIMED_OUT`, and the same call once the broker is back
  completes; `consume` returns nothing; `list_topics` raises `_TRANSPORT`; `commit` raises
  `_WAIT_COORD`. (How long the real client takes to recover after the broker is back varies; not
  claimed.)
- K19 A record to an unknown topic is reported `_MSG_TIMED_OUT` after message.timeout.ms.
- K20 Admin (`admin.py`): `describe_consumer_groups` lists a group's members (member id, client id,
  group.instance.id) while they are members: a consumer closed (dynamic) is gone at once, one whose
  process was killed stays listed until its session timeout (not compared: the scenario kills no
  process), a static one closed stays listed; a group the broker does not know is described with no
  members. `describe_configs` of a topic gives `retention.ms` (the topic's own, else the broker's
  default) and the configs it was created with.

For an explorer, beyond the claims (its faults, not the broker's behaviour, so not held to the
broker): every request to the broker (produce, transactional calls, group membership, offset
commits) lands when the environment lands it, so a call can time out while its request still
applies later (a synchronous `commit` gives up after socket.timeout.ms, 60 s); `freeze`, `thaw`
and `kill` a process; any point may raise (a `committed()` failing in a coordinator failover).

Not modelled: replication, several brokers, quotas, ACLs, auto-commit, partition EOF events,
incremental fetch sessions, idempotent sequence checks, the KIP-848 consumer protocol, the exact
choices of librdkafka's sticky assignor, exact error texts.
"""

from __future__ import annotations

from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_END,
    OFFSET_INVALID,
    OFFSET_STORED,
    KafkaError,
    KafkaException,
    TopicPartition,
)

from tests.tools.sim.kafka.admin import AdminClient
from tests.tools.sim.kafka.cluster import ClusterConfig, KafkaCluster
from tests.tools.sim.kafka.consumer import Consumer
from tests.tools.sim.kafka.messages import GroupMetadata, Message
from tests.tools.sim.kafka.producer import Producer

__all__ = [
    "AdminClient",
    "ClusterConfig",
    "Consumer",
    "GroupMetadata",
    "KafkaCluster",
    "Message",
    "Producer",
    "SimKafka",
]


class SimKafka:
    """confluent-kafka's classes as one process sees them, bound to one model cluster."""

    KafkaError = KafkaError
    KafkaException = KafkaException
    TopicPartition = TopicPartition
    OFFSET_BEGINNING = OFFSET_BEGINNING
    OFFSET_END = OFFSET_END
    OFFSET_INVALID = OFFSET_INVALID
    OFFSET_STORED = OFFSET_STORED

    def __init__(self, cluster: KafkaCluster, process: str = "main"):
        self.cluster = cluster
        self.process = process

    def Consumer(self, conf: dict) -> Consumer:  # noqa: N802 - confluent-kafka's name
        return Consumer(conf, cluster=self.cluster, process=self.process)

    def Producer(self, conf: dict) -> Producer:  # noqa: N802 - confluent-kafka's name
        return Producer(conf, cluster=self.cluster, process=self.process)

    def AdminClient(self, conf: dict) -> AdminClient:  # noqa: N802 - confluent-kafka's name
        return AdminClient(conf, cluster=self.cluster, process=self.process)
