"""corral.capture.spawn when the route ends while the child starts.

A job may return while a helper thread it started (``capture.Thread``) is starting a child:
the route's log is then closed, and its descriptor number is free for the next job's log. The
child must still get a descriptor of the route it was spawned from, never a closed one (EBADF
raised into the helper) nor another job's log.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import IO, Any

import pytest

from corral import capture

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
