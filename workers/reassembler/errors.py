"""The reassembler's exceptions, in one place.

`StepAborted` and its kinds are internal control flow, in the manner of Kafka Streams'
`TaskCorruptedException`: a step that cannot finish safely is abandoned and every task rebuilt from
what was committed. They never reach a caller, so they are not `RlstreamError`s (which a caller may
take for an expected failure with a reason for the user). The fences and the protocol mismatch end
a worker and are `RlstreamError`s, with their reason.
"""

from __future__ import annotations

from schemas.errors import RlstreamError


class WorkerFenced(RlstreamError, RuntimeError):
    """A newer worker with the same transactional id exists; this one must stop, not fence it back."""


class MemberFenced(WorkerFenced):
    """The coordinator fenced this static member's `group.instance.id`: another process joined under
    it, or this very consumer did, through a join it retried while the coordinator stalled."""


class ConsumerGroupProtocolMismatch(RlstreamError, RuntimeError):
    """The consumer group's members ask for partition assignment strategies with nothing in common."""


class StepAborted(RuntimeError):
    """The step cannot finish safely; the worker rebuilds from committed state, as after an abort."""


class LeaseRefused(StepAborted):
    """The worker may have lost its partitions (paused past its session): it must not write to TQ train."""


class StagingUnstable(StepAborted):
    """Staged rows kept vanishing while they were fetched (cleared by another owner)."""
