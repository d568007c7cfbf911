"""The parts of verl's agent-loop worker (verl_rollout.py) that run without verl: what happens to verl's
prompt key once the group is published (issue 30 review, item 6)."""

from __future__ import annotations

import asyncio

import torch
from tensordict import TensorDict

from streams.tq import STAGING, TRAIN, TQStore
from tests.unit.fake_tq import FakeTQ
from workers.adapters.verl_rollout import VERL_TRAIN, settle_prompt


def _store(tq: FakeTQ) -> TQStore:
    store = TQStore()
    store._tq = tq
    return store


def test_a_published_prompts_key_is_cleared_by_the_checked_clear_never_by_a_stale_lookup():
    # The worker's lookup of verl's prompt key went stale: the key was cleared meanwhile (verl's own
    # clear of its partition, say) and TQ handed its index to an rlstream train row. TQ's own clear
    # deletes storage by that index in every partition: rlstream.train's row with it.
    tq = FakeTQ()
    store = _store(tq)
    store.put(VERL_TRAIN, ["uid-1"], TensorDict({"x": torch.tensor([1])}, [1]), [{}])
    index = tq.where[VERL_TRAIN, "uid-1"]

    def meanwhile(_meta):
        tq.kv_clear(["uid-1"], VERL_TRAIN)
        store.put(TRAIN, ["g_g0"], TensorDict({"x": torch.tensor([7])}, [1]), [{"group_id": "g"}])
        assert tq.where[TRAIN, "g_g0"] == index

    tq.on("mark", meanwhile)
    asyncio.run(settle_prompt(tq, store, "uid-1", reaches_trainer=True))
    assert store.get(TRAIN, ["g_g0"])["x"].tolist() == [7]
    assert "uid-1" not in store.list(VERL_TRAIN) and STAGING not in {p for p, _ in tq.where}
