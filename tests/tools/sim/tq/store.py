"""A `streams.tq.TQStore` over a model TQ, until TQStore takes the module it calls (the seam).

TQStore imports `transfer_queue` and its `StorageUnitTimeout` in its constructor. While it has no
parameter for them, the model's module stands in for those two imports during the constructor
only; the store then keeps calling the module it was built with. Once TQStore takes them (a `tq`
parameter), that is used instead.
"""

from __future__ import annotations

import inspect
import sys
import threading
import types
from collections.abc import Iterable

from streams.tq import STAGING, TRAIN, TQStore
from tests.tools.sim.tq import TQModule

_IMPORTS = ("transfer_queue", "transfer_queue.storage.managers.simple_storage_manager")
_lock = threading.Lock()


def tq_store(module: TQModule, packed: Iterable[str] = (STAGING, TRAIN)) -> TQStore:
    """A TQStore whose every call goes to `module` (one process's view of a `SimTQ`)."""
    if "tq" in inspect.signature(TQStore).parameters:
        return TQStore(packed, tq=module)  # type: ignore[call-arg]
    storage = types.ModuleType(_IMPORTS[1])
    storage.StorageUnitTimeout = module.StorageUnitTimeout
    with _lock:
        saved = {name: sys.modules.get(name) for name in _IMPORTS}
        sys.modules[_IMPORTS[0]], sys.modules[_IMPORTS[1]] = module, storage  # type: ignore[assignment]
        try:
            return TQStore(packed)
        finally:
            for name, mod in saved.items():
                if mod is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = mod
