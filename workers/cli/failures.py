"""The one place where a command's failure becomes what the user sees.

An expected failure (`RlstreamError`, a click usage error, a Kafka client error such as an
unreachable broker) is one line on stderr, `rlstream <verb>: <reason>`, and exit 1 (2 for usage
errors); Ctrl-C is `interrupted` and 130. Anything else is a bug: its traceback always goes to the
log file (rotating, under `$XDG_CACHE_HOME/rlstream/log/`), to the screen too with `--debug`, and
otherwise the screen gets one line naming the exception type and the log file.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from logging.handlers import RotatingFileHandler
from pathlib import Path

import click

from schemas.errors import RlstreamError

LOGGER = "rlstream"
PROG = "rlstream"
# The log file handler of the running command (a stack: tests run commands inside commands).
_active: list[RotatingFileHandler] = []


class _Stderr:
    """Whatever sys.stderr is when a log line is written (click's test runner swaps it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


# The stream the verbs' log handlers write to.
STDERR = _Stderr()


def log_path() -> Path:
    """Where the CLI's log file is: `$XDG_CACHE_HOME/rlstream/log/rlstream.log` (default `~/.cache`)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rlstream" / "log" / "rlstream.log"


def open_log() -> RotatingFileHandler | None:
    """A rotating file handler on the log file for warnings and up; None if it cannot be written."""
    path = log_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = RotatingFileHandler(path, maxBytes=5_000_000, backupCount=3, encoding="utf-8")
    except OSError:
        return None
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(asctime)s pid %(process)d %(name)s %(levelname)s %(message)s"))
    return handler


def keep_log_file() -> None:
    """Put the log file handler back on the `rlstream` logger if reconfiguring logging removed it."""
    logger = logging.getLogger(LOGGER)
    if _active and _active[-1] not in logger.handlers:
        logger.addHandler(_active[-1])


def verb_of(root: click.Group, argv: list[str]) -> str:
    """The command path `argv` names under `root`, e.g. `deadletter redrive` (options skipped)."""
    path: list[str] = []
    cmd: click.Command | None = root
    for arg in argv:
        if arg.startswith("-"):
            continue
        sub = cmd.get_command(None, arg) if isinstance(cmd, click.Group) else None  # type: ignore[arg-type]
        if sub is None:
            break
        path.append(arg)
        cmd = sub
    return " ".join(path)


def wants_debug(root: click.Group, argv: list[str]) -> bool:
    """Whether `--debug` was given to the root command (before the verb) or RLSTREAM_DEBUG is set."""
    before_verb = []
    for arg in argv:
        if not arg.startswith("-"):
            break
        before_verb.append(arg)
    return "--debug" in before_verb or os.environ.get("RLSTREAM_DEBUG", "") not in ("", "0")


def _kafka_exception_type() -> type | None:
    # confluent_kafka is imported by the verbs that talk to Kafka; if it never was, nothing raised its error.
    return getattr(sys.modules.get("confluent_kafka"), "KafkaException", None)


def _kafka_reason(exc: BaseException) -> str:
    err = exc.args[0] if exc.args else exc
    return err.str() if hasattr(err, "str") else str(err)


class Funnel:
    """Runs the root command for one `argv` and turns every outcome into an exit code."""

    def __init__(self, root: click.Group, argv: list[str]) -> None:
        self.root = root
        self.argv = argv
        self.debug = wants_debug(root, argv)
        self.handler: RotatingFileHandler | None = None

    def run(self) -> int:
        logger = logging.getLogger(LOGGER)
        self.handler = open_log()
        if self.handler is not None:
            _active.append(self.handler)
            logger.addHandler(self.handler)
        try:
            return self._invoke()
        finally:
            if self.handler is not None:
                _active.remove(self.handler)
                logger.removeHandler(self.handler)
                self.handler.close()

    def _say(self, verb: str, reason: str) -> None:
        print(f"{PROG}{' ' + verb if verb else ''}: {reason}", file=sys.stderr, flush=True)

    def _invoke(self) -> int:
        try:
            rv = self.root.main(args=self.argv, prog_name=PROG, standalone_mode=False)
            return rv if isinstance(rv, int) else 0
        except click.exceptions.NoArgsIsHelpError as exc:
            exc.show()
            return exc.exit_code
        except click.ClickException as exc:
            ctx = getattr(exc, "ctx", None)
            verb = ctx.command_path.removeprefix(PROG).strip() if ctx else verb_of(self.root, self.argv)
            hint = f" (see '{f'{PROG} {verb}'.strip()} --help')" if isinstance(exc, click.UsageError) else ""
            self._say(verb, exc.format_message() + hint)
            return exc.exit_code
        except (click.Abort, KeyboardInterrupt):
            self._say(verb_of(self.root, self.argv), "interrupted")
            return 130
        except Exception as exc:
            return self._failed(exc)

    def _failed(self, exc: Exception) -> int:
        verb = verb_of(self.root, self.argv)
        kafka_error = _kafka_exception_type()
        expected = isinstance(exc, RlstreamError) or (kafka_error is not None and isinstance(exc, kafka_error))
        if self.debug:
            traceback.print_exception(exc, file=sys.stderr)
        if expected:
            text = _kafka_reason(exc) if not isinstance(exc, RlstreamError) else str(exc) or type(exc).__name__
            first, _, rest = text.partition("\n")
            if rest.strip() and self._write(logging.WARNING, verb, exc, with_traceback=False):
                first += f" (details in {log_path()})"
            self._say(verb, first)
            return 1
        written = self._write(logging.ERROR, verb, exc, with_traceback=True)
        where = f"traceback in {log_path()}" if written else "run with --debug for the traceback"
        if self.debug:
            where = "traceback above" + (f" and in {log_path()}" if written else "")
        message = str(exc).partition("\n")[0][:200]
        self._say(verb, f"internal error {type(exc).__name__}{': ' + message if message else ''} ({where})")
        return 1

    def _write(self, level: int, verb: str, exc: BaseException, *, with_traceback: bool) -> bool:
        """Write `exc` to the log file only (never to the screen's handlers); whether it was written."""
        if self.handler is None:
            return False
        info = (type(exc), exc, exc.__traceback__) if with_traceback else None
        msg = "%s %s failed: %s" if with_traceback else "%s %s: %s"
        record = logging.LogRecord(f"{LOGGER}.cli", level, __file__, 0, msg, (PROG, verb, exc), info)
        self.handler.handle(record)
        return True
