"""rlstream's `schemas.gym_verify.verify_and_linearize` against NeMo Gym's own, on generated cases.

Each case is a random call tree (text roots, token_in children, branches and several roots; up to
24 calls at times; unicode, NUL, slashed and long rollout and call ids; manifests out of tree
order), staged and receipted as NeMo Gym does, then corrupted one way or two in turn
(`gym_cases.KINDS`: digests, chain and cumulative hashes, masks, lengths, parents, cycles,
terminals, versions, reordered, missing, duplicated and foreign snapshots, poisoned and failed
receipts). Both implementations must return
the same row, or refuse with the same code (and the same class, RebuildError or not).

Two ways in: *constructed*, where both sides get the case unvalidated (NeMo Gym's `model_construct`),
so every code of the verifier is reachable; and *validated*, where NeMo Gym's pydantic models and
rlstream's structs must accept or refuse the same receipts, and verify the accepted ones alike.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from types import SimpleNamespace

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.errors import RebuildError, ReceiptVerificationError, SchemaError
from schemas.gym_receipt import GymCallRecord, GymRolloutReceipt
from schemas.gym_verify import VERIFICATION_CODES, StagedCall, verify_and_linearize
from tests.unit.schemas.gym_cases import KINDS, Case, make_case

staging = pytest.importorskip(
    "nemo_gym.token_id_capture.staging", reason="nemo-gym 0.7.0 is not installed (make installs it)"
)
pydantic = pytest.importorskip("pydantic")

# How many generated cases one run checks (each both ways); at least 1,000 per CI run.
CASES = 1200
# Codes no input can reach once the checks before them passed: every call on the chain has a
# generated token (else `empty_generation`), so the row always has one; a snapshot whose call id
# differs from its manifest row's is refused by the order check first (`snapshot_order_mismatch`).
UNREACHABLE = {"empty_training_row", "wrong_model_call_id"}


def _defaults(cls) -> dict:
    return {f.name: f.default for f in msgspec.structs.fields(cls) if f.default is not msgspec.NODEFAULT}


def _ours_constructed(case: Case):
    records = [SimpleNamespace(**{**_defaults(GymCallRecord), **r}) for r in case.receipt["manifest"]]
    receipt = SimpleNamespace(**{**_defaults(GymRolloutReceipt), **case.receipt, "manifest": records})
    return receipt, [StagedCall(**s) for s in case.snapshots]


def _theirs_constructed(case: Case):
    records = [staging.CallRecord.model_construct(**r) for r in case.receipt["manifest"]]
    receipt = staging.RolloutReceipt.model_construct(**{**case.receipt, "manifest": records})
    return receipt, [staging.StagedCallBaseSnapshot.model_construct(**s) for s in case.snapshots]


def _outcome(verify, receipt, snapshots, refusal) -> tuple:
    try:
        row = verify(receipt, snapshots)
    except refusal as exc:
        return ("refused", exc.code, type(exc).__name__ == "RebuildError")
    except Exception as exc:  # noqa: BLE001 - anything else must be the same on both sides too
        return ("error", type(exc).__name__)
    return ("row", dataclasses.asdict(row))


def _ours(receipt, snapshots) -> tuple:
    return _outcome(verify_and_linearize, receipt, snapshots, ReceiptVerificationError)


def _theirs(receipt, snapshots) -> tuple:
    return _outcome(staging.verify_and_linearize, receipt, snapshots, staging.ReceiptVerificationError)


def check(case: Case) -> tuple:
    """Assert both implementations agree on `case` both ways; return NeMo Gym's constructed outcome."""
    theirs = _theirs(*_theirs_constructed(case))
    assert _ours(*_ours_constructed(case)) == theirs, case.kind
    try:
        validated = staging.RolloutReceipt.model_validate(case.receipt)
    except pydantic.ValidationError:
        validated = None
    try:
        mine = msgspec.convert(case.receipt, GymRolloutReceipt)
    except (msgspec.ValidationError, SchemaError):
        mine = None
    assert (mine is None) == (validated is None), (case.kind, case.receipt)
    if mine is not None:
        snapshots = [StagedCall(**s) for s in case.snapshots]
        theirs_snapshots = [staging.StagedCallBaseSnapshot.model_construct(**s) for s in case.snapshots]
        assert _ours(mine, snapshots) == _theirs(validated, theirs_snapshots), case.kind
    return theirs


# One corruption, or two applied in turn ("a+b").
_KIND = st.one_of(st.sampled_from(KINDS), st.tuples(st.sampled_from(KINDS), st.sampled_from(KINDS)).map("+".join))


@settings(max_examples=CASES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), kind=_KIND)
def test_same_rows_or_same_refusal_on_generated_cases(seed, kind):
    check(make_case(random.Random(seed), kind))


def test_every_corruption_class_is_exercised_and_every_code_reached():
    """Each corruption kind, many seeds: every code NeMo Gym can give shows up, so a disagreement in
    any class would have been seen (and the valid cases do give rows)."""
    codes: Counter[str] = Counter()
    rows = 0
    for kind in KINDS:
        for seed in range(100 if kind == "field_mismatch" else 40):
            outcome = check(make_case(random.Random(f"{kind}/{seed}"), kind))
            if outcome[0] == "refused":
                codes[outcome[1]] += 1
            elif outcome[0] == "row":
                rows += 1
            else:
                pytest.fail(f"{kind}: NeMo Gym raised {outcome[1]}, not a verification error")
    assert rows >= 40
    assert set(VERIFICATION_CODES) - UNREACHABLE <= set(codes), set(VERIFICATION_CODES) - UNREACHABLE - set(codes)
    assert set(codes) <= set(VERIFICATION_CODES)


def test_the_code_vocabulary_is_nemo_gyms():
    """Every code rlstream names appears in NeMo Gym's verifier source, and the error classes match."""
    import inspect

    source = inspect.getsource(staging.rebuild)
    for code in VERIFICATION_CODES:
        if not code.startswith("wrong_"):
            assert f'"{code}"' in source, code
    assert issubclass(RebuildError, ReceiptVerificationError)
    assert ReceiptVerificationError("x", "y").args == staging.ReceiptVerificationError("x", "y").args
