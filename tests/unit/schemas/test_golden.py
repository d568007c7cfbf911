"""Golden vectors: the committed bytes must keep decoding to the committed JSON, byte for byte."""

import json
from pathlib import Path

import pytest

from schemas.deadletter import DeadLetter
from schemas.finalized import FinalizedGroup
from schemas.gym_receipt import GymReceipt
from schemas.receipt import Receipt
from schemas.regenerate import Regenerate
from schemas.request import ReassemblyRequest, RolloutReassemblerActorConfig
from schemas.state import GroupState, PartitionProgress
from schemas.trainer_progress import TrainerProgress
from schemas.trainer_version import TrainerVersion

GOLDEN = Path(__file__).resolve().parents[3] / "schemas" / "golden"
KINDS = {
    cls.kind(): cls
    for cls in (
        Receipt,
        GymReceipt,
        FinalizedGroup,
        DeadLetter,
        GroupState,
        PartitionProgress,
        ReassemblyRequest,
        RolloutReassemblerActorConfig,
        TrainerVersion,
        Regenerate,
        TrainerProgress,
    )
}


def test_every_message_kind_has_a_golden_vector():
    assert {p.stem for p in GOLDEN.glob("*.msgpack")} == set(KINDS)
    assert {p.stem for p in GOLDEN.glob("*.json")} == set(KINDS)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_golden_bytes_decode_to_the_committed_json(kind):
    data = (GOLDEN / f"{kind}.msgpack").read_bytes()
    expected = json.loads((GOLDEN / f"{kind}.json").read_text())
    message = KINDS[kind].from_bytes(data)
    assert message.to_dict() == expected
    # Encoding is stable: today's encoder writes exactly the committed bytes.
    assert message.to_bytes() == data
