"""The rollout side's exceptions, in one place."""

from __future__ import annotations

from collections.abc import Sequence

from streams.errors import DeliveryError


class UnacknowledgedReceipts(DeliveryError):
    """Some receipts of a publish were not acknowledged; `unacknowledged` names their rollouts, in order.

    `staged` is the part of them whose rows are in TQ staging. Publish the same rollouts again: one
    whose first receipt lands late as well is refused by the reassembler as a duplicate.
    """

    def __init__(self, message: str, *, unacknowledged: Sequence[str], staged: Sequence[str]):
        super().__init__(message)
        self.unacknowledged = tuple(unacknowledged)
        self.staged = tuple(staged)
