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


class MetadataViolation(SchemaError):
    """A control-plane value carries a tensor, an array, an unknown type or a per-token field."""


class LayoutError(RlstreamError, ValueError):
    """A fetched row is not a packed row this code can read; the message names partition, key and layout."""

    def __init__(self, partition: str, key: str, layout: object, reason: str) -> None:
        super().__init__(f"TQ partition {partition!r}, key {key!r}, row layout {layout}: {reason}")
        self.partition, self.key, self.layout, self.reason = partition, key, layout, reason

    def __reduce__(self):
        return (type(self), (self.partition, self.key, self.layout, self.reason))


class ReceiptVerificationError(RlstreamError, ValueError):
    """A NeMo Gym receipt or staged call failed a custody check; `code` is NeMo Gym's code for it.

    The codes are NeMo Gym's (`nemo_gym.token_id_capture.staging.rebuild`), so a rejection reads the
    same whichever side verified it; the message is `"{code}: {detail}"` as NeMo Gym's is.
    """

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail

    def __reduce__(self):
        return (type(self), (self.code, self.detail))


class RebuildError(ReceiptVerificationError):
    """A verified manifest cannot form the declared terminal ancestry (NeMo Gym's `RebuildError`)."""
