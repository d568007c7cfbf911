"""rlstream's NeMo Gym `StagingSink` and `StagingSource` over a KVStore, against NeMo Gym's own classes.

Pure: the dict-backed store of tests/unit; the same sink and source run on real TQ in
tests/integration/adapters/test_nemo_gym_e2e.py.
"""

import threading

import pytest
import torch

from schemas import gym_digest
from schemas.staged_rows import ATTACHMENT_PREFIX, GROUP_ID_TAG, STAGED_AT_TAG
from streams.tq import STAGING
from tests.unit.memory_store import InMemoryStore
from workers.adapters.nemo_gym_staging import TQStagingSink, TQStagingSource
from workers.rollout.publisher import stage_rollouts
from workers.rollout.synthetic import SyntheticShape, make_group

staging = pytest.importorskip("nemo_gym.token_id_capture.staging", reason="nemo-gym 0.7.0 is not installed")
conformance = pytest.importorskip("nemo_gym.token_id_capture.staging.conformance")


def golden_record():
    vectors = conformance.load_golden_vectors()
    return staging.StagedCallRecord.model_validate(
        {**vectors["staged_call"], "digest": vectors["staged_call_digest"], "extras": vectors["extras"]}
    ), vectors


def root_record(rollout_id="g_g0", call_id="c0", tokens=(1, 2, 3, 4), generated=2, weight_version=1):
    ids = list(tokens)
    carry = len(ids) - generated
    mask = [0.0] * carry + [1.0] * generated
    logprobs = [0.0] * carry + [-0.5] * generated
    fields = dict(
        rollout_id=rollout_id,
        model_call_id=call_id,
        parent_call_id=None,
        mode="text",
        prev_len=0,
        delta_len=len(ids),
        cum_len=len(ids),
        weight_version=weight_version,
        token_ids_delta=ids,
        token_mask_delta=mask,
        generation_log_probs_delta=logprobs,
        extras_digest=gym_digest.EMPTY_EXTRAS_DIGEST,
        chain_hash=gym_digest.compute_chain_hash(None, ids),
        cumulative_hash=gym_digest.hash_token_ids(ids),
        schema_version=2,
        digest_version=2,
        extras_digest_version=1,
    )
    return staging.StagedCallRecord(digest=gym_digest.compute_staging_digest(**fields), **fields)


def test_sink_and_source_satisfy_nemo_gyms_protocols():
    store = InMemoryStore()
    assert isinstance(TQStagingSink(store), staging.StagingSink)
    assert isinstance(TQStagingSource(store), staging.StagingSource)


def test_the_golden_vector_goes_through_the_sink_and_source_and_verifies():
    record, vectors = golden_record()
    store = InMemoryStore()
    sink = TQStagingSink(store, group_of=lambda rollout_id: "group-1")
    result = sink.stage(record)
    assert result.ok and result.staging_key == "rollout-1/call-1"
    tags = store.tags(STAGING, [result.staging_key])[result.staging_key]
    assert tags[GROUP_ID_TAG] == "group-1" and isinstance(tags[STAGED_AT_TAG], int)
    source = TQStagingSource(store)
    (snapshot,) = source.fetch([result.staging_key])
    assert isinstance(snapshot, staging.StagedCallBaseSnapshot)
    assert (
        snapshot.model_dump()
        == staging.StagedCallBaseSnapshot.model_validate(record.model_dump(exclude={"extras"})).model_dump()
    )
    fields = snapshot.model_dump(exclude={"digest"})
    # The fetched row digests to the published value, by NeMo Gym's function and by rlstream's.
    assert staging.compute_staging_digest(**fields) == vectors["staged_call_digest"]
    assert gym_digest.compute_staging_digest(**fields) == vectors["staged_call_digest"]
    (full,) = source.fetch_records([result.staging_key])
    assert full.extras == vectors["extras"]
    assert staging.compute_extras_digest(full.extras) == vectors["extras_digest"] == full.extras_digest


def test_attachments_land_in_the_same_write_and_come_back_bit_for_bit():
    store = InMemoryStore()
    sink, source = TQStagingSink(store), TQStagingSource(store)
    pixels = torch.randn(1, 6, 12).to(torch.bfloat16)
    sizes = torch.tensor([[2, 3]], dtype=torch.int32)
    result = sink.stage(root_record(), attachments={"pixel_values": pixels, "imgs_sizes": sizes})
    assert result.ok
    # One row holds the tokens and both attachments.
    assert set(store._rows[STAGING][result.staging_key][0]) >= {ATTACHMENT_PREFIX + "pixel_values", "token_ids_delta"}
    (got,) = source.fetch_attachments([result.staging_key])
    assert got["pixel_values"].dtype == torch.bfloat16 and got["pixel_values"].shape == pixels.shape
    assert torch.equal(got["pixel_values"].view(torch.int16), pixels.view(torch.int16))
    assert torch.equal(got["imgs_sizes"], sizes)


@pytest.mark.parametrize(
    ("attachments", "reason"),
    [
        ({"Pixel Values": torch.zeros(2)}, "attachment name"),
        ({"pixel_values": [0.1, 0.2]}, "must be a dense torch.Tensor"),
        ({"pixel_values": torch.zeros(2, dtype=torch.complex64)}, "dtype torch.complex64"),
        ([("pixel_values", torch.zeros(2))], "attachments must be a mapping"),
    ],
)
def test_an_attachment_that_cannot_be_stored_whole_rejects_the_call(attachments, reason):
    store = InMemoryStore()
    result = TQStagingSink(store).stage(root_record(), attachments=attachments)
    assert not result.ok and reason in result.error
    assert store.list(STAGING) == {}


@pytest.mark.parametrize(
    "name",
    ["input_ids", "sample_mask", "total_reward", "violation_counts", "invalid_tool_call_mask", "rollout_environment",
     "routed_experts", "prompt_ids_for_adv", "pixel_values__row_shapes"],
)  # fmt: skip
def test_an_attachment_named_like_a_row_field_rejects_the_call_naming_it(name):
    """A row's fields and tags keep their names: media under one of them could never be built."""
    store = InMemoryStore()
    result = TQStagingSink(store).stage(root_record(), attachments={name: torch.zeros(2)})
    assert not result.ok and repr(name) in result.error and "row field" in result.error
    assert store.list(STAGING) == {}


@pytest.mark.parametrize("token", [5.0, True, "5"])
def test_a_record_with_a_token_id_that_is_not_an_int_is_refused_not_converted(token):
    """A record built without NeMo Gym's validation (`model_construct`) could hold 5.0: an int64 row
    would store 5, and the digest NeMo Gym refuses (invalid_snapshot) would then verify."""
    good = root_record()
    record = staging.StagedCallRecord.model_construct(
        **{**good.model_dump(), "token_ids_delta": [token, *good.token_ids_delta[1:]]}
    )
    store = InMemoryStore()
    result = TQStagingSink(store).stage(record)
    assert not result.ok and "token id" in result.error
    assert store.list(STAGING) == {}


def test_a_rollout_whose_group_cannot_be_named_is_rejected_with_the_reason():
    result = TQStagingSink(InMemoryStore()).stage(root_record(rollout_id="rollout-1"))
    assert not result.ok and "is not '{group_id}_g{i}'" in result.error


class _FailingPut(InMemoryStore):
    def put(self, partition, keys, fields, tags):
        super().put(partition, keys, fields, tags)  # half of it landed, then the write failed
        raise RuntimeError("storage unit lost")


def test_a_failed_put_is_reported_and_what_landed_is_cleared():
    store = _FailingPut()
    result = TQStagingSink(store).stage(root_record())
    assert not result.ok and "storage unit lost" in result.error
    assert store.list(STAGING) == {}


def test_stage_is_safe_from_many_threads_at_once():
    store = InMemoryStore()
    sink = TQStagingSink(store)
    results = []

    def stage(i):
        results.append(sink.stage(root_record(rollout_id=f"g_g{i}", tokens=(i, i + 1, i + 2, 7))))

    threads = [threading.Thread(target=stage, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.ok for r in results)
    keys = [f"g_g{i}/c0" for i in range(16)]
    assert [s.token_ids_delta[0] for s in TQStagingSource(store).fetch(keys)] == list(range(16))


def test_fetch_is_in_key_order_and_refuses_missing_and_foreign_rows():
    store = InMemoryStore()
    sink, source = TQStagingSink(store), TQStagingSource(store)
    for i in (0, 1):
        assert sink.stage(root_record(call_id=f"c{i}", tokens=(10 + i, 1, 2), generated=1)).ok
    assert [s.model_call_id for s in source.fetch(["g_g0/c1", "g_g0/c0"])] == ["c1", "c0"]
    with pytest.raises(KeyError, match="g_g0/c9"):
        source.fetch(["g_g0/c0", "g_g0/c9"])
    shape = SyntheticShape(group_size=1, calls=(1, 1), prompt_len=(2, 2), answer_len=(1, 1))
    rollouts = make_group("h", 0, 1, shape=shape)
    stage_rollouts(store, rollouts)  # an rlstream row: not a NeMo Gym call
    with pytest.raises(ValueError, match="not staged as a NeMo Gym call"):
        source.fetch([rollouts[0].receipt.manifest[0].staging_key])
