"""Which poll errors end a worker: librdkafka reports every fatal error as `_FATAL`, cause in the text."""

import pytest
from confluent_kafka import KafkaError, KafkaException

from workers.reassembler.errors import ConsumerGroupProtocolMismatch, WorkerFenced
from workers.reassembler.poll_errors import check_poll_error

FENCED_TEXT = "Fatal consumer error: Broker: Static consumer fenced by other consumer with same group.instance.id"


def test_a_fenced_static_member_stops_as_fenced():
    with pytest.raises(WorkerFenced, match="w1: another process joined consumer group 'g'"):
        check_poll_error(KafkaError(KafkaError._FATAL, FENCED_TEXT, fatal=True), "w1", "g")
    with pytest.raises(WorkerFenced):
        check_poll_error(KafkaError(KafkaError.FENCED_INSTANCE_ID), "w1", "g")


def test_other_fatal_errors_end_the_worker_even_when_not_flagged_fatal():
    # confluent-kafka does not flag a consumer's fatal error fatal() (issue #869): the code says it.
    with pytest.raises(KafkaException):
        check_poll_error(KafkaError(KafkaError._FATAL, "Fatal error: something else"), "w1", "g")


def test_a_group_of_mismatched_assignment_strategies_is_named():
    with pytest.raises(ConsumerGroupProtocolMismatch, match="partition_assignment"):
        check_poll_error(KafkaError(KafkaError.INCONSISTENT_GROUP_PROTOCOL), "w1", "g")


@pytest.mark.parametrize("code", [KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._PARTITION_EOF])
def test_transient_errors_pass(code):
    check_poll_error(KafkaError(code), "w1", "g")
