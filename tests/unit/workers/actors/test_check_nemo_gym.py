"""`check_nemo_gym`, what the actors' `check_dependencies` runs when they finalize NeMo Gym receipts."""

import sys

import pytest

from schemas.errors import RlstreamError
from workers.actors.reassembler import NEMO_GYM_INSTALL, check_nemo_gym


def test_passes_with_the_installed_nemo_gym():
    pytest.importorskip("nemo_gym.token_id_capture.staging", reason="nemo-gym 0.7.0 is not installed")
    check_nemo_gym()


def test_fails_fast_naming_the_install_when_nemo_gym_cannot_be_imported(monkeypatch):
    # As if it were not installed: the import system finds None under the module's name.
    monkeypatch.setitem(sys.modules, "nemo_gym.token_id_capture.staging.rebuild", None)
    monkeypatch.setitem(sys.modules, "nemo_gym.token_id_capture.staging.conformance", None)
    with pytest.raises(RlstreamError, match="nemo-gym 0.7.0, which is not importable") as err:
        check_nemo_gym()
    assert NEMO_GYM_INSTALL in str(err.value)
