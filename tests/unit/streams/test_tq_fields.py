"""TQStore's readiness check: a row TQ is clearing is told apart by position, so `get` reports it missing
(MissingKeysError naming the key) instead of raising an error that crashed a caller."""

import numpy as np
import pytest
from transfer_queue.metadata import BatchMeta

from streams.tq_read import _fields, _NotReady


def _meta(status):
    return BatchMeta(
        global_indexes=[10, 11, 12], partition_ids=["p", "p", "p"], production_status=np.array(status, np.int8)
    )


def test_rows_not_ready_are_named_by_their_position_in_the_read():
    # Row 11 is marked for clearing (TQ sets it not ready before deleting it).
    with pytest.raises(_NotReady) as caught:
        _fields(_meta([1, 0, 1]), None)
    assert caught.value.positions == [1]


def test_ready_rows_pass():
    meta = _meta([1, 1, 1])
    assert _fields(meta, None) is meta
