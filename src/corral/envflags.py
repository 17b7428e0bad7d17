"""``--env``, ``--env-file`` and ``--secret`` of ``corral up``/``update``, as SkyPilot has them.

``--env KEY=VALUE`` sets a value; ``--env KEY`` takes KEY's value from the environment of the
shell running corral (an error when it has none); ``--env-file FILE`` reads ``KEY=VALUE`` lines
(dotenv: ``#`` comments, an optional ``export``, quotes around a value); ``--env`` wins over
``--env-file``. ``--secret`` is the same for secrets, whose values never show anywhere.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import click

__all__ = ["given_values", "read_env_file", "values_options"]

F = TypeVar("F", bound=Callable[..., Any])


def values_options(command: F) -> F:
    """The three options, in the order ``--help`` shows them."""
    command = click.option(
        "--secret",
        multiple=True,
        metavar="KEY[=VALUE]",
        help="A secret for the replicas' environment (KEY alone: from your environment); "
        "its value is never stored in state.db nor shown.",
    )(command)
    command = click.option(
        "--env-file",
        multiple=True,
        type=click.Path(dir_okay=False, exists=True, path_type=Path),
        help="A dotenv file of KEY=VALUE lines for the replicas' environment.",
    )(command)
    command = click.option(
        "--env",
        multiple=True,
        metavar="KEY[=VALUE]",
        help="An environment variable for the replicas (KEY alone: from your environment); "
        "gives a value to an `envs:` key left empty in the spec.",
    )(command)
    return command


def _pairs(items: Iterable[str], flag: str) -> dict[str, str]:
    values: dict[str, str] = {}
    for item in items:
        key, has_value, value = item.partition("=")
        if not key:
            raise click.BadParameter(f"{item!r}: expected KEY=VALUE or KEY", param_hint=flag)
        if not has_value:
            found = os.environ.get(key)
            if found is None:
                raise click.BadParameter(
                    f"{key} is not set in this shell's environment: give {flag} {key}=VALUE",
                    param_hint=flag,
                )
            value = found
        values[key] = value
    return values


def read_env_file(path: Path) -> dict[str, str]:
    """A dotenv file as a mapping; a line that is not ``KEY=VALUE`` is an error naming it."""
    values: dict[str, str] = {}
    text = path.read_text(encoding="utf-8")
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export ") :].lstrip()
        key, has_value, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if not has_value or not key:
            raise click.BadParameter(
                f"{path}:{number}: expected KEY=VALUE, got {raw.strip()[:40]!r}",
                param_hint="--env-file",
            )
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        elif " #" in value:
            value = value.split(" #", 1)[0].rstrip()
        values[key] = value
    return values


def given_values(
    env: Iterable[str], env_files: Iterable[Path], secret: Iterable[str]
) -> tuple[dict[str, str], dict[str, str]]:
    """(envs, secrets) from the three options."""
    envs: dict[str, str] = {}
    for path in env_files:
        envs.update(read_env_file(path))
    envs.update(_pairs(env, "--env"))
    return envs, _pairs(secret, "--secret")
