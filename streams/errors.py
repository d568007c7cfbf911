"""Every expected failure of the `streams` layer, in one place: each is an `RlstreamError` whose message says where."""

from __future__ import annotations

from collections.abc import Sequence

from schemas.errors import RlstreamError


class BrokerError(RlstreamError, RuntimeError):
    """The local broker could not be fetched, started, or stopped; the message says which step."""


class JavaError(RlstreamError, RuntimeError):
    """No usable Java was found; the message says where rlstream looked."""


class ConfigError(RlstreamError, ValueError):
    """Settings that do not validate; the message names the section, the field and the source."""


class TopicError(RlstreamError, RuntimeError):
    """A topic could not be created or described; the message names the topic."""


class ReadTimeout(RlstreamError, TimeoutError):
    """Reading a topic stopped making progress, or a condition was not met in time; an expected failure."""


class DeliveryError(RlstreamError, RuntimeError):
    """The broker did not acknowledge a record; the message names topic and key."""


class JarsError(RlstreamError, RuntimeError):
    """The jars could not be fetched, verified or locked; the message names the jar or the step."""


class TQError(RlstreamError, RuntimeError):
    """Ray or TQ could not be reached or started; the message says where."""


class TQTimeout(TQError, TimeoutError):
    """A TQ call did not finish within its deadline (or a storage unit stopped answering); the message
    names the call. Whatever the call had already sent may still be applied by TQ later."""


class RowsUnsettled(TQError):
    """Rows of a get could not be read as their keys' own nor found broken, now: they kept moving under
    their keys (cleared and put again by another client) while read, or TQ's controller failed while
    the read was checked. Nothing is known missing: read them again later (a reassembler aborts its
    step and rebuilds; a trainer gives the batch back, its groups waiting to be selected again)."""


class ClearRefused(TQError):
    """A clear given up before its next request because its guard refused (a reassembler's lease: the
    process may have been frozen and its partitions taken over); whatever it had not deleted yet stays."""


class MissingKeysError(RlstreamError, KeyError):
    """Some requested keys are not in the partition; `missing` lists them."""

    def __init__(self, partition: str, missing: Sequence[str]):
        self.partition = partition
        self.missing = list(missing)
        super().__init__(
            f"{len(self.missing)} key(s) missing from TQ partition {partition!r}: "
            f"{', '.join(self.missing[:5])}{' ...' if len(self.missing) > 5 else ''}"
        )
