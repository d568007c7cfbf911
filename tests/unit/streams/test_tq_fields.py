"""TQStore's readiness check: a row TQ is clearing reads as missing, never as an error that crashes a caller."""

import numpy as np
import pytest
from transfer_queue.metadata import BatchMeta

from streams.tq import MissingKeysError, _fields


def _meta(status):
    return BatchMeta(
        global_indexes=[10, 11, 12], partition_ids=["p", "p", "p"], production_status=np.array(status, np.int8)
    )


def test_rows_not_ready_are_reported_missing_by_key():
    # Row 11 is marked for clearing (TQ sets it not ready before deleting it).
    with pytest.raises(MissingKeysError) as caught:
        _fields(_meta([1, 0, 1]), None, "rlstream.staging", ["a", "b", "c"])
    assert caught.value.missing == ["b"] and caught.value.partition == "rlstream.staging"


def test_ready_rows_pass():
    meta = _meta([1, 1, 1])
    assert _fields(meta, None, "p", ["a", "b", "c"]) is meta
