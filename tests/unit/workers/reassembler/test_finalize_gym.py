"""Finalization of NeMo Gym receipts beside rlstream's in one step: each claim judged on its own, and
every staged row that cannot be read (tags, media) a rejected row, never an exception out of finalize.

Pure (the dict-backed store); NeMo Gym's own capture stages the calls (tests/unit/workers/adapters).
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from schemas.gym_receipt import GymCallRecord, GymReceipt, GymRolloutReceipt
from streams.errors import RowsUnsettled
from streams.tq import STAGING
from tests.unit.memory_store import InMemoryStore
from workers.reassembler.config import default_actor_config
from workers.reassembler.errors import StagingUnstable
from workers.reassembler.finalize import finalize_groups
from workers.reassembler.groups import OpenGroup
from workers.rollout.publisher import stage_rollouts
from workers.rollout.synthetic import SyntheticShape, make_group

SHAPE = SyntheticShape(group_size=2, calls=(1, 1), prompt_len=(2, 4), answer_len=(1, 3), observation_len=(1, 2))
H = "0" * 64


def _rlstream_group(store, group_id):
    rollouts = make_group(group_id, 0, 1, shape=SHAPE)
    stage_rollouts(store, rollouts)
    group = OpenGroup(group_id, 0, 2, rollouts[0].receipt.prompt_idx, 0, 1, 0)
    for i, r in enumerate(rollouts):
        group.receipts[r.receipt.rollout_index] = r.receipt
        group.offsets[r.receipt.rollout_index] = i
    return group, rollouts


def _hostile_gym_group(group_id, rollout_id, call_id):
    """A NeMo Gym receipt of another group naming `{rollout_id}/{call_id}` (its key rule holds)."""
    call = GymCallRecord(
        model_call_id=call_id, prev_len=0, delta_len=1, cum_len=1, weight_version=0, digest=H, extras_digest=H,
        staging_key=f"{rollout_id}/{call_id}", mode="text", chain_hash=H, cumulative_hash=H, response_id="x",
    )  # fmt: skip
    inner = GymRolloutReceipt(
        rollout_id=rollout_id, terminal_model_call_id=call_id, manifest=(call,), terminal_selection="declared"
    )
    receipt = GymReceipt(
        group_id=group_id, prompt_idx=0, rollout_index=0, group_size=1, reward=0.0, mask_sample=True,
        loss_multiplier=1.0, environment="e", receipt=inner,
    )  # fmt: skip
    group = OpenGroup(group_id, 0, 1, 0, 10, 10, 0)
    group.receipts[0] = receipt
    group.offsets[0] = 10
    return group


def test_a_nemo_gym_receipt_of_another_group_naming_an_rlstream_key_does_not_spoil_its_owners_row():
    store = InMemoryStore()
    victim, rollouts = _rlstream_group(store, "a")
    call = rollouts[0].receipt.manifest[0]
    evil = _hostile_gym_group("evil", rollouts[0].receipt.rollout_id, call.call_id)
    assert evil.receipts[0].manifest[0].staging_key == call.staging_key
    by_group = {o.group.group_id: o for o in finalize_groups(
        store, [victim, evil], default_actor_config(), receipts_topic="t", now_ms=0
    )}  # fmt: skip
    owner = by_group["a"].finalized
    assert owner is not None and owner.rejection_reasons == (None, None)
    assert call.staging_key in by_group["a"].staging_keys
    # The hostile receipt's claim is its own: not its row, so missing, and not cleared under it.
    assert by_group["evil"].finalized is None and "missing_staging_row" in by_group["evil"].dead_letter_message
    assert call.staging_key not in by_group["evil"].staging_keys


@pytest.mark.parametrize("order", ["victim_first", "evil_first"])
def test_the_owners_row_is_the_same_whichever_group_comes_first_in_the_step(order):
    store = InMemoryStore()
    victim, rollouts = _rlstream_group(store, "a")
    alone = finalize_groups(store, [victim], default_actor_config(), receipts_topic="t", now_ms=0)[0].finalized
    call = rollouts[1].receipt.manifest[-1]
    evil = _hostile_gym_group("evil", rollouts[1].receipt.rollout_id, call.call_id)
    groups = [victim, evil] if order == "victim_first" else [evil, victim]
    (owner,) = [o for o in finalize_groups(store, groups, default_actor_config(), receipts_topic="t", now_ms=0)
                if o.group.group_id == "a"]  # fmt: skip
    assert owner.finalized.rejection_reasons == alone.rejection_reasons == (None, None)
    assert owner.finalized.canonical_output_tokens == alone.canonical_output_tokens


# --- malformed NeMo Gym staged rows (their tags or fields): a rejected row, never a crash ---------------------------


def _nested_msgpack(depth: int) -> torch.Tensor:
    """MessagePack of a list nested `depth` deep (a decoder recursing on it overflows the stack)."""
    return torch.frombuffer(bytearray(b"\x91" * depth + b"\xc0"), dtype=torch.uint8)


MALFORMED = {
    "attachments_not_a_mapping": (lambda t: t.update(attachments=5), None),
    "negative_shape_over_matching_bytes": (
        lambda t: t.update(attachments={"pixel_values": {"dtype": "uint8", "shape": [-2, -2]}}),
        {"attach__pixel_values": torch.zeros(4, dtype=torch.uint8)},
    ),
    "dtype_not_a_string": (lambda t: t.update(attachments={"pixel_values": {"dtype": ["x"], "shape": [4]}}), None),
    "shape_a_string": (lambda t: t.update(attachments={"pixel_values": {"dtype": "uint8", "shape": "ab"}}), None),
    "shape_of_floats": (lambda t: t.update(attachments={"pixel_values": {"dtype": "uint8", "shape": [2.5, 2]}}), None),
    "too_many_dims": (lambda t: t.update(attachments={"pixel_values": {"dtype": "uint8", "shape": [1] * 65}}), None),
    "attachment_name_not_a_name": (lambda t: t.update(attachments={"../x": {"dtype": "uint8", "shape": [1]}}), None),
    "spec_not_a_mapping": (lambda t: t.update(attachments={"pixel_values": [1, 2]}), None),
    "attachment_named_like_a_row_field": (
        lambda t: t.update(attachments={"sample_mask": t["attachments"]["pixel_values"]}),
        {"attach__sample_mask": "attach__pixel_values"},
    ),
    "call_id_unhashable": (lambda t: t.update(call_id=["c1"]), None),
    "has_extras_not_a_bool": (lambda t: t.update(has_extras="yes"), None),
    "prev_len_not_an_int": (lambda t: t.update(prev_len=[0, 0]), None),
    "parent_not_a_string": (lambda t: t.update(parent_call_id={"c": 0}), None),
}


def _restage(store, key, change_tags, fields=None):
    tags = store.tags(STAGING, [key])[key]
    row = {name: value[0] for name, value in store.get(STAGING, [key]).items()}
    change_tags(tags)
    # A field given as a name is that field of the row, renamed.
    row.update({k: row.pop(v) if isinstance(v, str) else v for k, v in (fields or {}).items()})
    store.clear(STAGING, [key])
    store.put(STAGING, [key], TensorDict({k: v[None] for k, v in row.items()}, batch_size=[1]), [tags])


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_malformed_nemo_gym_staged_row_is_a_rejected_row_not_a_crash(name):
    capture = pytest.importorskip("tests.unit.workers.adapters.test_nemo_gym_capture")
    store = InMemoryStore()
    group, theirs = capture.captured_group(store, "g", [{}, {"vlm": True}])
    change, fields = MALFORMED[name]
    _restage(store, theirs[1].manifest[-1].staging_key, change, fields)
    (outcome,) = finalize_groups(store, [group], default_actor_config(), receipts_topic="t", now_ms=0)
    assert outcome.finalized is not None, outcome.dead_letter_message
    assert outcome.finalized.rejection_reasons == (None, "invalid_staging_row")


def test_extras_nested_past_any_stack_do_not_crash_finalize():
    capture = pytest.importorskip("tests.unit.workers.adapters.test_nemo_gym_capture")
    store = InMemoryStore()
    group, theirs = capture.captured_group(store, "g", [{}, {"vlm": True}])
    _restage(store, theirs[1].manifest[-1].staging_key, lambda t: None, {"gym_extras": _nested_msgpack(100_000)})
    (outcome,) = finalize_groups(store, [group], default_actor_config(), receipts_topic="t", now_ms=0)
    # Finalize never reads extras (no row field comes from them; their digest is in the row's, which
    # verified): the row trains. Where extras are read, they are a clear error (the source's test below).
    assert outcome.finalized.rejection_reasons == (None, None)


def test_a_malformed_staged_row_in_a_worker_step_rejects_its_row_and_the_partition_keeps_flowing():
    from schemas.finalized import FinalizedGroup
    from streams.partitioner import partition_of

    from .steps import NAMES, RecordingStore, make_broker, publish, steps, worker

    capture = pytest.importorskip("tests.unit.workers.adapters.test_nemo_gym_capture")
    broker, store = make_broker(), RecordingStore()
    group, theirs = capture.captured_group(store, "bad", [{}, {"vlm": True}])
    _restage(store, theirs[1].manifest[-1].staging_key, MALFORMED["attachments_not_a_mapping"][0])
    part = partition_of(b"bad", 2)
    for r in group.by_index():
        broker.append(NAMES.receipts, part, b"bad", r.to_bytes())
    # A later group of the same partition: it must still be finalized.
    after = next(f"ok{i}" for i in range(100) if partition_of(f"ok{i}".encode(), 2) == part)
    publish(broker, store, after)
    w = worker(broker, store)
    steps(w, 2)
    records = {r.group_id: r for r in (FinalizedGroup.from_bytes(m.value()) for m in broker.records(NAMES.finalized))}
    assert set(records) == {"bad", after}
    assert records["bad"].rejection_reasons == (None, "invalid_staging_row")
    assert records[after].valid_row_count == 2
    assert store.list(STAGING) == {}  # both groups' staging cleared after their commit


# --- what is read: only what a row is built from ---------------------------------------------------------------------


class _Selects(InMemoryStore):
    """Records the fields each get of the staging partition selects."""

    def __init__(self) -> None:
        super().__init__()
        self.selects: list[tuple[str, ...]] = []

    def get(self, partition, keys, select=None):
        if partition == STAGING:
            self.selects.append(tuple(select) if select is not None else ("*",))
        return super().get(partition, keys, select)


def test_finalize_reads_a_nemo_gym_rows_tokens_and_media_but_not_its_extras():
    capture = pytest.importorskip("tests.unit.workers.adapters.test_nemo_gym_capture")
    store = _Selects()
    group, _ = capture.captured_group(store, "g", [{}, {"vlm": True}])
    (outcome,) = finalize_groups(store, [group], default_actor_config(), receipts_topic="t", now_ms=0)
    assert outcome.finalized.rejection_reasons == (None, None)
    read = {name for select in store.selects for name in select}
    assert "gym_extras" not in read and "*" not in read
    assert "attach__pixel_values" in read  # the media a row carries is read with its tokens


def test_the_source_reads_a_base_snapshot_without_extras_or_media_and_extras_only_when_asked():
    capture = pytest.importorskip("tests.unit.workers.adapters.test_nemo_gym_capture")
    from workers.adapters.nemo_gym_staging import TQStagingSource

    store = _Selects()
    _, theirs = capture.captured_group(store, "g", [{"vlm": True}])
    keys = [c.staging_key for c in theirs[0].manifest]
    source = TQStagingSource(store)
    source.fetch(keys)
    assert {n for s in store.selects for n in s} == {
        "token_ids_delta",
        "token_mask_delta",
        "generation_log_probs_delta",
    }
    store.selects.clear()
    (_, full) = source.fetch_records(keys)
    assert full.extras == {"media_spans": [[0, 1]]}
    assert "gym_extras" in {n for s in store.selects for n in s}
    assert not any(n.startswith("attach__") for s in store.selects for n in s)


def test_extras_nested_past_the_stack_are_a_clear_error_of_the_source_naming_the_row():
    capture = pytest.importorskip("tests.unit.workers.adapters.test_nemo_gym_capture")
    from workers.adapters.nemo_gym_staging import TQStagingSource

    store = InMemoryStore()
    _, theirs = capture.captured_group(store, "g", [{"vlm": True}])
    key = theirs[0].manifest[-1].staging_key
    _restage(store, key, lambda t: None, {"gym_extras": _nested_msgpack(100_000)})
    with pytest.raises(ValueError, match=rf"{key}.*extras do not decode"):
        TQStagingSource(store).fetch_records([key])


# --- rows TQ cannot settle now: the step is rebuilt, never a crash nor a missing row ---------------------------------


class _Unsettled(InMemoryStore):
    """Every get of the staging partition's rows finds them moving (TQ's `RowsUnsettled`)."""

    def get(self, partition, keys, select=None):
        if partition == STAGING:
            raise RowsUnsettled(f"rows of {len(keys)} key(s) of TQ partition {partition!r} kept moving")
        return super().get(partition, keys, select)


def test_nemo_gym_rows_that_keep_moving_abort_the_step_instead_of_ending_the_worker():
    capture = pytest.importorskip("tests.unit.workers.adapters.test_nemo_gym_capture")
    store = _Unsettled()
    group, _ = capture.captured_group(store, "g", [{}, {}])
    with pytest.raises(StagingUnstable, match="could not be read as theirs now"):
        finalize_groups(store, [group], default_actor_config(), receipts_topic="t", now_ms=0)
