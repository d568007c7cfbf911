"""The errors the model raises, with the codes and flags confluent-kafka 2.16 / librdkafka 2.16 report.

Each was observed against the project's broker (Kafka 4.1.1) and is held to it by the differential
tests; the text is librdkafka's where it matters to rlstream (`poll_errors.py` looks for
"group.instance.id"), otherwise close to it. They are real `KafkaError`/`KafkaException` objects,
so code under test reads `code()`, `fatal()`, `retriable()`, `txn_requires_abort()` as it would.
"""

from __future__ import annotations

from confluent_kafka import KafkaError, KafkaException


def error(code: int, text: str, *, fatal: bool = False, retriable: bool = False, abortable: bool = False) -> KafkaError:
    return KafkaError(code, text, fatal=fatal, retriable=retriable, txn_requires_abort=abortable)


def raise_(err: KafkaError) -> None:
    raise KafkaException(err)


def bad_state(state: str) -> KafkaError:
    """A transactional call not valid now (begin before init, commit outside a transaction, ...)."""
    return error(KafkaError._STATE, f"Operation not valid in state {state}")


def produce_state() -> KafkaError:
    """A transactional producer's produce outside a transaction, or after an abortable error."""
    return error(KafkaError._STATE, "Unable to produce message: Local: Erroneous state")


def fenced(where: str) -> KafkaError:
    """Fenced by a newer producer instance under the same transactional id (or the coordinator's timeout abort)."""
    return error(KafkaError._FENCED, f"{where}: Local: This instance has been fenced by a newer instance", fatal=True)


def produce_fenced(topic: str, partition: int) -> KafkaError:
    return error(
        KafkaError._FENCED,
        f"ProduceRequest for {topic} [{partition}] failed: Broker: Producer attempted an operation with an old epoch: "
        "transactional producer fenced by newer producer instance",
        fatal=True,
    )


def delivery_fenced() -> KafkaError:
    """What a delivery report of a fenced producer's record carries (not flagged fatal)."""
    return error(KafkaError.INVALID_PRODUCER_EPOCH, "Broker: Producer attempted an operation with an old epoch")


def txn_timed_out() -> KafkaError:
    """A transactional call that did not finish in its timeout: retriable, the call again resumes it."""
    return error(
        KafkaError._TIMED_OUT, "Timed out waiting for operation to finish, retry call to resume", retriable=True
    )


def offset_commit_refused(code: int, text: str) -> KafkaError:
    """`send_offsets_to_transaction` refused by the group coordinator: the transaction must be aborted."""
    return error(code, f"Failed to commit offsets to transaction: Broker: {text}", abortable=True)


GROUP_TEXT = {
    KafkaError.ILLEGAL_GENERATION: "Specified group generation id is not valid",
    KafkaError.UNKNOWN_MEMBER_ID: "Unknown member",
    KafkaError.FENCED_INSTANCE_ID: "Static consumer fenced by other consumer with same group.instance.id",
    KafkaError.REBALANCE_IN_PROGRESS: "Group rebalance in progress",
    KafkaError.OFFSET_METADATA_TOO_LARGE: "Offset metadata string too large",
}


def commit_refused(code: int) -> KafkaError:
    return error(code, f"Commit failed: Broker: {GROUP_TEXT[code]}")


def committed_timed_out() -> KafkaError:
    return error(KafkaError._TIMED_OUT, "Failed to get committed offsets: Local: Timed out")


def wait_coordinator() -> KafkaError:
    return error(KafkaError._WAIT_COORD, "Commit failed: Local: Waiting for coordinator")


def static_fenced() -> KafkaError:
    """What a consume returns once another consumer joined under this one's group.instance.id."""
    text = "Broker: Static consumer fenced by other consumer with same group.instance.id"
    return error(KafkaError._FATAL, f"Fatal error: {text}: Fatal consumer error: {text}")


def max_poll_exceeded(interval_ms: int, over_ms: int) -> KafkaError:
    return error(
        KafkaError._MAX_POLL_EXCEEDED, f"Application maximum poll interval ({interval_ms}ms) exceeded by {over_ms}ms"
    )


def unknown_partition(what: str) -> KafkaError:
    return error(KafkaError._UNKNOWN_PARTITION, f"{what}: Local: Unknown partition")


def transport(what: str) -> KafkaError:
    return error(KafkaError._TRANSPORT, f"{what}: Local: Broker transport failure")


def msg_timed_out() -> KafkaError:
    return error(KafkaError._MSG_TIMED_OUT, "Local: Message timed out")


def purged() -> KafkaError:
    return error(KafkaError._PURGE_QUEUE, "Local: Purged in queue")


def unknown_topic(topic: str) -> KafkaError:
    return error(
        KafkaError.UNKNOWN_TOPIC_OR_PART, f"Subscribed topic not available: {topic}: Broker: Unknown topic or partition"
    )


def inconsistent_protocol() -> KafkaError:
    return error(KafkaError.INCONSISTENT_GROUP_PROTOCOL, "Broker: Inconsistent group protocol")
