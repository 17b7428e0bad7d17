"""docs/cli.md, made from the click commands themselves: every command's usage, help, arguments
and options, as `--help` prints them, in Markdown.

``python -m corral.cli_reference`` prints it; ``python -m corral.cli_reference docs/cli.md``
writes the file. ``tests/test_cli_reference.py`` fails when the committed file differs from what
this makes now, so a flag added, renamed or reworded reaches the reference with the change.
Nothing here depends on the machine or the terminal: no width, no home, no environment.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from pathlib import Path

import click

from corral.cli import main

PROG = "corral"

INTRO = """\
# The `corral` command line

Every command, its arguments and options, as `corral COMMAND --help` prints them. This file is
made from the commands themselves: `python -m corral.cli_reference docs/cli.md` writes it, and
`tests/test_cli_reference.py` fails when it differs from what the code says. What to do when
something goes wrong: [troubleshooting.md](troubleshooting.md).
"""


def _commands(
    command: click.Command, ctx: click.Context
) -> Iterator[tuple[click.Command, click.Context]]:
    """``command`` and every command under it, depth first, in the order `--help` lists them."""
    yield command, ctx
    if isinstance(command, click.Group):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is None or sub.hidden:
                continue
            yield from _commands(sub, click.Context(sub, info_name=name, parent=ctx))


def _usage(command: click.Command, ctx: click.Context) -> str:
    pieces = " ".join(command.collect_usage_pieces(ctx))
    return f"{ctx.command_path} {pieces}".rstrip()


def _cell(text: str) -> str:
    """One table cell: on one line, with its pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _arguments(command: click.Command) -> list[str]:
    names = [
        p.human_readable_name + ("" if p.required else " (optional)")
        for p in command.params
        if isinstance(p, click.Argument)
    ]
    return [f"Arguments: {', '.join(f'`{n}`' for n in names)}", ""] if names else []


def _options(command: click.Command, ctx: click.Context) -> list[str]:
    rows = []
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
        if record is None:
            continue
        flags, help_text = record
        rows.append(f"| `{_cell(flags)}` | {_cell(help_text)} |")
    if not rows:
        return []
    return ["| option | meaning |", "|---|---|", *rows, ""]


def _section(command: click.Command, ctx: click.Context) -> list[str]:
    # `corral` and its commands are sections; a group's commands (`corral daemon stop`) below.
    level = "#" * max(2, min(ctx.command_path.count(" ") + 1, 4))
    lines = [f"{level} `{ctx.command_path}`", "", "```", _usage(command, ctx), "```", ""]
    if command.help:
        lines += [_help(command.help), ""]
    lines += _arguments(command)
    lines += _options(command, ctx)
    if isinstance(command, click.Group):
        subs = [n for n in command.list_commands(ctx) if not _hidden(command, ctx, n)]
        lines += [
            "Commands: " + ", ".join(f"`{ctx.command_path} {n}`" for n in subs),
            "",
        ]
    return lines


def _help(text: str) -> str:
    """A command's docstring as Markdown: dedented, click's ``\\b`` (no rewrap) lines dropped."""
    kept = [line for line in inspect.cleandoc(text).splitlines() if line.strip() != "\b"]
    return click.unstyle("\n".join(kept)).strip()


def _hidden(group: click.Group, ctx: click.Context, name: str) -> bool:
    sub = group.get_command(ctx, name)
    return sub is None or sub.hidden


def render() -> str:
    """docs/cli.md as the commands are now."""
    root = click.Context(main, info_name=PROG, **main.context_settings)
    lines = [*INTRO.splitlines(), ""]
    for command, ctx in _commands(main, root):
        lines += _section(command, ctx)
    return "\n".join(lines).rstrip() + "\n"


def run(argv: list[str]) -> int:
    text = render()
    if not argv:
        sys.stdout.write(text)
        return 0
    Path(argv[0]).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
