"""rlstream's whole NeMo Gym path against NeMo Gym's `verify_and_linearize`, on generated cases with media.

Each case (`tests/unit/schemas/gym_cases.py`: random call trees, varied ids, manifests out of tree
order, one or two corruptions) has its staged calls handed to rlstream's `TQStagingSink` as NeMo
Gym's `StagedCallRecord`s, some with attachments (media of two dtypes at times), and its receipt
finalized by rlstream's reassembler (`finalize_groups`: the ownership check, the fetch, the
verification, the build). The row must be what NeMo Gym's verifier gives for the records as they
were staged, read through a keyed source as NeMo RL's finalizer reads them (a key nothing was
staged under is `missing_staging_row`; receipt-level refusals come first), with the chain's media
bit for bit; or the refusal must carry the same code.
"""

from __future__ import annotations

import random
from collections import Counter

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.errors import SchemaError
from schemas.gym_receipt import GymReceipt, GymRolloutReceipt
from schemas.multimodal import PackedRows
from schemas.payload import unpack_payload
from streams.tq import TRAIN
from tests.unit.memory_store import InMemoryStore
from tests.unit.schemas.gym_cases import KINDS, make_case
from workers.adapters.nemo_gym_staging import TQStagingSink
from workers.reassembler.config import default_actor_config
from workers.reassembler.finalize import finalize_groups
from workers.reassembler.groups import OpenGroup

staging = pytest.importorskip("nemo_gym.token_id_capture.staging", reason="nemo-gym 0.7.0 is not installed")
pydantic = pytest.importorskip("pydantic")

# Generated cases per run through the whole path (the verifier alone runs 1,200: test_gym_differential).
CASES = 500
# Refusals NeMo RL's finalizer reaches from the receipt alone, before it fetches a staged row.
RECEIPT_LEVEL = {
    "unsupported_schema",
    "unsupported_digest",
    "unsupported_extras_digest",
    "rollout_failed",
    "capture_poisoned",
    "empty_manifest",
    "duplicate_manifest_row",
    "duplicate_staging_key",
}


def _media(rng: random.Random, n: int) -> dict[int, dict[str, torch.Tensor]]:
    """Attachments for some of n calls: pixels (bfloat16, float32 at times) and image sizes."""
    out = {}
    for i in range(n):
        if rng.random() < 0.4:
            rows = rng.randint(1, 4)
            dtype = torch.float32 if rng.random() < 0.1 else torch.bfloat16
            g = torch.Generator().manual_seed(rng.randrange(2**31))
            media = {"pixel_values": torch.randn(1, rows, 12, generator=g).to(dtype)}
            if rng.random() < 0.5:
                media["imgs_sizes"] = torch.tensor([[rows, 12]], dtype=torch.int32)
            out[i] = media
    return out


def _theirs(receipt, staged: dict, keys: list[str]):
    """NeMo Gym's outcome through a keyed source: a row, or a refusal's code."""
    try:
        staging.verify_and_linearize(receipt, [])
    except staging.ReceiptVerificationError as exc:
        if exc.code in RECEIPT_LEVEL:
            return exc.code
    if any(k not in staged for k in keys):
        return "missing_staging_row"
    try:
        return staging.verify_and_linearize(receipt, [staged[k][0] for k in keys])
    except staging.ReceiptVerificationError as exc:
        return exc.code


def run(seed: int, kind: str) -> str:
    """Check one case; return what it exercised ("row", a code, or why it was not one for this path)."""
    rng = random.Random(seed)
    case = make_case(rng, kind, top_token=2**63 - 1)
    try:
        ours_receipt = msgspec.convert(case.receipt, GymRolloutReceipt)
        wrapped = GymReceipt(
            group_id="g", prompt_idx=0, rollout_index=0, group_size=1, reward=1.0, mask_sample=True,
            loss_multiplier=1.0, environment="e", receipt=ours_receipt,
        )  # fmt: skip
    except (msgspec.ValidationError, SchemaError):
        # Refused at rlstream's boundary (decode); test_gym_differential holds that to pydantic's refusals.
        return "refused_at_decode"
    theirs_receipt = staging.RolloutReceipt.model_validate(case.receipt)
    media = _media(rng, len(case.snapshots))
    store = InMemoryStore()
    sink = TQStagingSink(store, group_of=lambda rollout_id: "g")
    staged: dict[str, tuple] = {}
    for i, snap in enumerate(case.snapshots):
        record = staging.StagedCallRecord.model_construct(**snap, extras=None)
        result = sink.stage(record, attachments=media.get(i))
        if result.ok:
            staged[result.staging_key] = (record, media.get(i, {}))
    keys = [r.staging_key for r in theirs_receipt.manifest]
    want = _theirs(theirs_receipt, staged, keys)
    group = OpenGroup("g", 0, 1, 0, 0, 0, 0)
    group.receipts[0] = wrapped
    (outcome,) = finalize_groups(
        store, [group], default_actor_config(), receipts_topic="t", now_ms=0, placeholder_groups=True
    )
    if outcome.handed_back:
        # Not one of the group's staged rows exists: handed back for regeneration (DESIGN.md), which
        # is what missing rows everywhere are.
        assert want == "missing_staging_row", (kind, seed, want)
        return want
    record = outcome.finalized
    assert record is not None, (kind, seed, outcome.dead_letter_message)
    (reason,) = record.rejection_reasons
    if isinstance(want, str):
        assert reason == want, (kind, seed, reason, want)
        return want
    chain = [staged[f"{theirs_receipt.rollout_id}/{c}"][1] for c in want.model_call_ids]
    pixel_dtypes = {m["pixel_values"].dtype for m in chain if "pixel_values" in m}
    if len(pixel_dtypes) > 1:
        assert reason == "inconsistent_media", (kind, seed, reason)
        return "inconsistent_media"
    assert reason is None, (kind, seed, reason)
    rows = unpack_payload(store.get(TRAIN, list(record.sample_ids)), record.tags, pad_value_dict={"input_ids": 0})
    n = len(want.token_ids)
    assert int(rows["input_lengths"][0]) == n
    assert rows["input_ids"][0, :n].tolist() == want.token_ids
    assert rows["token_mask"][0, :n].tolist() == [m == 1.0 for m in want.token_mask]
    assert torch.equal(rows["generation_logprobs"][0, :n], torch.tensor(want.logprobs, dtype=torch.float32))
    for name in ("pixel_values", "imgs_sizes"):
        segments = [m[name] for m in chain if name in m]
        if not segments:
            assert name not in rows
            continue
        got = PackedRows.from_wire(rows[name], record.tags, name).rows[0]
        assert [tuple(s.shape) for s in got] == [tuple(s.shape) for s in segments]
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, segments))
    return "row_with_media" if any(chain) else "row"


_KIND = st.one_of(st.sampled_from(KINDS), st.tuples(st.sampled_from(KINDS), st.sampled_from(KINDS)).map("+".join))


@settings(max_examples=CASES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), kind=_KIND)
def test_the_whole_path_gives_nemo_gyms_row_or_its_code(seed, kind):
    run(seed, kind)


# Corruptions rlstream's decode always refuses, as pydantic does (NEMO.md: "refused at decode").
AT_DECODE = {"empty_manifest", "receipt_version", "duplicate_row", "duplicate_staging_key", "missing_terminal"}


def test_every_kind_reaches_this_path_and_rows_carry_media():
    """Fixed seeds per kind: each corruption but those refused at decode gets through the sink and
    the decode to finalization, and valid rows with media, and media of two dtypes, are among them."""
    seen: Counter[str] = Counter()
    for kind in KINDS:
        outcomes = Counter(run(s, kind) for s in range(12))
        assert (set(outcomes) == {"refused_at_decode"}) == (kind in AT_DECODE), (kind, outcomes)
        seen.update(outcomes)
    assert seen["row_with_media"] >= 10 and seen["inconsistent_media"] >= 1 and seen["missing_staging_row"] >= 1
