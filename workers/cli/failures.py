"""The one place where a command's failure becomes what the user sees.

An expected failure (`RlstreamError`, a click usage error, a Kafka client error such as an
unreachable broker, an `OSError` such as an unwritable directory or a port in use) is one line on
stderr, `rlstream <verb>: <reason>`, and exit 1 (2 for usage errors); a reason of several lines
keeps the rest in the log file, or shows up to ten more lines when the log cannot be written.
Ctrl-C is `interrupted` and 130; a closed stdout (`rlstream tail ... | head`) ends quietly with 141,
as a shell reports SIGPIPE. Anything else is a bug: its traceback always goes to the log file
(rotating, under `$XDG_CACHE_HOME/rlstream/log/`), to the screen too with `--debug`, and otherwise
the screen gets one line naming the exception type and the log file.
"""

from __future__ import annotations

import errno
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
# Exit code of a command whose stdout reader went away: 128 + SIGPIPE, as a shell reports it.
EXIT_BROKEN_PIPE = 141
# Lines of an expected failure's details shown on screen when the log file cannot hold them.
SHOWN_DETAIL_LINES = 10
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


class _LogFile(RotatingFileHandler):
    """The log file handler; a write that fails is remembered (the caller shows the details), not printed."""

    failed = False

    def handleError(self, record: logging.LogRecord) -> None:
        self.failed = True


def open_log() -> _LogFile | None:
    """A rotating file handler on the log file for warnings and up; None if it cannot be written."""
    path = log_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = _LogFile(path, maxBytes=5_000_000, backupCount=3, encoding="utf-8")
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


def debug_from_env() -> bool:
    """Whether RLSTREAM_DEBUG asks for `--debug` (set, and not empty or 0)."""
    return os.environ.get("RLSTREAM_DEBUG", "") not in ("", "0")


def wants_debug(root: click.Group, argv: list[str]) -> bool:
    """Whether `--debug` was given to the root command (before the verb) or RLSTREAM_DEBUG is set."""
    before_verb = []
    for arg in argv:
        if not arg.startswith("-"):
            break
        before_verb.append(arg)
    return "--debug" in before_verb or debug_from_env()


def _kafka_exception_type() -> type | None:
    # confluent_kafka is imported by the verbs that talk to Kafka; if it never was, nothing raised its error.
    return getattr(sys.modules.get("confluent_kafka"), "KafkaException", None)


def _kafka_reason(exc: BaseException) -> str:
    err = exc.args[0] if exc.args else exc
    return err.str() if hasattr(err, "str") else str(err)


def _broken_pipe(exc: BaseException) -> bool:
    return isinstance(exc, StdoutClosed) or (isinstance(exc, OSError) and exc.errno == errno.EPIPE)


class StdoutClosed(Exception):
    """A write to a pipe nobody reads any more (`rlstream tail ... | head`), carried past click.

    click would turn that BrokenPipeError into a bare `sys.exit(1)`; `PipeSafeGroup` raises this instead.
    """


class PipeSafeGroup(click.Group):
    """A group whose verbs' broken pipes reach the funnel, which exits quietly with 141."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except OSError as exc:
            if exc.errno == errno.EPIPE:
                raise StdoutClosed() from exc
            raise


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so flushing what is left at exit does not fail again."""
    try:
        fd = sys.stdout.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
    except (AttributeError, OSError, ValueError):
        return  # not a file descriptor (a test's capture): nothing will be flushed to the pipe
    os.dup2(devnull, fd)
    os.close(devnull)


def _details(rest: str) -> str:
    """The first lines of a failure's details, for the screen when the log file cannot hold them."""
    lines = rest.strip("\n").splitlines()
    shown = lines[:SHOWN_DETAIL_LINES]
    if len(lines) > len(shown):
        shown.append(f"... ({len(lines) - len(shown)} more lines; the log file {log_path()} could not be written)")
    return "\n".join(shown)


class Funnel:
    """Runs the root command for one `argv` and turns every outcome into an exit code."""

    def __init__(self, root: click.Group, argv: list[str]) -> None:
        self.root = root
        self.argv = argv
        self.debug = wants_debug(root, argv)
        self.handler: _LogFile | None = None

    def run(self) -> int:
        logger = logging.getLogger(LOGGER)
        self.handler = open_log()
        if self.handler is not None:
            _active.append(self.handler)
            logger.addHandler(self.handler)
        try:
            return self._flush_stdout(self._invoke())
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
            if _broken_pipe(exc):
                _silence_stdout()
                return EXIT_BROKEN_PIPE
            return self._failed(exc)

    def _flush_stdout(self, code: int) -> int:
        """Flush stdout now, while a closed pipe or a full disk can still end the command cleanly."""
        try:
            sys.stdout.flush()
        except OSError as exc:
            if exc.errno == errno.EPIPE:
                _silence_stdout()
                return EXIT_BROKEN_PIPE
            self._say(verb_of(self.root, self.argv), f"writing the output failed: {exc}")
            return 1
        return code

    def _failed(self, exc: Exception) -> int:
        verb = verb_of(self.root, self.argv)
        kafka_error = _kafka_exception_type()
        is_kafka = kafka_error is not None and isinstance(exc, kafka_error)
        if self.debug:
            traceback.print_exception(exc, file=sys.stderr)
        if is_kafka or isinstance(exc, (RlstreamError, OSError)):
            text = _kafka_reason(exc) if is_kafka else str(exc) or type(exc).__name__
            first, _, rest = text.partition("\n")
            if rest.strip():
                written = self._write(logging.WARNING, verb, exc, with_traceback=False)
                first += f" (details in {log_path()})" if written else "\n" + _details(rest)
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
        self.handler.failed = False
        self.handler.handle(record)
        return not self.handler.failed
