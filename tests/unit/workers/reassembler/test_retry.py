"""The worker's retry of Kafka calls it cannot go on without: transient failures wait, fatal ones end it."""

import pytest
from confluent_kafka import KafkaError, KafkaException

from tests.unit.manual_runtime import ManualRuntime
from workers.reassembler.retry import retry_delay, retrying
from workers.telemetry.sensors import ReassemblerStats


def test_the_delay_doubles_from_one_second_up_to_thirty():
    assert [retry_delay(a) for a in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert retry_delay(10_000) == 30


class NoSleep(ManualRuntime):
    def sleep(self, seconds: float) -> None:
        pytest.fail(f"slept {seconds}s")


def _retrying(what, call, *, runtime=None, sensor=None):
    return retrying(what, call, worker_id="w0", sensor=sensor or ReassemblerStats(), runtime=runtime or ManualRuntime())


def test_a_call_failing_while_the_broker_is_down_is_retried_until_it_succeeds(caplog):
    runtime, sensor = ManualRuntime(), ReassemblerStats()
    failures = iter([KafkaError._TIMED_OUT, KafkaError._TRANSPORT, KafkaError.NOT_COORDINATOR])

    def call():
        code = next(failures, None)
        if code is not None:
            raise KafkaException(KafkaError(code, "broker down"))
        return "restored"

    assert _retrying("restore of partition 3", call, runtime=runtime, sensor=sensor) == "restored"
    assert runtime.slept == [1, 2, 4] and sensor.retries == 3, "the backoff is the runtime's sleep"
    assert "w0: restore of partition 3 failed (broker down); retrying in 1s" in caplog.text


@pytest.mark.parametrize(
    "error",
    [KafkaError(KafkaError._FATAL, "fatal", fatal=True), KafkaError(KafkaError._FENCED, "fenced")],
)
def test_a_fatal_or_fenced_failure_is_not_retried(error):
    def call():
        raise KafkaException(error)

    with pytest.raises(KafkaException):
        _retrying("producer", call, runtime=NoSleep())


def test_a_kafka_exception_carrying_only_a_message_is_retried_too():
    calls = iter([KafkaException("topic t not found"), None])

    def call():
        exc = next(calls)
        if exc is not None:
            raise exc
        return "ok"

    assert _retrying("restore", call) == "ok"
