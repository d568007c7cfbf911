"""The framework adapters' exceptions, in one place."""

from __future__ import annotations


class SampleTimeout(TimeoutError):
    """Fewer usable groups than asked for arrived within the configured wait."""
