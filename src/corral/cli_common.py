"""What every `corral` command shares: the consoles, failing with a message, the home, and a
client of its daemon."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NoReturn

import click
from rich.console import Console

from corral.client import Client, ClientError, ensure_daemon

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


def home_of(ctx: click.Context) -> Path:
    return Path(ctx.obj["home"])


def fail(message: str, code: int = 1) -> NoReturn:
    err.print(f"[red]error:[/red] {message}", markup=True, soft_wrap=True)
    sys.exit(code)


def client_of(ctx: click.Context, *, start: bool) -> Client:
    home = home_of(ctx)
    if start:
        try:
            return ensure_daemon(home)
        except ClientError as exc:
            fail(str(exc))
    return Client(home)


def client_error_text(exc: ClientError) -> str:
    body = exc.body if isinstance(exc.body, dict) else {}
    if body.get("text"):
        return f"{exc}:\n{body['text']}"
    return str(exc)
