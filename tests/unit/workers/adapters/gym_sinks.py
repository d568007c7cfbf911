"""A NeMo Gym `StagingSink` that keeps what NeMo Gym's capture handed it, then stages it in rlstream's.

Tests compare rlstream's rows with NeMo Gym's `verify_and_linearize` of the records as NeMo Gym built
them (before any sink touched them), not only of what rlstream's own source reads back.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch


class RecordingSink:
    """Delegates to `inner` (a `TQStagingSink`); `records[key]` and `attachments[key]` are deep copies
    of what was staged under key, taken before `inner` saw them."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.records: dict[str, Any] = {}
        self.attachments: dict[str, dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def stage(self, record: Any, *, attachments: Mapping[str, Any] | None = None) -> Any:
        copy = record.model_copy(deep=True)
        media = {k: v.clone() for k, v in (attachments or {}).items() if isinstance(v, torch.Tensor)}
        result = self.inner.stage(record, attachments=attachments)
        if result.ok:
            with self._lock:
                self.records[result.staging_key] = copy
                self.attachments[result.staging_key] = media
        return result

    def as_built(self, staging_keys: Sequence[str]) -> list[Any]:
        """The records of `staging_keys` as NeMo Gym built them, in order (verify_and_linearize's input)."""
        return [self.records[k] for k in staging_keys]
