"""docs/cli.md is what the click commands say now: a flag added, renamed or reworded without
regenerating the reference fails here (`python -m corral.cli_reference docs/cli.md` writes it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click

from corral.cli import main
from corral.cli_reference import render

DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def test_the_committed_reference_is_what_the_commands_say() -> None:
    assert DOC.read_text() == render(), (
        "docs/cli.md is out of date: run `python -m corral.cli_reference docs/cli.md`"
    )


def test_every_command_and_option_is_in_the_reference() -> None:
    """The generator leaves nothing out: each visible command has its section, each option
    its flags (a generator that skipped a group or a kind of option would pass the test above)."""
    text = render()

    def walk(command: click.Command, path: str) -> None:
        assert f"`{path}`\n\n```\n{path} " in text, path
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                for flag in param.opts:
                    assert flag in text, f"{path}: {flag}"
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                if not sub.hidden:
                    walk(sub, f"{path} {name}")

    walk(main, "corral")
    assert "`corral daemon restart-workers`" in text and "--end-orphans" in text


def test_the_module_writes_the_file(tmp_path: Path) -> None:
    """`python -m corral.cli_reference FILE` as the module docstring says (no terminal, no
    home: the output does not depend on where it runs)."""
    target = tmp_path / "cli.md"
    subprocess.run(
        [sys.executable, "-m", "corral.cli_reference", str(target)],
        check=True,
        env={"PATH": "/usr/bin:/bin", "COLUMNS": "40"},
        timeout=60,
    )
    assert target.read_text() == render()


def test_every_option_says_what_it_does() -> None:
    """An option with no help is a row of docs/cli.md with an empty meaning: `down --timeout`
    and `daemon run --home` were, so what they did was in no document."""
    silent: list[str] = []

    def walk(command: click.Command, path: str) -> None:
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden and not param.help:
                silent.append(f"{path} {param.opts[-1]}")
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                walk(sub, f"{path} {name}")

    walk(main, "corral")
    assert not silent, silent
