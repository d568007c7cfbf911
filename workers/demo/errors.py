"""The demo's and the smoke check's exceptions, in one place."""

from __future__ import annotations

from schemas.errors import RlstreamError


class SmokeFailed(RlstreamError, RuntimeError):
    """A round trip through Kafka or TQ did not return what was sent."""
