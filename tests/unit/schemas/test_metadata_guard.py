import dataclasses

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from schemas.errors import MetadataViolation, SchemaError
from schemas.metadata_guard import _FORBIDDEN_RPC_KEYS, assert_metadata_only
from schemas.receipt import CallRecord, Receipt
from schemas.request import ReassemblyRequest


@dataclasses.dataclass
class Outer:
    name: str
    items: list


def _receipt():
    return Receipt("r", "g", 0, 0, 1, 1.0, True, 1.0, "e", None, (CallRecord("r/c0", "c0", None, 0, 3, 3, 1, "d"),))


def test_plain_metadata_passes():
    request = ReassemblyRequest("g", ("r",), ("g_g0",), (_receipt().to_dict(),), (1.0,), 0, 0, (True,))
    assert_metadata_only(request)
    assert_metadata_only(_receipt())
    assert_metadata_only({"input_lengths": [3, 4], "ok": (None, 1.5, True, "s"), 7: {"a": 1}})
    assert_metadata_only(Outer("x", [{"k": [1, 2]}]))


def test_tensor_three_levels_deep_is_named_with_its_path_and_shape():
    value = Outer("x", [{"k": [1, 2]}, {"payload": (0, torch.zeros(4, 8))}])
    with pytest.raises(MetadataViolation) as info:
        assert_metadata_only(value)
    assert info.value.path == 'rpc.items[1]["payload"][1]'
    assert "tensor of shape (4, 8)" in info.value.reason
    assert isinstance(info.value, SchemaError)


def test_forbidden_key_in_a_nested_dict_is_rejected():
    value = {"extra": {"meta": {"token_ids": [1, 2, 3]}}}
    with pytest.raises(MetadataViolation) as info:
        assert_metadata_only(value, path="request")
    assert info.value.path == 'request["extra"]["meta"]["token_ids"]'


def test_forbidden_key_inside_a_receipt_dict_of_a_request():
    receipt = _receipt().to_dict()
    receipt["manifest"][0]["routed_experts_delta"] = [[1, 2]]
    request = ReassemblyRequest("g", ("r",), ("g_g0",), (receipt,), (1.0,), 0, 0, (True,))
    with pytest.raises(MetadataViolation) as info:
        assert_metadata_only(request)
    assert info.value.path == 'rpc.receipts[0]["manifest"][0]["routed_experts_delta"]'


def test_forbidden_field_name_on_a_dataclass_is_rejected():
    @dataclasses.dataclass
    class Leaky:
        logprobs: list

    with pytest.raises(MetadataViolation) as info:
        assert_metadata_only([Leaky([0.1])])
    assert info.value.path == "rpc[0].logprobs"


@pytest.mark.parametrize(
    "bad,words",
    [
        (np.zeros((2, 3)), "array of shape (2, 3)"),
        (TensorDict({"a": torch.zeros(2)}, batch_size=[2]), "TensorDict"),
        (b"raw", "bytes"),
        ({1, 2}, "set"),
        (torch.tensor(3), "tensor of shape ()"),
        (torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged), "nested tensor"),
    ],
)
def test_non_metadata_values_are_rejected(bad, words):
    with pytest.raises(MetadataViolation) as info:
        assert_metadata_only({"ok": 1, "bad": bad})
    assert info.value.path == 'rpc["bad"]'
    assert words in info.value.reason


def test_tensor_as_a_dict_key_is_rejected():
    with pytest.raises(MetadataViolation, match="dict key"):
        assert_metadata_only({torch.zeros(2): 1})


def test_cycles_are_reported_not_looped_on():
    loop: list = [1]
    loop.append(loop)
    with pytest.raises(MetadataViolation, match="cycle"):
        assert_metadata_only(loop)
    shared = [1, 2]
    assert_metadata_only([shared, shared])  # shared but acyclic is fine


def test_forbidden_keys_cover_token_fields_but_not_lengths():
    for key in (
        "input_ids",
        "token_ids",
        "token_mask",
        "generation_logprobs",
        "logprobs",
        "prev_logprobs",
        "routed_experts",
        "prompt_ids_for_adv",
        "invalid_tool_call_mask",
        "malformed_thinking_mask",
        "token_ids_delta",
        "token_mask_delta",
        "generation_logprobs_delta",
        "routed_experts_delta",
    ):
        assert key in _FORBIDDEN_RPC_KEYS
    assert "input_lengths" not in _FORBIDDEN_RPC_KEYS
