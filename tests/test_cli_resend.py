"""`up`/`update`/`down` whose request the daemon's own crash cut (corral.cli_resend): the
workers start the daemon again, and the CLI sends an idempotent `down` again, and an
`update` again only when it was not stored. It used to end with "start it with `corral
daemon start`" while the workers were starting one, the `down` lost (the service kept
serving)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from subprocess import CompletedProcess

from conftest import CorralHome, spec_text, write_spec

from corral.cli_nodaemon import RESPAWN_NOTE

# `corral ARGS` with the daemon killed during its first request of ``CUT`` (down, update):
# ``before`` stops it (so the request waits unanswered) and kills it 0.5 s later, cutting the
# connection: the request was never handled. ``after`` lets the request be handled, then
# kills the daemon and loses the answer, as a crash between the commit and the reply.
CUT_CLI = """
import os, signal, sys, threading
from corral import client

method, when, pid = os.environ["CUT"], os.environ["CUT_WHEN"], int(os.environ["CUT_PID"])
real = getattr(client.Client, method)
state = {"cut": False}


def cut(self, *args, **kwargs):
    if state["cut"]:
        return real(self, *args, **kwargs)
    state["cut"] = True
    if when == "before":
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
        return real(self, *args, **kwargs)
    if when == "late":  # no crash: the answer is late, and the daemon handles it after
        threading.Timer(1.0, real, (self, *args), kwargs).start()
        raise client.DaemonUnreachable("it did not answer in time (test)")
    real(self, *args, **kwargs)
    os.kill(pid, signal.SIGKILL)
    raise client.DaemonUnreachable("the connection was cut (test)")


setattr(client.Client, method, cut)
sys.argv = ["corral", *sys.argv[1:]]
from corral.cli import main

main()
"""


def cut_proc(home: CorralHome, method: str, when: str, *args: str) -> CompletedProcess[str]:
    """``corral ARGS`` with its ``method`` request cut as ``when`` says (see CUT_CLI)."""
    env = {**home.env, "CUT": method, "CUT_WHEN": when, "CUT_PID": str(home.daemon_pid())}
    return subprocess.run(
        [sys.executable, "-c", CUT_CLI, *args],
        env=env,
        cwd=home.path.parent,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=90,
    )


def cut_run(home: CorralHome, method: str, when: str, *args: str) -> str:
    """``corral ARGS`` with the daemon's crash cutting its ``method`` request; its output."""
    result = cut_proc(home, method, when, *args)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert RESPAWN_NOTE in output and "corral daemon start" not in output, output
    home.wait_for(home.healthy, 30, "the daemon started again")
    home.note_daemon()
    return output


def versions(home: CorralHome, name: str) -> list[int]:
    service = home.service(name)
    assert service is not None
    return [int(v["version"]) for v in service["versions"]]


def test_requests_cut_by_the_daemons_crash_are_sent_again_only_when_not_applied(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    corral_home.env["CORRAL_DAEMON_RESPAWN"] = "1"
    corral_home.env["CORRAL_BALANCER_WORKERS"] = "1"  # one respawn (test_cli_first_hour)
    spec = write_spec(tmp_path / "s.yaml", spec_text("phoenix", 1))
    corral_home.run("daemon", "start")
    # Created, the answer lost: `up` goes on with it (sent again, it would be refused: 409).
    output = cut_run(corral_home, "create", "after", "up", str(spec))
    assert "(version 1 stored): going on" in output and "is READY" in output, output

    # Stored, the answer lost: not sent again (a second update would make version 3).
    output = cut_run(corral_home, "update", "after", "update", "phoenix", str(spec), "-d")
    assert "version 2 stored): going on" in output, output
    assert versions(corral_home, "phoenix") == [1, 2]
    # Never handled: sent again, stored once.
    output = cut_run(corral_home, "update", "before", "update", "phoenix", str(spec), "-d")
    assert "sending it again" in output and "version 3 accepted" in output, output
    assert versions(corral_home, "phoenix") == [1, 2, 3]
    # Late, not cut: the same daemon answers and stores it itself: never sent twice (the
    # process ends once the late request is answered).
    late = cut_proc(corral_home, "update", "late", "update", "phoenix", str(spec), "-d")
    assert late.returncode == 1 and "did not answer in time" in late.stderr, late
    assert versions(corral_home, "phoenix") == [1, 2, 3, 4]
    # So is a `down --replica-id`: that replica goes (and is replaced).
    replica = str(corral_home.wait_replicas("phoenix", 1, timeout=60)["replicas"][0]["id"])
    args = ("down", "phoenix", "--replica-id", replica, "-y")
    output = cut_run(corral_home, "terminate_replica", "before", *args)
    assert f"asking again to take replica {replica} of phoenix down" in output, output
    assert "a replacement starts" in output, output
    # A down never handled is sent again: the service goes.
    output = cut_run(corral_home, "down", "before", "down", "phoenix", "-y")
    assert "asking again to take phoenix down" in output, output
    assert "service phoenix: down" in output, output
    assert corral_home.service("phoenix") is None
    # A down handled, its answer lost: asked again, the service going down (or gone) is done.
    corral_home.run("up", str(write_spec(tmp_path / "e.yaml", spec_text("ember", 1))))
    output = cut_run(corral_home, "down", "after", "down", "ember", "-y")
    assert "asking again to take ember down" in output and "service ember: down" in output
    assert corral_home.service("ember") is None
    assert os.path.isdir(corral_home.path)


def test_a_replica_down_done_before_the_crash_is_not_an_error(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """`down --replica-id` handled, its answer lost to the daemon's crash: sent again, the
    replica is shutting down already (409), or purged (404). That is what was asked: exit 0
    saying so, not the refusal as an error (exit 1) for a request that was done."""
    corral_home.env["CORRAL_DAEMON_RESPAWN"] = "1"
    corral_home.env["CORRAL_BALANCER_WORKERS"] = "1"
    spec = write_spec(tmp_path / "s.yaml", spec_text("cinder", 1))
    corral_home.run("up", str(spec))
    replica = str(corral_home.wait_replicas("cinder", 1, timeout=60)["replicas"][0]["id"])
    args = ("down", "cinder", "--replica-id", replica, "-y")
    output = cut_run(corral_home, "terminate_replica", "after", *args)
    assert f"asking again to take replica {replica} of cinder down" in output, output
    # Shutting down still, or torn down and forgotten already (a replica stops fast).
    done = re.search(rf"replica {replica} of cinder is (shutting down|gone) \(asked before", output)
    assert done, output
    corral_home.run("down", "cinder", "-y")


def test_a_refusal_of_the_resent_replica_down_says_what_the_first_one_did() -> None:
    """Read from the second ask's refusal: shutting down already (the daemon marks that 409),
    or gone; any other refusal (a failed replica kept without --purge) stays an error."""
    from corral import cli_resend
    from corral.api_errors import status_of
    from corral.client import ClientError
    from corral.errors import ReplicaGoing

    going = ReplicaGoing("replica 2 of 'web' is already shutting down")
    refused = ClientError(
        going.message, status_of(going), {"error": going.message, **going.details}
    )
    assert "is shutting down" in str(cli_resend._done_before(refused, "web", 2, purge=False))
    gone = ClientError("service 'web' has no replica 2", 404, {"error": "..."})
    assert "is forgotten" in str(cli_resend._done_before(gone, "web", 2, purge=True))
    kept = ClientError("replica 2 of 'web' is FAILED: ...", 409, {"error": "..."})
    assert cli_resend._done_before(kept, "web", 2, purge=False) is None
