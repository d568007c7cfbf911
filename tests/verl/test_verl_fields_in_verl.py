"""rlstream's verl rows through verl 0.9.1's own code: its padding template and its num_turns read.

Runs only under `make test-verl` (.venv-verl has verl; make test never collects tests/verl).
"""

from __future__ import annotations

import numpy as np
import torch
from verl.trainer.ppo.padding_utils import construct_minimal_padding_template
from verl.utils.tensordict_utils import list_of_dict_to_tensordict

from tests.unit.workers.adapters.test_verl_fields import _batch
from workers.adapters.verl_fields import to_verl_rows


def test_verls_padding_rows_and_num_turns_read_work_on_rlstream_rows():
    meta, rows = _batch()
    verl = to_verl_rows(meta, rows, version_offset=2)
    names = list(verl.fields.keys())  # iterating a TensorDict walks its rows, not its keys
    first = {name: verl.fields[name][0] for name in names}
    # verl pads a batch by copying its first real row (upsample_batch_to_divisible_size).
    pad, pad_tag = construct_minimal_padding_template(first, verl.tags[0], eos_token_id=2)
    assert pad_tag["is_padding"] and pad["num_turns"] == 0
    real = [{name: verl.fields[name][i] for name in names} for i in range(len(verl.keys))]
    batch = list_of_dict_to_tensordict([*real, pad])
    # _compute_metrics: np.array(data.pop("num_turns").tolist()); a missing field raised KeyError.
    turns = np.array(batch.pop("num_turns").tolist())
    assert turns.tolist() == [2, 0, 2, 0]  # the rejected rollout and the padding row have no turn
    assert list(batch["uid"])[::2] == ["gA", "gA"]  # tensordict 0.10: a LinkedList, no .tolist()
    assert batch["extra_fields"][0]["min_global_steps"] == 5
    assert batch["prompts"][0].dtype == torch.int64
