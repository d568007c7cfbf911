"""rlstream's one logging path: the `rlstream` logger tree, as plain text or one JSON object per line.

Every module logs on an `rlstream.<role>` logger; librdkafka's own lines arrive on `rlstream.kafka`
(`streams.config` hands that logger to every client). `configure_logging` attaches one handler to
`rlstream` and touches nothing else, so an application embedding the trainer keeps its own root
logger, and its handlers never see our lines twice.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import IO

from streams.config import CLIENT_LOGGER

ROOT_LOGGER = "rlstream"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"

# Attributes every LogRecord has; anything else was passed through `extra=` and is emitted as a field.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}
# confluent-kafka logs each librdkafka line as logger.log(level, "%s [%s] %s", facility, client, text).
_CLIENT_FORMAT = "%s [%s] %s"
_THREAD_PREFIX = re.compile(r"^\[thrd:[^\]]*\]: ")


class JsonFormatter(logging.Formatter):
    """`{"ts": ..., "level": ..., "logger": ..., "msg": ..., <extra fields>}` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class KafkaClientFilter(logging.Filter):
    """Reshape a librdkafka line into one of ours: `<client> <FACILITY>: <text>`, with fields for JSON.

    A warning that librdkafka says it is retrying on its own (a fresh broker's "Coordinator load in
    progress", say) is routine, not something to act on: it drops to INFO.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if record.msg != _CLIENT_FORMAT or not isinstance(args, tuple) or len(args) != 3:
            return True
        facility, client, text = (str(a) for a in args)
        text = _THREAD_PREFIX.sub("", text)
        record.msg, record.args = "%s %s: %s", (client, facility, text)
        record.kafka_client, record.kafka_facility = client, facility
        if record.levelno == logging.WARNING and text.rstrip().endswith("retrying"):
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
            # Levels were checked before filters ran; re-check against the demoted level.
            return logging.getLogger(record.name).isEnabledFor(logging.INFO)
        return True


def _ours(handler: logging.Handler) -> bool:
    return getattr(handler, "_rlstream", False)


def configure_logging(*, json_lines: bool = False, level: int = logging.INFO, stream: IO[str] | None = None) -> None:
    """Send the `rlstream` loggers to `stream` (default stderr), as JSON lines or as plain text.

    Only the `rlstream` logger is configured (it stops propagating to the root logger); calling again
    replaces the handler this function installed before. librdkafka's notices and info lines show
    only when `level` is DEBUG; its warnings and errors always do.
    """
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines else logging.Formatter(TEXT_FORMAT))
    handler._rlstream = True  # type: ignore[attr-defined]
    root = logging.getLogger(ROOT_LOGGER)
    for old in [h for h in root.handlers if _ours(h)]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False
    kafka = logging.getLogger(CLIENT_LOGGER)
    kafka.setLevel(logging.DEBUG if level <= logging.DEBUG else logging.WARNING)
    if not any(isinstance(f, KafkaClientFilter) for f in kafka.filters):
        kafka.addFilter(KafkaClientFilter())
