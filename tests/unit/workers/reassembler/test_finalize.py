"""Finalization against a store whose rows vanish under it: missing rows become placeholders, or the step aborts."""

import pytest

from streams.tq import STAGING
from tests.unit.memory_store import InMemoryStore
from workers.reassembler.errors import StagingUnstable
from workers.reassembler.staged_fetch import fetch_segments
from workers.rollout.publisher import stage_rollouts
from workers.rollout.synthetic import SyntheticShape, make_group

SHAPE = SyntheticShape(group_size=4, calls=(1, 1), prompt_len=(2, 4), answer_len=(1, 3), observation_len=(1, 2))


class _Vanishing(InMemoryStore):
    """Its first `losses` gets each lose the first requested key, as an owner clearing it concurrently would."""

    def __init__(self, losses: int) -> None:
        super().__init__()
        self.losses = losses

    def get(self, partition, keys, select=None):
        if self.losses:
            self.losses -= 1
            self.clear(partition, [keys[0]])
        return super().get(partition, keys, select)


def _staged(store):
    rollouts = make_group("g", 0, 1, shape=SHAPE)
    stage_rollouts(store, rollouts)
    return [c.staging_key for r in rollouts for c in r.receipt.manifest]


def test_a_key_vanishing_again_on_the_retry_is_left_missing_and_the_rest_fetched():
    store = _Vanishing(losses=2)
    keys = _staged(store)
    assert sorted(fetch_segments(store, STAGING, keys)) == sorted(keys[2:])


def test_a_store_that_keeps_losing_keys_aborts_the_step_instead_of_finalizing_without_rows():
    store = _Vanishing(losses=10)
    keys = _staged(store)
    with pytest.raises(StagingUnstable, match="kept vanishing"):
        fetch_segments(store, STAGING, keys)


class _Recording(InMemoryStore):
    """Records the keys of each tags lookup and each get."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[str]]] = []

    def tags(self, partition, keys):
        self.calls.append(("tags", list(keys)))
        return super().tags(partition, keys)

    def get(self, partition, keys, select=None):
        self.calls.append(("get", list(keys)))
        return super().get(partition, keys, select)


def test_rows_are_fetched_by_exactly_the_keys_and_order_their_tags_were_looked_up_by():
    # TQStore fetches a get of the very keys of its last tags lookup without a second lookup.
    from tests.unit.workers.reassembler.test_task import CONFIG, TIMEOUT_MS, make_task, record, staged
    from workers.reassembler.finalize import finalize_groups

    store = _Recording()
    task = make_task(store)
    offset = 0
    for gid in ("a", "b", "c"):
        for r in staged(store, gid):
            task.intake(record(offset, r.to_bytes()), 5_000)
            offset += 1
    ready = task.ready(5_000, TIMEOUT_MS)
    assert len(ready) == 3
    store.calls.clear()
    finalize_groups(store, ready, CONFIG.actor, receipts_topic=CONFIG.receipts_topic, now_ms=5_000)
    (kind1, looked_up), (kind2, fetched) = store.calls[:2]
    assert (kind1, kind2) == ("tags", "get") and len(looked_up) > 3
    assert fetched == looked_up


def test_a_group_whose_routed_experts_hold_no_expert_per_token_is_dead_lettered_and_nothing_is_put():
    """A [delta_len, 0] routed_experts passes every staging check; its rows cannot be packed. As on the
    message-log path the group is dead-lettered (inconsistent_group), never put as a row no reader can
    unpack, nor raised out of the step."""
    import msgspec

    from streams.tq import TRAIN
    from tests.unit.schemas.chains import make_rollout
    from tests.unit.workers.reassembler.test_task import CONFIG
    from workers.reassembler.finalize import finalize_groups
    from workers.reassembler.groups import PromptGroups
    from workers.rollout.publisher import StagedRollout

    store, groups = InMemoryStore(), PromptGroups(0)
    for i in range(2):
        receipt, segments = make_rollout(
            [(2, 3)], rollout_id=f"r{i}", group_id="g", rollout_index=i, group_size=2, prompt_idx=1, experts_k=0
        )
        stage_rollouts(store, [StagedRollout(receipt, list(segments.values()))], STAGING)
        groups.add(receipt, i, 0)
    actor = msgspec.structs.replace(CONFIG.actor, staging_partition=STAGING, router_replay_enabled=True)
    (outcome,) = finalize_groups(store, [groups.open["g"]], actor, receipts_topic="t", now_ms=0)
    assert outcome.finalized is None and outcome.dead_letter_kind == "inconsistent_group"
    assert "routed_experts" in outcome.dead_letter_message and "(0,)" in outcome.dead_letter_message
    assert store.list(TRAIN) == {}, "no train row put"
