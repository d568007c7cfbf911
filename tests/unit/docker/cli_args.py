"""Parse an rlstream command line the way `rlstream` would, without running it.

The deployment files hold rlstream commands (compose `command:`, Kubernetes `args:`); parsing them
with the real click CLI catches a misspelt verb or flag, a value out of range or a flag a verb does
not have, the moment the CLI and the files disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import click


@dataclass(frozen=True)
class Parsed:
    verb: tuple[str, ...]  # e.g. ("topics", "create")
    params: dict[str, Any]  # the leaf command's parameters, converted and range-checked by click


def parse_rlstream(args: Sequence[str]) -> Parsed:
    """click.UsageError (or BadParameter) if `rlstream ARGS` would not parse."""
    from workers.cli.main import cli

    ctx = cli.make_context("rlstream", list(args))
    verb: list[str] = []
    command: click.Command = cli
    while isinstance(command, click.Group):
        rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
        if not rest:
            raise click.UsageError(f"`rlstream {' '.join(verb)}` needs a command", ctx)
        name, sub, rest = command.resolve_command(ctx, rest)
        if sub is None or name is None:
            raise click.UsageError(f"no such command {rest[:1]}", ctx)
        verb.append(name)
        ctx = sub.make_context(name, list(rest), parent=ctx)
        command = sub
    return Parsed(tuple(verb), dict(ctx.params))
