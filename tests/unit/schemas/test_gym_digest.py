"""schemas.gym_digest against NeMo Gym's published golden vectors and against NeMo Gym's own functions."""

import math
import random

import pytest

from schemas import gym_digest as ours

# NeMo Gym 0.7.0's published vectors (nemo_gym/token_id_capture/staging/conformance/golden_vectors.json),
# copied so the agreement is checked even where the package is not installed.
GOLDEN_EXTRAS = {"routed_experts": [[[1, 2]], [[3, 4]]]}
GOLDEN_EXTRAS_DIGEST = "032024e899456be6e9a78c6d0399c5112d2ca7fa18d4ea9cf0d8cb7d0094f3a3"
GOLDEN_CALL = {
    "schema_version": 2,
    "digest_version": 2,
    "extras_digest_version": 1,
    "rollout_id": "rollout-1",
    "model_call_id": "call-1",
    "parent_call_id": "parent-1",
    "mode": "token_in",
    "prev_len": 3,
    "delta_len": 2,
    "cum_len": 5,
    "weight_version": 7,
    "token_ids_delta": [10, 11],
    "token_mask_delta": [0.0, 1.0],
    "generation_log_probs_delta": [0.0, -0.25],
    "extras_digest": GOLDEN_EXTRAS_DIGEST,
    "chain_hash": "1" * 64,
    "cumulative_hash": "2" * 64,
}
GOLDEN_CALL_DIGEST = "1122c7fe7e914c809eb9b1c09b26d94a50c1eb2790e7430fbcd8363b846ccf27"


def test_golden_vectors():
    assert ours.compute_extras_digest(GOLDEN_EXTRAS) == GOLDEN_EXTRAS_DIGEST
    assert ours.compute_staging_digest(**GOLDEN_CALL) == GOLDEN_CALL_DIGEST


def test_the_copy_is_nemo_gyms_installed_vectors():
    conformance = pytest.importorskip(
        "nemo_gym.token_id_capture.staging.conformance", reason="nemo-gym 0.7.0 is not installed (make installs it)"
    )
    vectors = conformance.load_golden_vectors()
    conformance.assert_golden_vectors()
    assert vectors["extras"] == GOLDEN_EXTRAS and vectors["extras_digest"] == GOLDEN_EXTRAS_DIGEST
    assert vectors["staged_call"] == GOLDEN_CALL and vectors["staged_call_digest"] == GOLDEN_CALL_DIGEST


def _random_extras(rng: random.Random, depth: int = 0):
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.randint(-(2**63), 2**63 - 1)
    if kind == 3:
        return rng.uniform(-1e6, 1e6)
    if kind == 4:
        return "".join(rng.choice("ab\u00e9\u4e2d/") for _ in range(rng.randrange(4)))
    if kind in (5, 6):
        return [_random_extras(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {
        rng.choice(["a", "b", "\u00e9", "Z", "aa"]): _random_extras(rng, depth + 1) for _ in range(rng.randrange(3))
    }


def test_every_function_agrees_with_nemo_gyms_on_random_input():
    digest = pytest.importorskip(
        "nemo_gym.token_id_capture.staging.digest", reason="nemo-gym 0.7.0 is not installed (make installs it)"
    )
    rng = random.Random(7)
    for _ in range(300):
        tokens = [rng.choice([0, 1, 2**64 - 1, rng.randrange(2**20)]) for _ in range(rng.randrange(6))]
        assert ours.encode_token_ids(tokens) == digest.encode_token_ids(tokens)
        assert ours.hash_token_ids(tokens) == digest.hash_token_ids(tokens)
        parent = rng.choice([None, ours.hash_token_ids(tokens)])
        assert ours.compute_chain_hash(parent, tokens) == digest.compute_chain_hash(parent, tokens)
        extras = {"x": _random_extras(rng)} if rng.random() < 0.8 else None
        assert ours.compute_extras_digest(extras) == digest.compute_extras_digest(extras)


BAD_VALUES = [
    ("token_ids_delta", [10, -1]),
    ("token_ids_delta", [10, 2**64]),
    ("token_ids_delta", [10, True]),
    ("token_ids_delta", [10, 11.0]),
    ("token_mask_delta", [0.0, 0.5]),
    ("token_mask_delta", [0, 1]),
    ("generation_log_probs_delta", [0.0, math.nan]),
    ("generation_log_probs_delta", [0.0, 1e39]),
    ("generation_log_probs_delta", [-0.5, -0.25]),
    ("generation_log_probs_delta", [0.0, -1]),
    ("chain_hash", "A" * 64),
    ("chain_hash", None),
    ("extras_digest", "0" * 63),
    ("mode", "text"),
    ("mode", "image"),
    ("parent_call_id", ""),
    ("parent_call_id", None),
    ("prev_len", 0),
    ("delta_len", 3),
    ("cum_len", 6),
    ("weight_version", -1),
    ("schema_version", 1),
    ("digest_version", True),
    ("rollout_id", ""),
    ("model_call_id", 5),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_refuses_what_nemo_gym_refuses_with_the_same_exception_type(field, value):
    digest = pytest.importorskip(
        "nemo_gym.token_id_capture.staging.digest", reason="nemo-gym 0.7.0 is not installed (make installs it)"
    )
    call = {**GOLDEN_CALL, field: value}
    with pytest.raises((TypeError, ValueError)) as theirs:
        digest.compute_staging_digest(**call)
    with pytest.raises(type(theirs.value)):
        ours.compute_staging_digest(**call)


def test_extras_refusals_match():
    digest = pytest.importorskip(
        "nemo_gym.token_id_capture.staging.digest", reason="nemo-gym 0.7.0 is not installed (make installs it)"
    )
    for extras in ({"a": (1, 2)}, {"a": math.inf}, {1: 2}, {"a": 2**63}, [1], {"a": b"x"}):
        with pytest.raises((TypeError, ValueError)) as theirs:
            digest.compute_extras_digest(extras)
        with pytest.raises(type(theirs.value)):
            ours.compute_extras_digest(extras)
