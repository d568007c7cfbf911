"""rlstream's verl plug-ins import verl only when verl calls them (verl pins tensordict<=0.10)."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import workers.adapters


def test_every_adapter_module_imports_without_verl():
    for info in pkgutil.iter_modules(workers.adapters.__path__):
        importlib.import_module(f"workers.adapters.{info.name}")
    assert not [name for name in sys.modules if name == "verl" or name.startswith("verl.")]
    # The agent-loop classes derive from verl's: only asking for them imports verl.
    assert "RlstreamAgentLoopManager" in importlib.import_module("workers.adapters.verl_rollout")._CLASSES
