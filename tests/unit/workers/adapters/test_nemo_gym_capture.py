"""NeMo Gym's own capture (`RolloutTokenCapture`, its ledger and receipts) into rlstream's sink, then
rlstream's finalization: the rows equal what NeMo Gym's `verify_and_linearize` gives.

Pure (the dict-backed store); tests/integration/adapters/test_nemo_gym_e2e.py runs the same flow
on the real broker and TQ.
"""

import pytest
import torch

from schemas.deadletter import ALL_ROLLOUTS_FAILED
from schemas.multimodal import PackedRows
from schemas.payload import unpack_payload
from streams.tq import TRAIN
from tests.unit.memory_store import InMemoryStore
from tests.unit.workers.adapters.gym_sinks import RecordingSink
from workers.adapters.nemo_gym_capture import EngineTurn, SyntheticEngineAdapter, capture_rollout, gym_receipt
from workers.adapters.nemo_gym_staging import TQStagingSink, TQStagingSource
from workers.reassembler.config import default_actor_config
from workers.reassembler.finalize import finalize_groups
from workers.reassembler.groups import OpenGroup

staging = pytest.importorskip("nemo_gym.token_id_capture.staging", reason="nemo-gym 0.7.0 is not installed")

PIXELS = torch.arange(2 * 3 * 12, dtype=torch.float32).reshape(1, 6, 12).to(torch.bfloat16) / 7


def turns(i: int, *, vlm: bool = False, fail: bool = False, attachments=None) -> list[EngineTurn]:
    """Rollout i: two calls; the second runs on `PIXELS` (`vlm`) or on `attachments`, or fails."""
    if vlm:
        attachments = {"pixel_values": PIXELS}
    return [
        EngineTurn([100 + i, 101, 102], [200 + i, 201], [-0.25, -0.5], weight_version=3),
        EngineTurn(
            [300 + i],
            [400 + i, 401, 402],
            [-1.0, -0.125, -2.0],
            weight_version=4,
            attachments=attachments,
            extras={"media_spans": [[0, 1]]} if attachments else None,
            fail=fail,
        ),
    ]


def captured_group(store, group_id, specs, *, sink=None):
    capture = staging.RolloutTokenCapture(
        sink=sink or TQStagingSink(store), weight_version_fn=lambda: 0, adapter=SyntheticEngineAdapter()
    )
    group = OpenGroup(group_id, 0, len(specs), 9, 0, len(specs) - 1, 0)
    theirs = []
    for i, spec in enumerate(specs):
        rollout_id = f"{group_id}_g{i}"
        done = capture_rollout(capture, rollout_id, spec["turns"] if "turns" in spec else turns(i, **spec))
        theirs.append(done.receipt)
        group.receipts[i] = gym_receipt(
            done.receipt, group_id=group_id, prompt_idx=9, rollout_index=i, group_size=len(specs), reward=0.5 * i,
            environment="vision",
        )  # fmt: skip
        group.offsets[i] = i
    return group, theirs


def test_rows_equal_nemo_gyms_verified_rows_and_the_vlm_media_is_bit_exact():
    store = InMemoryStore()
    sink = RecordingSink(TQStagingSink(store))
    group, theirs = captured_group(store, "g", [{}, {"vlm": True}, {"fail": True}], sink=sink)
    (outcome,) = finalize_groups(store, [group], default_actor_config(), receipts_topic="t", now_ms=0)
    record = outcome.finalized
    assert record is not None and record.rejection_reasons == (None, None, "rollout_failed")
    fields = store.get(TRAIN, list(record.sample_ids))
    rows = unpack_payload(fields, record.tags, pad_value_dict={"input_ids": 0})
    source = TQStagingSource(store)
    for i in (0, 1):
        keys = [r.staging_key for r in theirs[i].manifest]
        # NeMo Gym's verifier on the records as NeMo Gym's capture built them, before rlstream's sink;
        # and on what rlstream's source reads back: the same row both ways.
        want = staging.verify_and_linearize(theirs[i], sink.as_built(keys))
        assert staging.verify_and_linearize(theirs[i], source.fetch(keys)) == want
        n = len(want.token_ids)
        assert rows["input_ids"][i, :n].tolist() == want.token_ids
        assert rows["token_mask"][i, :n].tolist() == [m == 1.0 for m in want.token_mask]
        assert torch.equal(rows["generation_logprobs"][i, :n], torch.tensor(want.logprobs, dtype=torch.float32))
        assert record.tags[i]["rollout_environment"] == "vision"
    media = PackedRows.from_wire(rows["pixel_values"], record.tags, "pixel_values")
    assert [len(r) for r in media.rows] == [0, 1, 0]
    staged = sink.attachments[theirs[1].manifest[-1].staging_key]["pixel_values"]
    assert torch.equal(media.rows[1][0].view(torch.int16), staged.view(torch.int16))
    assert torch.equal(staged.view(torch.int16), PIXELS.view(torch.int16))
    with pytest.raises(staging.ReceiptVerificationError, match="rollout_failed"):
        staging.verify_and_linearize(theirs[2], [])


def test_a_group_of_failed_captures_is_dead_lettered_or_published_as_placeholders():
    store = InMemoryStore()
    group, _ = captured_group(store, "f", [{"fail": True}, {"fail": True}])
    (outcome,) = finalize_groups(store, [group], default_actor_config(), receipts_topic="t", now_ms=0)
    assert outcome.finalized is None and outcome.dead_letter_kind == ALL_ROLLOUTS_FAILED
    (outcome,) = finalize_groups(
        store, [group], default_actor_config(), receipts_topic="t", now_ms=0, placeholder_groups=True
    )
    assert outcome.finalized.valid_row_count == 0 and outcome.finalized.sample_ids == ("f_g0", "f_g1")
    fields = store.get(TRAIN, ["f_g0", "f_g1"])
    assert fields["sample_mask"].tolist() == [0.0, 0.0]


def test_an_attachment_named_like_a_row_field_fails_that_capture_not_the_group():
    """NeMo Gym reports the call capture_failed when the sink refuses it: that rollout's row is
    rollout_failed, and the group's other rows train."""
    store = InMemoryStore()
    group, theirs = captured_group(store, "g", [{}, {"attachments": {"input_ids": torch.ones(2, 3)}}, {"vlm": True}])
    assert theirs[1].capture_poisoned
    (outcome,) = finalize_groups(store, [group], default_actor_config(), receipts_topic="t", now_ms=0)
    assert outcome.finalized is not None, outcome.dead_letter_message
    assert outcome.finalized.rejection_reasons == (None, "rollout_failed", None)


def test_rollouts_whose_media_disagree_on_a_dtype_reject_the_later_row_not_the_group():
    store = InMemoryStore()
    f32 = PIXELS.to(torch.float32)
    group, _ = captured_group(store, "g", [{}, {"vlm": True}, {"attachments": {"pixel_values": f32}}, {"vlm": True}])
    (outcome,) = finalize_groups(store, [group], default_actor_config(), receipts_topic="t", now_ms=0)
    record = outcome.finalized
    assert record is not None, outcome.dead_letter_message
    # The field's dtype is its first valid row's (rollout order): the float32 row is the odd one.
    assert record.rejection_reasons == (None, None, "inconsistent_media", None)
    rows = unpack_payload(store.get(TRAIN, list(record.sample_ids)), record.tags, pad_value_dict={"input_ids": 0})
    media = PackedRows.from_wire(rows["pixel_values"], record.tags, "pixel_values")
    assert [len(r) for r in media.rows] == [0, 1, 0, 1]
    assert all(s.dtype == torch.bfloat16 for r in media.rows for s in r)


def _media_turns(media_call: int) -> list[EngineTurn]:
    """Two calls of 3 carried + 2 generated tokens (rows [0, 5) and [5, 10)); call `media_call` runs on PIXELS."""
    return [
        EngineTurn([1, 2, 3], [4, 5], [-0.5, -0.25], weight_version=1,
                   attachments={"pixel_values": PIXELS} if media_call == 0 else None),
        EngineTurn([6, 7, 8], [9, 10], [-1.0, -2.0], weight_version=1,
                   attachments={"pixel_values": PIXELS} if media_call == 1 else None),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("max_seq_len", "length", "media"),
    [
        (10, 10, True),  # not cut
        (9, 9, True),  # cut in the media call's generated tokens: the tokens its media stands for are all in
        (7, 5, False),  # cut inside the tokens the media call was fed: cut before that call, its media with it
        (5, 5, False),  # cut where the media call begins: nothing of it is left, nor of its media
    ],
)
def test_a_truncated_row_keeps_the_media_of_only_the_calls_whose_fed_tokens_it_keeps(max_seq_len, length, media):
    import msgspec

    store = InMemoryStore()
    group, _ = captured_group(store, "g", [{"turns": _media_turns(1)}, {}])
    config = msgspec.structs.replace(default_actor_config(), max_seq_len=max_seq_len)
    (outcome,) = finalize_groups(store, [group], config, receipts_topic="t", now_ms=0)
    record = outcome.finalized
    assert record.rejection_reasons == (None, None)
    rows = unpack_payload(store.get(TRAIN, list(record.sample_ids)), record.tags, pad_value_dict={"input_ids": 0})
    assert int(rows["input_lengths"][0]) == length
    assert bool(rows["truncated"][0]) == (max_seq_len < 10)
    assert rows["input_ids"][0, :length].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10][:length]
    if media:
        assert record.tags[0]["pixel_values__row_shapes"]["shapes"] == [list(PIXELS.shape)]
    else:
        assert "pixel_values" not in rows and "pixel_values__row_shapes" not in record.tags[0]


def test_a_row_whose_prompt_with_its_media_is_longer_than_max_seq_len_is_rejected():
    import msgspec

    store = InMemoryStore()
    group, _ = captured_group(store, "g", [{"turns": _media_turns(0)}, {}])
    config = msgspec.structs.replace(default_actor_config(), max_seq_len=2)
    (outcome,) = finalize_groups(store, [group], config, receipts_topic="t", now_ms=0)
    assert outcome.finalized.rejection_reasons == ("truncated_media", None)
