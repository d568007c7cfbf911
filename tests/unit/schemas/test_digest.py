import subprocess
import sys

import pytest
import torch

from schemas.digest import token_digest
from tests.unit.schemas.chains import reference_digest


def test_digest_matches_blake2b_over_int64_little_endian_bytes():
    ids = [0, 1, 151643, 2**40, 7]
    assert token_digest(torch.tensor(ids)) == reference_digest(ids)
    # A literal, so that the reference helper cannot drift together with the code.
    assert token_digest(torch.tensor([1, 2, 3])) == "77ba1ae68d5afbb4"


def test_digest_ignores_the_integer_dtype_but_not_the_values():
    ids = torch.tensor([5, 6, 7], dtype=torch.int64)
    assert token_digest(ids.to(torch.int32)) == token_digest(ids)
    assert token_digest(ids) != token_digest(torch.tensor([5, 6, 8]))
    assert token_digest(ids) != token_digest(torch.tensor([7, 6, 5]))


def test_digest_is_the_same_in_another_process():
    code = "import torch; from schemas.digest import token_digest; print(token_digest(torch.arange(1000)))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == token_digest(torch.arange(1000))


@pytest.mark.parametrize(
    "bad",
    [torch.zeros(2, 2, dtype=torch.int64), torch.zeros(3), torch.zeros(3, dtype=torch.bool)],
)
def test_digest_rejects_non_token_tensors(bad):
    with pytest.raises(ValueError):
        token_digest(bad)
