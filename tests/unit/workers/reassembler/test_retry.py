"""The worker's retry of Kafka calls it cannot go on without: transient failures wait, fatal ones end it."""

from types import SimpleNamespace

import pytest
from confluent_kafka import KafkaError, KafkaException

from workers.reassembler import retry as retry_module
from workers.reassembler.retry import retry_delay, retrying
from workers.telemetry.sensors import ReassemblerStats


def test_the_delay_doubles_from_one_second_up_to_thirty():
    assert [retry_delay(a) for a in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert retry_delay(10_000) == 30


def _owner():
    return SimpleNamespace(sensor=ReassemblerStats(), config=SimpleNamespace(worker_id="w0"))


def _retrying(owner, what, call):
    return retrying(what, call, worker_id=owner.config.worker_id, sensor=owner.sensor)


def test_a_call_failing_while_the_broker_is_down_is_retried_until_it_succeeds(monkeypatch, caplog):
    slept = []
    monkeypatch.setattr(retry_module.time, "sleep", slept.append)
    failures = iter([KafkaError._TIMED_OUT, KafkaError._TRANSPORT, KafkaError.NOT_COORDINATOR])

    def call():
        code = next(failures, None)
        if code is not None:
            raise KafkaException(KafkaError(code, "broker down"))
        return "restored"

    owner = _owner()
    assert _retrying(owner, "restore of partition 3", call) == "restored"
    assert slept == [1, 2, 4] and owner.sensor.retries == 3
    assert "w0: restore of partition 3 failed (broker down); retrying in 1s" in caplog.text


@pytest.mark.parametrize(
    "error",
    [KafkaError(KafkaError._FATAL, "fatal", fatal=True), KafkaError(KafkaError._FENCED, "fenced")],
)
def test_a_fatal_or_fenced_failure_is_not_retried(monkeypatch, error):
    monkeypatch.setattr(retry_module.time, "sleep", lambda s: pytest.fail("slept"))

    def call():
        raise KafkaException(error)

    with pytest.raises(KafkaException):
        _retrying(_owner(), "producer", call)


def test_a_kafka_exception_carrying_only_a_message_is_retried_too(monkeypatch):
    monkeypatch.setattr(retry_module.time, "sleep", lambda s: None)
    calls = iter([KafkaException("topic t not found"), None])

    def call():
        exc = next(calls)
        if exc is not None:
            raise exc
        return "ok"

    assert _retrying(_owner(), "restore", call) == "ok"
