"""A trainer batch joining a VLM group (rows with packed media) and a text group (rows without)."""

import pytest
import torch

from schemas.errors import InvalidArgument
from schemas.finalized import FinalizedGroup
from schemas.multimodal import PackedRows
from schemas.payload import Completion, PromptGroupRecord, pack_payload, record_to_train_batch
from streams.tq import TRAIN
from tests.unit.memory_store import InMemoryStore
from workers.trainer.batch import BatchMeta, materialize

PAD = {"input_ids": 0}


def _put(store, group_id, media):
    rows = [
        Completion(
            [
                {"role": "user", "token_ids": torch.tensor([1, 2])},
                {"role": "assistant", "token_ids": torch.tensor([3]), "generation_logprobs": torch.tensor([-1.0])},
            ],
            1.0,
            False,
            True,
            multimodal={"pixel_values": [media]} if media is not None else {},
        )
        for _ in range(2)
    ]
    batch = record_to_train_batch(PromptGroupRecord(torch.tensor([1, 2]), tuple(rows)), pad_value_dict=PAD,
                                  include_message_violation_fields=True)  # fmt: skip
    ids, fields, tags = pack_payload(batch, weight_version=0, group_id=group_id, prompt_idx=0)
    store.put(TRAIN, ids, fields, tags)
    return FinalizedGroup(
        group_id=group_id, prompt_idx=0, partition_id=TRAIN, sample_ids=tuple(ids), tags=tuple(tags),
        group_min_wv=0, group_max_wv=0, canonical_output_tokens=2, valid_row_count=2, total_row_count=2,
        rejection_reasons=(None, None), dropped=False, drop_reason=None, metrics={}, source=None,
    )  # fmt: skip


def test_a_text_group_and_a_vlm_group_materialize_together():
    store = InMemoryStore()
    pixels = torch.randn(3, 4).to(torch.bfloat16)
    text, vlm = _put(store, "t", None), _put(store, "v", pixels)
    meta = BatchMeta(0, (text, vlm), ((0, 0), (0, 1)), TRAIN)
    batch = materialize(store, meta, pad_value_dict=PAD)
    assert batch["input_ids"].shape == (4, 3)
    media = PackedRows.from_wire(batch["pixel_values"], meta.tags, "pixel_values")
    assert [len(r) for r in media.rows] == [0, 0, 1, 1]
    assert torch.equal(media.rows[2][0].view(torch.int16), pixels.view(torch.int16))


def test_a_selected_media_field_some_groups_lack_comes_back_as_their_empty_rows():
    store = InMemoryStore()
    pixels = torch.randn(3, 4).to(torch.bfloat16)
    text, vlm = _put(store, "t", None), _put(store, "v", pixels)
    meta = BatchMeta(0, (text, vlm), ((0, 0), (0, 1)), TRAIN)
    batch = materialize(store, meta, fields=["input_ids", "pixel_values"], pad_value_dict=PAD)
    assert set(batch.keys()) == {"input_ids", "pixel_values"}
    media = PackedRows.from_wire(batch["pixel_values"], meta.tags, "pixel_values")
    assert [len(r) for r in media.rows] == [0, 0, 1, 1]
    assert torch.equal(media.rows[3][0].view(torch.int16), pixels.view(torch.int16))


def test_a_selected_field_no_row_holds_is_refused_naming_it_and_the_groups():
    store = InMemoryStore()
    text, vlm = _put(store, "t", None), _put(store, "v", torch.randn(3, 4))
    meta = BatchMeta(0, (text, vlm), ((0, 0), (0, 1)), TRAIN)
    with pytest.raises(InvalidArgument, match=r"'imgs_sizes'.*\bt\b.*\bv\b"):
        materialize(store, meta, fields=["input_ids", "imgs_sizes"], pad_value_dict=PAD)


def test_groups_whose_media_disagree_on_a_dtype_are_refused_naming_the_field_and_groups():
    store = InMemoryStore()
    a, c = _put(store, "a", torch.randn(3, 4).to(torch.bfloat16)), _put(store, "c", torch.randn(3, 4))
    meta = BatchMeta(0, (a, c), ((0, 0), (0, 1)), TRAIN)
    for fields in (None, ["input_ids", "pixel_values"]):
        with pytest.raises(InvalidArgument, match=r"'pixel_values'.*bfloat16.*a.*float32.*c"):
            materialize(store, meta, fields=fields, pad_value_dict=PAD)
    # Each group alone reads as it was put.
    for g in (a, c):
        one = materialize(store, BatchMeta(0, (g,), ((0, 0),), TRAIN), pad_value_dict=PAD)
        assert PackedRows.from_wire(one["pixel_values"], g.tags, "pixel_values").rows[0][0].shape == (3, 4)


def test_the_in_memory_store_refuses_a_selected_field_some_rows_lack_as_tqstore_does():
    store = InMemoryStore()
    text, vlm = _put(store, "t", None), _put(store, "v", torch.randn(3, 4))
    with pytest.raises(ValueError, match="'pixel_values' is not in row 't_g0'"):
        store.get(TRAIN, [*text.sample_ids, *vlm.sample_ids], select=["pixel_values"])
    with pytest.raises(ValueError, match="disagree on their dtype"):
        a = _put(store, "a", torch.randn(3, 4).to(torch.bfloat16))
        store.get(TRAIN, [*vlm.sample_ids, *a.sample_ids], select=["pixel_values"])
