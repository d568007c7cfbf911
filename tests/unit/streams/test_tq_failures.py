"""A TQ controller failure (TQ's client wraps every one in `RuntimeError`) is rlstream's "not now" at the
`TQStore` boundary: `RowsUnsettled` for a read (nothing is known missing), `TQError` for a put or a
clear (nothing known done), so every caller's existing not-now path takes it (issue 30 review
(final), finding 3). A `RuntimeError` of rlstream's own code is not TQ's and stays what it is.

TQ is the fake of tests/unit/fake_tq.py, failing a request as TQ's client reports a controller failure.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from streams.errors import RowsUnsettled, TQError
from streams.tq import STAGING, TRAIN, TQStore
from tests.unit.fake_tq import FakeTQ


@pytest.fixture
def tq():
    return FakeTQ()


@pytest.fixture
def store(tq):
    s = TQStore()
    s._tq = tq
    return s


def _rows(*values: int) -> TensorDict:
    x = torch.tensor(values)
    return TensorDict({"x": x}, batch_size=[len(values)])


@pytest.mark.parametrize("call", ["get", "tags"])
def test_a_read_whose_lookup_fails_at_the_controller_is_unsettled(tq, store, call):
    store.put(TRAIN, ["a", "b"], _rows(1, 2), [{}, {}])
    tq.fail("looked_up")
    with pytest.raises(RowsUnsettled, match="controller did not answer"):
        getattr(store, call)(TRAIN, ["a", "b"])
    assert store.get(TRAIN, ["a", "b"])["x"].tolist() == [1, 2]  # served again once TQ answers


def test_a_put_that_fails_at_the_controller_is_a_tq_error(tq, store):
    tq.fail("put_located")
    with pytest.raises(TQError, match=r"put of 1 key\(s\) to 'rlstream.train'"):
        store.put(TRAIN, ["a"], _rows(1), [{}])
    store.put(TRAIN, ["a"], _rows(1), [{}])  # the retry lands
    assert store.get(TRAIN, ["a"])["x"].tolist() == [1]


@pytest.mark.parametrize("point", ["looked_up", "mark", "release"])
def test_a_clear_that_fails_at_the_controller_is_a_tq_error_and_its_retry_finishes(tq, store, point):
    store.put(STAGING, ["r/0", "r/1"], _rows(1, 2), [{}, {}])
    tq.fail(point)
    with pytest.raises(TQError, match=r"clear of 2 key\(s\)"):
        store.clear(STAGING, ["r/0", "r/1"])
    store.clear(STAGING, ["r/0", "r/1"])  # what the failed clear left (mapped, perhaps marked) goes now
    assert store.list(STAGING) == {} and tq.rows == {}


def test_a_runtime_error_of_rlstreams_own_code_is_not_taken_for_tqs(tq, store):
    store.put(TRAIN, ["a"], _rows(1), [{}])

    def broken(_meta):
        raise RuntimeError("a bug of the caller's, not a TQ failure")

    tq.on("read", broken)  # raised on the hook's thread, re-raised: the raise is not TQ's code
    with pytest.raises(RuntimeError, match="a bug") as err:
        store.get(TRAIN, ["a"])
    assert not isinstance(err.value, TQError)
