"""What a SkyServe user meets in their first hour with `corral`, and was wrong once: every
command slow to start (importing all of the CLI), a traceback for Ctrl-C while it starts,
"run `corral daemon start`" while corral restarts a crashed daemon by itself, errors for a home
with no services, `validate` cutting file names at 80 columns in a pipe, and messages that did
not point to the next step.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import click
from click.testing import CliRunner
from conftest import APPS, CorralHome, finished, spec_text, write_spec

from corral.cli_common import CorralGroup
from corral.cli_nodaemon import RESPAWN_NOTE
from corral.cli_start import as_program

# What `corral status` must not import: the spec layer, the daemon's and the tables' libraries.
HEAVY = ("pydantic", "yaml", "rich", "aiohttp", "psutil", "asyncio", "corral.spec", "corral.deploy")

# `corral status` as the console script runs it, then the heavy modules it imported.
STATUS_IMPORTS = """
import sys
sys.argv = ["corral", "status"]
from corral.cli import main
try:
    main()
finally:
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r} or m in {heavy!r})
    print("IMPORTED", heavy, file=sys.stderr)
"""

# Ctrl-C arrives while the CLI imports click: the first of its slow imports.
CTRL_C_AT_IMPORT = """
import builtins, os, signal, sys
sys.argv = ["corral", "status"]
real = builtins.__import__
def hook(name, *args, **kwargs):
    if name == "click":
        os.kill(os.getpid(), signal.SIGINT)
    return real(name, *args, **kwargs)
builtins.__import__ = hook
from corral.cli import main
main()
"""


def _python(home: CorralHome, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        env=home.env,
        cwd=home.path.parent,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_status_imports_only_what_it_needs(corral_home: CorralHome) -> None:
    for daemon in (False, True):
        if daemon:
            corral_home.run("daemon", "start")
        result = _python(corral_home, STATUS_IMPORTS.format(heavy=HEAVY))
        assert result.returncode == 0, result.stderr
        assert "no services" in result.stdout
        assert "IMPORTED []" in result.stderr, result.stderr


def test_ctrl_c_while_starting_is_one_line_and_130(corral_home: CorralHome) -> None:
    result = _python(corral_home, CTRL_C_AT_IMPORT)
    assert result.returncode == 130, result
    assert result.stderr.strip() == "interrupted while corral was starting: nothing was done"
    # A program that imports the CLI (a test, a benchmark) keeps Python's own Ctrl-C.
    assert as_program("/venv/bin/corral") and as_program("/src/corral/__main__.py")
    assert not as_program("-c") and not as_program("/venv/bin/pytest")


def test_ctrl_c_in_a_command_is_one_line_and_130() -> None:
    @click.group(cls=CorralGroup)
    def group() -> None:
        pass

    @group.command()
    def slow() -> None:
        raise KeyboardInterrupt

    result = CliRunner().invoke(group, ["slow"])
    assert result.exit_code == 130, result.output
    assert "interrupted: `corral slow` stopped" in result.output
    assert "Aborted" not in result.output and "Traceback" not in result.output


def test_a_home_with_no_services_answers_without_a_daemon(corral_home: CorralHome) -> None:
    status = corral_home.run("status")
    assert status.stdout == "no services\n" and status.stderr == ""
    assert json.loads(corral_home.run("status", "--json").stdout) == {"services": []}
    down = corral_home.run("down", "-a", "-y")
    assert down.stdout == "No existing services.\n", down
    named = corral_home.run("down", "nothing-here", "-y", check=False)
    assert named.returncode == 1 and "has no services" in named.stderr, named
    assert corral_home.daemon_info() is None, "a daemon was started only to say nothing runs"


def test_down_all_starts_a_daemon_for_a_home_with_services(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    corral_home.run("up", "-d", str(write_spec(tmp_path / "s.yaml", spec_text("kept", 1))))
    corral_home.run("daemon", "stop")
    assert corral_home.daemon_info() is None
    down = corral_home.run("down", "-a", "-y")
    assert "service kept: down" in down.stdout, down
    assert corral_home.status() == []


def test_update_and_down_of_a_replica_start_a_daemon_after_a_stop(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """`corral daemon stop` says the next daemon is started by the commands that change a
    service: `update` and `down --replica-id` once failed with "start one" instead."""
    spec = str(write_spec(tmp_path / "s.yaml", spec_text("kept", 1)))
    corral_home.run("up", spec)
    corral_home.run("daemon", "stop")
    update = corral_home.run("update", "kept", spec, "-d", check=False)
    assert update.returncode == 0 and "version 2 accepted" in update.stdout, update
    corral_home.run("daemon", "stop")
    gone = corral_home.run("down", "kept", "--replica-id", "1", "-y", check=False)
    assert gone.returncode == 0, gone
    assert corral_home.daemon_info() is not None
    corral_home.run("down", "-a", "-y")
    corral_home.run("daemon", "stop")
    none = corral_home.run("update", "nothing-here", spec, check=False)
    assert none.returncode == 1 and "corral daemon start" in none.stderr, none
    assert corral_home.daemon_info() is None, "a daemon was started only to say nothing runs"


def test_after_a_daemon_crash_commands_wait_for_its_restart(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    corral_home.env["CORRAL_DAEMON_RESPAWN"] = "1"
    # One worker, so one respawn: with two, each may start a daemon, and the slower one can
    # take the home after the first was stopped on purpose (a race of the workers', not the
    # CLI's, reported separately).
    corral_home.env["CORRAL_BALANCER_WORKERS"] = "1"
    corral_home.run("up", str(write_spec(tmp_path / "p.yaml", spec_text("phoenix", 1))))
    old = corral_home.daemon_pid()
    os.kill(old, signal.SIGKILL)
    corral_home.wait_for(lambda: finished(old), 10, "the daemon to die")
    result = corral_home.run("status", "--json")
    assert RESPAWN_NOTE in result.stderr, result.stderr
    assert [s["name"] for s in json.loads(result.stdout)["services"]] == ["phoenix"]
    new = corral_home.daemon_pid()
    assert new != old
    # Stopped on purpose: nothing is awaited; the log is read from disk, and the note says how
    # to start a daemon to follow it.
    corral_home.run("daemon", "stop")
    stopped = corral_home.run("logs", "phoenix", "1", "--no-follow")
    assert "as it is on disk" in stopped.stderr and "corral daemon start" in stopped.stderr
    assert RESPAWN_NOTE not in stopped.stderr


def test_up_waits_through_a_daemon_crash_and_its_restart(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """`corral up` waiting for READY failed (exit 1, "start it with `corral daemon start`")
    when the daemon crashed meanwhile, though the workers started it again and the service
    became READY: a script's `corral up && ...` stopped on a deploy that worked."""
    corral_home.env["CORRAL_DAEMON_RESPAWN"] = "1"
    corral_home.env["CORRAL_BALANCER_WORKERS"] = "1"  # one respawn (see above)
    corral_home.run("daemon", "start")
    old = corral_home.daemon_pid()
    spec = write_spec(tmp_path / "s.yaml", spec_text("phoenix", 1, setup="sleep 4"))
    up = corral_home.popen("up", str(spec))
    corral_home.wait_for(
        lambda: (corral_home.service("phoenix") or {}).get("replicas"), 20, "a replica row"
    )
    os.kill(old, signal.SIGKILL)
    out, _ = up.communicate(timeout=60)
    assert up.returncode == 0, out.decode()
    assert RESPAWN_NOTE in out.decode() and "is READY" in out.decode(), out.decode()


def test_down_waits_through_a_daemon_crash_and_its_restart(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """The same for `corral down`: its replica ignores SIGTERM, so its teardown takes the
    grace, and the daemon is killed meanwhile; the restarted one finishes the teardown."""
    corral_home.env["CORRAL_DAEMON_RESPAWN"] = "1"
    corral_home.env["CORRAL_BALANCER_WORKERS"] = "1"  # one respawn (see above)
    run = f"trap '' TERM; exec {sys.executable} app.py"
    corral_home.run("up", str(write_spec(tmp_path / "s.yaml", spec_text("phoenix", 1, run=run))))
    old = corral_home.daemon_pid()
    down = corral_home.popen("down", "phoenix", "-y")
    corral_home.wait_for(
        lambda: (corral_home.service("phoenix") or {}).get("status") == "SHUTTING_DOWN",
        20,
        "the teardown to start",
    )
    os.kill(old, signal.SIGKILL)
    out, _ = down.communicate(timeout=60)
    assert down.returncode == 0, out.decode()
    assert RESPAWN_NOTE in out.decode() and "service phoenix: down" in out.decode(), out.decode()


def test_whether_to_wait_for_a_respawn_is_what_the_last_daemon_told_the_workers(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """The CLI guessed from a worker's environment whether it would restart a crashed daemon,
    but workers outlive daemons and do as the last one that adopted them said: workers started
    under CORRAL_DAEMON_RESPAWN=0, then adopted by a daemon without it, restart it while the
    CLI told the user to start one; the other way round it waited for a daemon that was not
    coming."""
    corral_home.env["CORRAL_BALANCER_WORKERS"] = "1"  # one respawn (see the test above)
    corral_home.env["CORRAL_DAEMON_RESPAWN"] = "0"
    corral_home.run("up", str(write_spec(tmp_path / "p.yaml", spec_text("phoenix", 1))))
    corral_home.run("daemon", "stop")  # the worker keeps serving, started with "0"
    respawning = {**corral_home.env, "CORRAL_DAEMON_RESPAWN": "1"}
    old = corral_home.start_daemon(env=respawning)  # adopts it: "restart me" now
    greeted(corral_home)
    os.kill(old, signal.SIGKILL)
    corral_home.wait_for(lambda: finished(old), 10, "the daemon to die")
    result = corral_home.run("status", "--json", env=respawning)
    assert RESPAWN_NOTE in result.stderr, result.stderr
    corral_home.wait_for(
        lambda: (corral_home.note_daemon() or old) != old and corral_home.healthy(),
        60,
        "the worker to start a daemon again",
    )
    corral_home.run("daemon", "restart-workers")  # a worker started with "1"
    corral_home.run("daemon", "stop")
    last = corral_home.start_daemon()  # "0" again: the worker will not restart it
    greeted(corral_home)
    os.kill(last, signal.SIGKILL)
    corral_home.wait_for(lambda: finished(last), 10, "the daemon to die")
    result = corral_home.run("status", check=False)
    assert RESPAWN_NOTE not in result.stderr, result.stderr
    assert "corral daemon start" in result.stderr, result.stderr


def greeted(home: CorralHome) -> None:
    """Wait until the daemon has greeted its balancer worker (what it said about respawning
    is then in the worker's socket, whatever happens to the daemon next)."""

    def connected() -> bool:
        info = json.loads(home.run("daemon", "status", "--json").stdout)
        workers = info.get("balancer_workers") or []
        return bool(workers) and all(w.get("connected") for w in workers)

    home.wait_for(connected, 30, "the daemon to greet its worker")


def test_validate_never_wraps_off_a_terminal(corral_home: CorralHome, tmp_path: Path) -> None:
    deep = tmp_path / ("a-directory-with-a-long-name-" * 4) / "and-another-one-below-it"
    spec = write_spec(deep / "service-spec-with-a-long-file-name.yaml", spec_text("wide", 1))
    good = corral_home.run("validate", str(spec), cwd=tmp_path)
    assert f"{spec}: valid" in good.stdout.splitlines(), good.stdout
    bad = write_spec(
        deep / "broken-service-spec.yaml", "name: x\nrun: y\nservice: {replicas: -1}\n"
    )
    refused = corral_home.run("validate", str(bad), check=False)
    assert refused.returncode == 1
    assert f"{bad}: 1 problem(s)" in refused.stderr.splitlines(), refused.stderr


def test_validate_json_is_json_for_a_directory_too(corral_home: CorralHome, tmp_path: Path) -> None:
    """docs/spec.md: `--json` always prints the document, also for a bad spec; a directory
    given as the file was click's usage text (exit 2) instead."""
    result = corral_home.run("validate", "--json", str(tmp_path), check=False)
    assert result.returncode == 1, result
    document = json.loads(result.stdout)
    assert document["valid"] is False and document["spec"] is None
    (error,) = document["errors"]
    assert "is a directory" in error["message"], error


def test_messages_point_to_the_next_step(corral_home: CorralHome, tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "twice.yaml", spec_text("twice", 1))
    corral_home.run("up", "-d", str(spec))
    again = corral_home.run("up", str(spec), check=False)
    assert again.returncode == 1
    assert f"`corral update twice {spec}`" in again.stderr, again.stderr
    bare = corral_home.run("down", check=False)
    assert bare.returncode == 1 and "not both" not in bare.stderr
    assert "-a/--all" in bare.stderr
    table = corral_home.run("daemon", "status").stdout
    assert "pid" in table and "balancer workers" in table and not table.startswith("{"), table
    assert re.search(r"launch: \d+ running of 16", table) and "{'" not in table, table
    document = json.loads(corral_home.run("daemon", "status", "--json").stdout)
    assert document["pid"] == corral_home.daemon_pid()


def test_run_written_as_a_mapping_hints_at_a_block(corral_home: CorralHome, tmp_path: Path) -> None:
    spec = write_spec(
        tmp_path / "colon.yaml",
        textwrap.dedent(
            """\
            name: colon
            run: echo "a: b"
            service:
              readiness_probe: /
            """
        ),
    )
    result = corral_home.run("validate", str(spec), check=False)
    assert result.returncode == 1
    assert "run: |" in result.stderr, result.stderr


def test_a_remote_api_that_does_not_answer_is_an_error(corral_home: CorralHome) -> None:
    """$CORRAL_API_URL names a daemon elsewhere: an empty home here says nothing of its
    services, so no answer from it is an error, not "no services"."""
    remote = {"CORRAL_API_URL": "http://127.0.0.1:9", "CORRAL_API_TOKEN": "x" * 43}
    result = corral_home.run("status", check=False, env=remote)
    assert result.returncode == 1 and "is not reachable" in result.stderr, result
    down = corral_home.run("down", "-a", "-y", check=False, env=remote)
    assert down.returncode == 1 and "is not reachable" in down.stderr, down


def test_a_starting_replica_shows_what_its_last_probe_got(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """A readiness path that answers 503 is told apart from an app not listening: the
    replica's view and `corral status` carry the last probe's result while it is STARTING."""
    run = f"exec {sys.executable} faulty.py --mode flap --up 0 --down 600"
    spec = write_spec(tmp_path / "sick.yaml", spec_text("sick", 1, run=run, workdir=APPS))
    corral_home.run("up", str(spec), "--detach")

    def probed() -> dict[str, object] | None:
        svc = corral_home.service("sick")
        replicas = svc["replicas"] if svc else []
        return replicas[0] if replicas and replicas[0].get("last_probe") == "HTTP 503" else None

    replica = corral_home.wait_for(probed, 30, "the last probe's 503 in the replica's view")
    assert replica["status"] == "STARTING", replica
    shown = corral_home.run("status", "sick").stdout
    assert "last probe: HTTP 503" in shown, shown


def test_a_command_that_cannot_start_fails_at_once_with_the_shells_line(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """`run: pyhton3 ...`: the shell cannot find it (exit 127). `up` ends at the first
    failure, not after three relaunches, and says what the shell said."""
    text = spec_text("typo", 2, run="pyhton3 -m http.server $PORT")
    spec = write_spec(tmp_path / "typo.yaml", text)
    result = corral_home.run("up", str(spec), "-y", check=False, timeout=60)
    assert result.returncode != 0
    said = result.stdout + result.stderr
    assert "code 127" in said and "pyhton3" in said and "not found" in said, said
    svc = corral_home.service("typo")
    assert svc is not None and svc["status"] == "FAILED", svc
    assert len(svc["replicas"]) <= 2, svc["replicas"]  # no relaunches after the first failures
