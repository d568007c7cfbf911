"""rlstream's error base class, and the one exception type that decoding a wire message can raise."""

from __future__ import annotations


class RlstreamError(Exception):
    """An expected failure with a reason for the user: the CLI prints it as one line, no traceback.

    Anything else that escapes a command is a bug and keeps its traceback.
    """


class SchemaError(RlstreamError, ValueError):
    """A message failed to decode or validate: `path` names the field, `reason` says why."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason

    def __reduce__(self):
        # ValueError's default pickling would call __init__ with the formatted message only.
        return (type(self), (self.path, self.reason))


class InvalidArgument(RlstreamError, ValueError):
    """A value a caller passed is outside what the operation accepts; the message names it."""
