"""What every `corral` command shares: the consoles, failing with a message, the home, and a
client of its daemon.

Every `corral` command pays for what this module imports before it does anything, so it
imports little: the consoles are built (and rich imported) on their first use, and the client
module (http.client, ssl) only when a command asks for a client.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast

import click

from corral.cli_start import EXIT_INTERRUPTED, commands_take_over

if TYPE_CHECKING:
    from rich.console import Console

    from corral.client import Client, ClientError


class _Seconds(click.ParamType[float]):
    """A wait in seconds: a finite number above 0. click's float takes -1 (then "not READY after
    -1s", once the service has started anyway) and nan (a wait that never ends)."""

    name = "float"  # the help's metavar stays FLOAT (docs/cli.md)

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            seconds = math.nan
        if not (math.isfinite(seconds) and seconds > 0):
            self.fail(f"expected a number of seconds above 0, got {value!r}", param, ctx)
        return seconds


SECONDS = _Seconds()


class _LazyConsole:
    """A rich Console made on first use: `corral status --json` or a one-line answer need no
    rich (about 25 ms of imports). Off a terminal nothing wraps (``soft_wrap``), so a file name
    piped to a file or a grep is never cut in two at 80 columns."""

    def __init__(self, *, stderr: bool) -> None:
        self._stderr = stderr
        self._console: Console | None = None

    def _real(self) -> Console:
        if self._console is None:
            from rich.console import Console

            stream = sys.stderr if self._stderr else sys.stdout
            self._console = Console(
                stderr=self._stderr,
                highlight=False,
                soft_wrap=not _is_tty(stream),
            )
        return self._console

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real(), name)


def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


out = cast("Console", _LazyConsole(stderr=False))
err = cast("Console", _LazyConsole(stderr=True))


def console(width: int) -> Console:
    """A console for tables ``width`` columns wide at least (rows are never cut)."""
    from rich.console import Console

    return Console(highlight=False, width=max(out.width, width))


def home_of(ctx: click.Context) -> Path:
    return Path(ctx.obj["home"])


def fail(message: str, code: int = 1) -> NoReturn:
    err.print(f"[red]error:[/red] {message}", markup=True, soft_wrap=True)
    sys.exit(code)


def interrupted(message: str) -> NoReturn:
    err.print(f"\n[yellow]interrupted:[/yellow] {message}", markup=True, soft_wrap=True)
    sys.exit(EXIT_INTERRUPTED)


def client_of(ctx: click.Context, *, start: bool) -> Client:
    """A client of the home's daemon: started if none answers (``start``), else the one that
    answers, after waiting a few seconds for one that crashed and is being started again
    (then ``client.answered`` is False: its requests say the daemon is not reachable)."""
    from corral.cli_nodaemon import await_respawn
    from corral.client import Client, ClientError, ensure_daemon

    home = home_of(ctx)
    if start:
        try:
            return ensure_daemon(home)
        except ClientError as exc:
            fail(str(exc))
    client = Client(home)
    client.answered = await_respawn(client, say)
    return client


def say(text: str) -> None:
    """A line for the user on stderr (not the command's output), as written."""
    err.print(text, soft_wrap=True, markup=False)


def client_error_text(exc: ClientError) -> str:
    body = exc.body if isinstance(exc.body, dict) else {}
    if body.get("text"):
        return f"{exc}:\n{body['text']}"
    return str(exc)


class CorralGroup(click.Group):
    """The `corral` group: start-up's quiet Ctrl-C ends when a command runs (see cli_start),
    and a Ctrl-C that no command turns into a message of its own is one line and exit code
    130, not click's "Aborted!" with exit code 1 (which says nothing of what stopped)."""

    def invoke(self, ctx: click.Context) -> Any:
        commands_take_over()
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            interrupted(f"`corral {ctx.invoked_subcommand}` stopped")


def stuck_replicas(service: dict[str, Any]) -> str:
    """The replicas of ``service`` whose teardown failed, each with why and its pid, or ""."""
    parts = [
        f"replica {r['id']} ({r.get('failure') or 'no detail'}"
        + (f", pid {r['pid']}" if r.get("pid") else "")
        + ")"
        for r in service.get("replicas") or ()
        if r.get("status") == "FAILED_CLEANUP"
    ]
    return ", ".join(parts)
