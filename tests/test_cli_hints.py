"""Errors that say what to do next, where a SkyServe user's first try goes wrong: `update` of
a name that does not exist points to `up` (as `up` of one that exists points to `update`,
tests/test_cli_first_hour.py), `down` says what to give, and a command YAML reads as a mapping
(in `setup:` as in `run:`, on its line or below it) points to a block.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import CorralHome, spec_text, write_spec

from corral.cli import main


def _corral(tmp_path: Path, *args: str) -> tuple[int, str]:
    """The command in this process, without a daemon: (exit code, what it said on stderr)."""
    result = CliRunner().invoke(main, ["--home", str(tmp_path / "home"), *args])
    return result.exit_code, result.stderr


def test_update_of_a_name_that_does_not_exist_points_to_up(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    spec = write_spec(tmp_path / "new.yaml", spec_text("new", 1))
    corral_home.run("daemon", "start")
    result = corral_home.run("update", "nosuch", str(spec), check=False)
    assert result.returncode == 1
    assert "no service named 'nosuch'" in result.stderr, result.stderr
    assert f"`corral up {spec} -n nosuch`" in result.stderr, result.stderr
    # A rollback names no file: nothing to start, so no hint.
    rollback = corral_home.run("update", "nosuch", "--to-version", "1", check=False)
    assert rollback.returncode == 1 and "corral up" not in rollback.stderr, rollback.stderr
    assert corral_home.status() == []


def test_down_says_what_to_give(tmp_path: Path) -> None:
    code, said = _corral(tmp_path, "down")
    assert code == 1 and "not both" not in said, said
    assert "name the services to take down" in said and "-a/--all" in said, said
    code, said = _corral(tmp_path, "down", "svc", "--all")
    assert code == 1 and "name services or give -a/--all, not both" in said, said
    code, said = _corral(tmp_path, "down", "a", "b", "--replica-id", "1")
    assert code == 1 and "--replica-id takes exactly one service name" in said, said
    assert not (tmp_path / "home" / "daemon.json").exists()


def test_update_says_what_to_give(tmp_path: Path) -> None:
    """The flag the user typed, not the API's field; both given is "not both"."""
    spec = tmp_path / "svc.yaml"
    spec.write_text("run: x\n")
    code, said = _corral(tmp_path, "update", "svc")
    assert code == 1 and "give the new spec FILE, or --to-version N" in said, said
    code, said = _corral(tmp_path, "update", "svc", str(spec), "--to-version", "1")
    assert code == 1 and "not both" in said, said
    code, said = _corral(tmp_path, "update", "svc", "--to-version", "0")
    assert code == 1 and "--to-version: versions count from 1, not 0" in said, said
    assert "from_version" not in said
    assert not (tmp_path / "home" / "daemon.json").exists()


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('setup: echo "a: b"\nrun: exec x $PORT\n', "setup"),
        ("run:\n  echo: hi\n", "run"),
        ("run: echo a: b; echo c\n", "run"),
    ],
)
def test_a_command_read_as_a_mapping_hints_at_a_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, key: str
) -> None:
    (tmp_path / "s.yaml").write_text(f"name: s\n{text}service:\n  readiness_probe: /\n")
    monkeypatch.chdir(tmp_path)
    code, said = _corral(tmp_path, "validate", "s.yaml")
    assert code == 1
    assert f"write the command as a block: `{key}: |`" in said, said


@pytest.mark.parametrize("kind", ["file", "dangling"])
def test_daemon_run_home_is_checked_as_the_groups_home(tmp_path: Path, kind: str) -> None:
    """`corral daemon run --home` is checked as `corral --home` is (one line, exit 78): it
    was click's usage error for a file, and a dangling symlink got a daemon serving a home
    made at the symlink's target."""
    home = tmp_path / kind
    if kind == "file":
        home.write_text("")
    else:
        home.symlink_to(tmp_path / "nowhere")
    result = CliRunner().invoke(
        main, ["--home", str(tmp_path / "ok"), "daemon", "run", "--home", str(home)]
    )
    assert result.exit_code == 78, result.output
    assert "CORRAL_HOME (or --home)" in result.stderr, result.stderr
    assert not (tmp_path / "nowhere").exists()
