"""Bounded TQ calls: a `TQStore` with a call deadline gives up on a call TQ does not finish in time, the
controller's round trips included, and cancels it there, so it starts no later request; TQ's own
storage-unit retries are bounded too, even in a process that imported TQ first."""

from __future__ import annotations

import time

import pytest
import torch
from tensordict import TensorDict

from streams.errors import TQTimeout
from streams.tq import STAGING, TQStore, bound_tq_calls, with_call_deadline
from tests.unit.fake_tq import FakeTQ
from tests.unit.memory_store import InMemoryStore


def _store(tq: FakeTQ, deadline_s: float | None) -> TQStore:
    store = TQStore()
    store._tq = tq
    return with_call_deadline(store, deadline_s) if deadline_s is not None else store


def _rows(n: int = 2) -> TensorDict:
    return TensorDict({"x": torch.arange(n)}, batch_size=[n])


def test_a_put_the_controller_never_answers_is_abandoned_at_the_deadline_and_writes_nothing_later():
    tq = FakeTQ()
    tq.hold_puts = 30.0  # the controller's index lookup goes unanswered
    store = _store(tq, 0.3)
    started = time.monotonic()
    with pytest.raises(TQTimeout, match=r"put of 2 key\(s\) .*0\.3s"):
        store.put(STAGING, ["a", "b"], _rows(), [{}, {}])
    assert time.monotonic() - started < 5.0
    # Cancelled where it waited: the storage write after the controller's answer never happens.
    assert tq.puts_cancelled == 1 and tq.rows == {}
    tq.hold_puts = None
    store.put(STAGING, ["a", "b"], _rows(), [{}, {}])
    assert sorted(store.list(STAGING)) == ["a", "b"]


def test_a_store_without_a_deadline_waits_as_long_as_tq_does():
    tq = FakeTQ()
    tq.hold_puts = 0.5
    store = _store(tq, None)
    store.put(STAGING, ["a"], _rows(1), [{}])
    assert tq.puts_cancelled == 0 and sorted(store.list(STAGING)) == ["a"]


def test_a_storage_unit_that_stopped_answering_is_a_tq_timeout_too():
    from transfer_queue.storage.managers.simple_storage_manager import StorageUnitTimeout

    tq = FakeTQ()

    async def unanswered(**_):
        raise StorageUnitTimeout("no answer in 5s during put to storage unit SU0")

    tq.async_kv_batch_put = unanswered
    with pytest.raises(TQTimeout, match="SU0"):
        _store(tq, 10.0).put(STAGING, ["a"], _rows(1), [{}])


def test_only_a_tq_store_gets_a_deadline():
    memory = InMemoryStore()
    assert with_call_deadline(memory, 1.0) is memory
    with pytest.raises(ValueError, match="positive"):
        with_call_deadline(memory, 0.0)


def test_storage_unit_attempts_are_bounded_in_a_process_that_imported_tq_already(monkeypatch):
    from transfer_queue.storage.managers import simple_storage_manager as ssm

    monkeypatch.setattr(ssm, "TQ_SIMPLE_STORAGE_MAX_ATTEMPTS", 3)
    monkeypatch.setattr(ssm, "TQ_SIMPLE_STORAGE_SEND_RECV_TIMEOUT", 200)
    for name in ("TQ_SIMPLE_STORAGE_MAX_ATTEMPTS", "TQ_SIMPLE_STORAGE_SEND_RECV_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    bound_tq_calls(12.0)
    assert (ssm.TQ_SIMPLE_STORAGE_MAX_ATTEMPTS, ssm.TQ_SIMPLE_STORAGE_SEND_RECV_TIMEOUT) == (2, 6)
