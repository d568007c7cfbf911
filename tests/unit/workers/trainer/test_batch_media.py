"""A trainer batch joining a VLM group (rows with packed media) and a text group (rows without)."""

import torch

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
