"""corral.capture.spawn when the route ends while the child starts.

A job may return while a helper thread it started (``capture.Thread``) is starting a child:
the route's log is then closed, and its descriptor number is free for the next job's log. The
child must still get a descriptor of the route it was spawned from, never a closed one (EBADF
raised into the helper) nor another job's log. After a child, its route is left on a line
break (``capture.end_line``) only where it is a file.
"""

from __future__ import annotations

import contextlib
import io
import socket
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

import pytest

from corral import capture, jobs

pytestmark = pytest.mark.timeout(60)


def test_a_child_started_as_its_route_ends_writes_to_that_route_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine, other = tmp_path / "job1.log", tmp_path / "job2.log"
    real_popen = subprocess.Popen
    route = capture.to(mine)
    others: list[IO[str]] = []

    def popen_as_the_job_ends(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        # The job returns here (its route ends, its log is closed) and the next job opens
        # its own log, which takes the lowest free descriptor number: the one just closed.
        route.__exit__(None, None, None)
        others.append(open(other, "a", encoding="utf-8", buffering=1))  # noqa: SIM115
        return real_popen(*args, **kwargs)

    route.__enter__()
    print("before the child")
    monkeypatch.setattr(subprocess, "Popen", popen_as_the_job_ends)
    try:
        proc = capture.spawn([sys.executable, "-c", "print('child line', flush=True)"])
        assert proc.wait(20) == 0
    finally:
        monkeypatch.undo()
        route.__exit__(None, None, None)
        for f in others:
            f.close()
    assert mine.read_text() == "before the child\nchild line\n"
    assert other.read_text() == ""


@pytest.mark.parametrize("kind", ["StringIO", "socket"])
def test_a_command_run_in_a_route_that_is_not_a_file_leaves_it_sound(kind: str) -> None:
    """After a command, capture.end_line() reads back the last byte of a route's file; a
    route to a stream that is not a file (no descriptor, or a socket) is left as it is. It
    was reported as failing ("cannot write to ...; its output is dropped"), its ``error`` set:
    a job's log_error would say its log lost output when it lost nothing."""
    with contextlib.ExitStack() as stack:
        if kind == "socket":
            ours, theirs = socket.socketpair()
            stack.callback(theirs.close)
            stack.callback(ours.close)
            stream: IO[str] = stack.enter_context(ours.makefile("w", encoding="utf-8"))
        else:
            stream = io.StringIO()
        route = capture.to(stream)
        with route:
            jobs.run_command([sys.executable, "-c", "print('mid', end='', flush=True)"])
            print("next", flush=True)
        assert route.error is None
