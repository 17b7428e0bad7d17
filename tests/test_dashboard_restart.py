"""The dashboard's address and its signed-in tabs across daemon restarts (issue 25).

A daemon keeps one port per home (corral.daemon_port) and the dashboard's sessions in the home
(corral.dashboard.session): a stop and start, and a SIGKILL with the workers' respawn, leave
the port and the cookie working. A remembered port that someone else took is said, and left.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
from pathlib import Path

from conftest import CorralHome, finished, spec_text, wait_for, write_spec
from test_dashboard import port_of, request, sign_in

from corral.daemon_port import PORT_FILE
from corral.dashboard.session import SESSIONS_FILE, Sessions


def session_works(port: int, cookie: str) -> bool:
    status, _, _ = request(port, "GET", "/ui/api/services/keep/history", headers={"Cookie": cookie})
    return status == 200


def new_daemon(home: CorralHome, old: int) -> int | None:
    info = home.daemon_info()
    if info is None or info["pid"] == old or not home.healthy():
        return None
    return int(info["pid"])


def test_a_restart_and_a_sigkill_keep_the_port_and_the_signed_in_tab(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    home = corral_home
    home.env["CORRAL_DAEMON_RESPAWN"] = "1"
    home.env["CORRAL_BALANCER_WORKERS"] = "1"  # one worker: one respawn
    home.run("up", str(write_spec(tmp_path / "keep.yaml", spec_text("keep", 1))))
    home.wait_replicas("keep", 1)
    port = port_of(home)
    assert (home.path / PORT_FILE).read_text().strip() == str(port)
    name, session = sign_in(home)
    assert name == f"corral_session_{port}"
    cookie = f"{name}={session}"
    assert session_works(port, cookie)
    saved = (home.path / SESSIONS_FILE).read_text()
    assert session not in saved  # only hashes are kept
    assert stat.S_IMODE(os.stat(home.path / SESSIONS_FILE).st_mode) == 0o600

    # A stop and a start (an upgrade is this): same port, the tab still signed in.
    old = home.daemon_pid()
    home.run("daemon", "stop")
    wait_for(lambda: finished(old), 20, "the daemon to stop")
    home.run("daemon", "start")
    assert home.daemon_pid() != old
    assert port_of(home) == port
    assert session_works(port, cookie)
    assert json.loads(home.run("status", "--json").stdout)["services"][0]["name"] == "keep"

    # A SIGKILL: a worker starts the daemon again, on the same port, the session kept.
    old = home.daemon_pid()
    os.kill(old, signal.SIGKILL)
    new = wait_for(lambda: new_daemon(home, old), 30, "a worker to start a new daemon")
    home.daemon_pids.add(new)
    assert port_of(home) == port
    assert session_works(port, cookie)
    # Signing out ends the session for the next daemon too.
    status, _, _ = request(
        port, "POST", "/ui/api/logout", headers={"Cookie": cookie, "X-Corral-UI": "1"}
    )
    assert status == 200 and not session_works(port, cookie)


def test_a_remembered_port_taken_by_another_process_is_said_and_left(
    corral_home: CorralHome,
) -> None:
    home = corral_home
    home.start_daemon()
    port = port_of(home)
    home.stop_daemon()
    squatter = socket.socket()
    try:
        # (SO_REUSEADDR: the old daemon's connections may hold the port in TIME_WAIT)
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        home.start_daemon()
        moved = port_of(home)
        assert moved != port
        note = home.daemon_info()["port_moved"]  # type: ignore[index]
        assert f"({port}) is taken by pid {os.getpid()}" in note, note
        assert f"moved to port {moved}" in note, note
        assert note in (home.path / "daemon.log").read_text()
        link = home.run("dashboard")
        assert link.stdout.startswith(f"http://127.0.0.1:{moved}/ui/login?once=")
        assert f"note: {note}" in link.stderr
        assert (home.path / PORT_FILE).read_text().strip() == str(moved)
    finally:
        squatter.close()
    # The new port is the home's from now on; no note when it is had.
    home.stop_daemon()
    home.start_daemon()
    assert port_of(home) == moved
    assert home.daemon_info()["port_moved"] is None  # type: ignore[index]
    assert "note:" not in home.run("dashboard").stderr


def test_sessions_in_the_home_are_hashes_and_end_with_the_token(tmp_path: Path) -> None:
    now = [1000.0]
    path = tmp_path / SESSIONS_FILE
    token = "the-token-" + "x" * 30
    first = Sessions(token, clock=lambda: now[0], path=path)
    session = first.login(token)
    assert session and session not in path.read_text()
    again = Sessions(token, clock=lambda: now[0], path=path)
    assert again.valid(session)  # a new daemon of the home
    other = Sessions("another-token-" + "y" * 30, clock=lambda: now[0], path=path)
    assert not other.valid(session)  # a new token: the old sessions are not its
    now[0] += 8 * 3600 + 1
    assert not Sessions(token, clock=lambda: now[0], path=path).valid(session)  # idle
