"""`--timeout` of `up`, `update` and `down`: a number of seconds, or refused before anything.

Why: `up --timeout -1` started the service and then said "not READY after -1s", and `nan`
meant "wait for ever"; neither is what the user typed. Checked on the option's type, without
running the commands: an unfixed `up` would start a daemon and a service.
"""

from __future__ import annotations

import click
import pytest

from corral.cli import main


def _timeout_type(command: str) -> click.ParamType:
    assert isinstance(main, click.Group)
    found = main.commands[command]
    return next(p.type for p in found.params if p.name == "timeout")


@pytest.mark.parametrize("command", ["up", "update", "down"])
@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "-inf", "soon"])
def test_a_timeout_that_is_no_duration_is_refused(command: str, value: str) -> None:
    with pytest.raises(click.BadParameter) as refused:
        _timeout_type(command).convert(value, None, None)
    assert "seconds" in str(refused.value)


@pytest.mark.parametrize("command", ["up", "update", "down"])
def test_a_timeout_in_seconds_is_read(command: str) -> None:
    assert _timeout_type(command).convert("2.5", None, None) == 2.5
    assert _timeout_type(command).name == "float"  # the help (and docs/cli.md) say FLOAT
