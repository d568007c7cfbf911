"""The TQ model's faults as an explorer drives them: calls given up at their deadline whose requests land
later, storage units that do not answer, a clear frozen between its steps, a whole-job loss. Through
rlstream's own `TQStore` where it makes the calls; a checkpoint's spill of a staged row caught mid-put."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from streams.errors import MissingKeysError, RowsUnsettled, TQTimeout
from streams.tq import STAGING, TRAIN, TQStore, with_call_deadline
from tests.tools.sim.env import ManualEnv
from tests.tools.sim.tq import JobLost, SimTQ
from workers.trainer.spill import spill_rows
from workers.trainer.spill_read import read_spill


def _values(td: TensorDict) -> list[list[int]]:
    return [row.tolist() for row in td["input_ids"].unbind()]


def _rows(n: int, base: int = 0) -> TensorDict:
    return TensorDict({"input_ids": torch.arange(base, base + 3 * n).reshape(n, 3)}, batch_size=[n])


def test_a_put_given_up_at_its_deadline_lands_later_without_its_tags():
    env = ManualEnv()
    tq = SimTQ(env)
    store = with_call_deadline(TQStore(tq=tq.module("w")), 2.0)
    stop = env.hold(lambda r: r.name == "tq.controller.notify_data_update")
    with pytest.raises(TQTimeout):
        store.put(TRAIN, ["k"], _rows(1), [{"group": "g"}])
    assert store.list(TRAIN) == {"k": {}}  # allocated: listed, no tags, no data ready
    assert (
        not tq.module("r")
        .get_client()
        ._run_coroutine(tq.module("r").get_client().async_kv_retrieve_meta(["k"], TRAIN))
        .is_ready
    )
    stop()
    env.release()  # the controller gets to the notice long after the caller left
    assert store.tags(TRAIN, ["k"]) == {"k": {}}
    assert _values(store.get(TRAIN, ["k"])) == [[0, 1, 2]]


def test_a_storage_unit_that_does_not_answer_times_out_after_every_attempt_and_each_attempt_may_land():
    env = ManualEnv()
    tq = SimTQ(env)
    tq.bound_calls(4.0, attempts=2)
    store = TQStore(tq=tq.module("w"))
    t0 = env.now()
    env.hold(lambda r: r.name == "tq.storage.put_data")
    with pytest.raises(TQTimeout):
        store.put(STAGING, ["s"], _rows(1), [{"rollout_id": "r"}])
    assert env.now() - t0 == pytest.approx(4.0) and len(env.held) == 2
    env.release()
    assert tq.data_indexes() == {0}  # both attempts wrote the same row, at the index allocated


def test_a_clear_frozen_between_its_lookup_and_its_storage_step_deletes_the_next_owners_row():
    """Issue 30 item 1(a), as the model lets an explorer drive it: the background clear's storage
    request is held, a successor clears the same key, a train put takes its index, then the held
    request lands."""
    env = ManualEnv()
    tq = SimTQ(env)
    zombie, successor = TQStore(tq=tq.module("zombie")), TQStore(tq=tq.module("successor"))
    successor.put(STAGING, ["r1/c0"], _rows(1), [{"rollout_id": "r1"}])
    stop = env.hold(lambda r: r.name == "tq.storage.clear_data" and r.details["client"] == "zombie")
    frozen = with_call_deadline(zombie, 1.0)
    with pytest.raises(TQTimeout):
        frozen.clear(STAGING, ["r1/c0"])  # marked, its delete on its way, the caller gave up
    stop()
    successor.clear(STAGING, ["r1/c0"])
    successor.put(TRAIN, ["g_g0"], _rows(1, base=100), [{"group": "g"}])
    assert _values(successor.get(TRAIN, ["g_g0"])) == [[100, 101, 102]]
    env.release()  # the zombie's delete lands on the index that changed hands
    client = tq.module("check").get_client()
    meta = client._run_coroutine(client.async_kv_retrieve_meta(["g_g0"], TRAIN))
    assert meta.is_ready and tq.data_indexes() == set()
    with pytest.raises(tq.module("check").StorageKeyNotFoundError):
        client._run_coroutine(client.async_get_data(meta))


def test_a_located_get_after_the_rows_changed_hands_reads_missing_not_another_keys_row():
    env = ManualEnv()
    tq = SimTQ(env)
    trainer, other = TQStore(tq=tq.module("trainer")), TQStore(tq=tq.module("other"))
    trainer.put(TRAIN, ["a_g0"], _rows(1), [{"group": "a"}])
    assert trainer.tags(TRAIN, ["a_g0"])  # the trainer keeps where it found the row
    other.clear(TRAIN, ["a_g0"])
    other.put(TRAIN, ["b_g0"], _rows(1, base=50), [{"group": "b"}])  # the same index, another key
    with pytest.raises(MissingKeysError):
        trainer.get(TRAIN, ["a_g0"])


def test_a_whole_job_loss_empties_tq_and_nothing_of_the_old_job_lands():
    env = ManualEnv()
    tq = SimTQ(env)
    old = TQStore(tq=tq.module("old"))
    old.put(TRAIN, ["k"], _rows(1), [{"group": "g"}])
    stop = env.hold(lambda r: r.name == "tq.controller.kv_retrieve_meta")
    with pytest.raises(TQTimeout):
        with_call_deadline(old, 1.0).put(TRAIN, ["late"], _rows(1), [{"group": "h"}])
    stop()
    tq.lose_everything()
    env.release()  # the old job's allocation arrives at the new TQ: refused, nothing allocated
    fresh = TQStore(tq=tq.module("new"))
    assert fresh.list(TRAIN) == {} and tq.controller.pool.global_index_counter == 0
    with pytest.raises(RowsUnsettled) as lost:  # TQ's client failing, as TQStore reports it: not now
        old.list(TRAIN)
    assert isinstance(lost.value.__cause__, JobLost)
    fresh.put(TRAIN, ["n"], _rows(1), [{"group": "n"}])
    assert fresh.tags(TRAIN, ["n"]) == {"n": {"group": "n"}}


# The requests a put has left when it stops before its controller notice, or before its tags.
_REST_OF_PUT = {
    "notice": ("tq.controller.notify_data_update", "tq.controller.set_custom_meta"),
    "tags": ("tq.controller.set_custom_meta",),
}


def _staged_mid_put(env: ManualEnv, tq: SimTQ, stopped_before: str) -> None:
    """Two staged rows, the second's put stopped before `stopped_before` (held, its caller gone at its deadline)."""
    store = with_call_deadline(TQStore(tq=tq.module("rollout")), 2.0)
    store.put(STAGING, ["g0-r0/c0"], TensorDict({"ids": torch.arange(4)[None]}, batch_size=[1]), [{"group_id": "g0"}])
    stop = env.hold(lambda r: r.name in _REST_OF_PUT[stopped_before])
    with pytest.raises(TQTimeout):
        store.put(
            STAGING, ["g1-r0/c0"], TensorDict({"ids": torch.arange(3)[None]}, batch_size=[1]), [{"group_id": "g1"}]
        )
    stop()


@pytest.mark.parametrize("stopped_before", sorted(_REST_OF_PUT))
def test_a_spill_of_a_staged_row_mid_put_leaves_it_out_or_keeps_the_tags_that_land_after_the_listing(
    tmp_path, stopped_before
):
    # The job-restart drill's bug (main 569288a) on the model's phased put: a checkpoint's spill lists
    # staged rows whose put has its keys allocated and not its tags. Still untagged when read: left out
    # (its group is handed back after a restart). Tagged between the listing and the read: kept with
    # those tags. Spilled with the listing's empty tags, resume put it back a row no group owns.
    env = ManualEnv()
    tq = SimTQ(env)
    _staged_mid_put(env, tq, stopped_before)
    trainer = TQStore(tq=tq.module("trainer"))
    assert trainer.list(STAGING)["g1-r0/c0"] == {}
    (tmp_path / "untagged").mkdir()
    (tmp_path / "tagged").mkdir()
    summary = spill_rows(trainer, tmp_path / "untagged", binding="b", partitions=(STAGING,))
    assert read_spill(tmp_path / "untagged", binding="b").keys(STAGING) == {"g0-r0/c0"} and summary.gone == 1

    # Its put lands once the spill has listed it, before the spill reads its rows.
    landed = []

    def land_after_listing(name: str, details: dict) -> None:
        if details.get("client") == "trainer" and not landed:
            landed.append(name)
            env.release()

    off = env.on_point("tq.controller.kv_retrieve_meta.send", land_after_listing)
    spill_rows(trainer, tmp_path / "tagged", binding="b", partitions=(STAGING,))
    off()
    assert landed
    spill = read_spill(tmp_path / "tagged", binding="b")
    after = TQStore(tq=SimTQ(ManualEnv()).module("resume"))
    if stopped_before == "notice":
        # Its caller gave up before sending the tags: the row reads once the notice lands, and stays
        # untagged (T7), so it is left out again.
        assert spill.keys(STAGING) == {"g0-r0/c0"}
        return
    assert spill.keys(STAGING) == {"g0-r0/c0", "g1-r0/c0"}
    spill.restore(after, STAGING, ["g0-r0/c0", "g1-r0/c0"])
    assert after.tags(STAGING, ["g0-r0/c0", "g1-r0/c0"]) == {
        "g0-r0/c0": {"group_id": "g0"},
        "g1-r0/c0": {"group_id": "g1"},
    }
