"""A service whose replicas keep failing to start waits longer before each relaunch (the
backoff of corral.relaunch). `status` must say when the next attempt comes and why it waits:
`last_decision` alone gave the seconds left when the controller last stepped, and the text
view nothing at all."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from conftest import CorralHome, wait_for, write_spec

from corral import cliview

# Serves while the flag file exists; without it, exits at once (a dependency gone).
APP = """\
import os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

if not os.path.exists(sys.argv[1]):
    print("flag file gone", file=sys.stderr)
    sys.exit(1)


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


HTTPServer(("127.0.0.1", int(os.environ["PORT"])), Handler).serve_forever()
"""


def test_status_says_when_a_service_in_backoff_tries_again_and_why(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    app, flag = tmp_path / "flagged.py", tmp_path / "flag"
    app.write_text(APP)
    flag.write_text("up")
    spec = write_spec(
        tmp_path / "svc.yaml",
        f"run: exec {sys.executable} {app} {flag}\n"
        "service:\n  readiness_probe:\n    path: /\n    period_seconds: 0.2\n  replicas: 1\n",
    )
    corral_home.run("up", str(spec), "-n", "backs", cwd=tmp_path)
    first = corral_home.wait_replicas("backs", 1)["replicas"][0]
    flag.unlink()
    os.kill(int(first["pid"]), signal.SIGKILL)

    def waiting_long() -> dict[str, Any] | None:
        service = corral_home.service("backs") or {}
        backoff = service.get("backoff")
        return service if backoff and backoff["next_attempt_in_seconds"] >= 2 else None

    service = wait_for(waiting_long, 60, "a backoff of 2 s or more in the service view")
    backoff = service["backoff"]
    assert backoff["next_attempt_at"] > time.time() - 1, backoff
    assert "failures in a row; last: replica" in backoff["reason"], backoff
    assert "FAILED" in backoff["reason"], backoff

    for args in (("status", "backs"), ("status", "-v", "backs")):
        shown = corral_home.run(*args).stdout
        assert "next replica launch in " in shown and "backing off after " in shown, shown
    listed = json.loads(corral_home.run("status", "--json", "backs").stdout)["services"][0]
    assert listed["backoff"]["reason"].startswith(backoff["reason"].split(";")[0]), listed

    flag.write_text("up")  # the dependency is back: once READY, nothing waits any more
    corral_home.wait_replicas("backs", 1, timeout=60)
    wait_for(
        lambda: (corral_home.service("backs") or {"backoff": 1})["backoff"] is None,
        10,
        "no backoff once READY",
    )


def test_the_backoff_line_counts_down_and_says_due_when_the_time_is_past() -> None:
    at = time.mktime((2026, 12, 7, 23, 41, 5, 0, 0, -1))
    line = cliview.backoff_text(
        {"next_attempt_at": at, "next_attempt_in_seconds": 12.2, "reason": "3 failures in a row"}
    )
    assert line == "next replica launch in 12s (at 23:41:05), backing off after 3 failures in a row"
    due = cliview.backoff_text(
        {"next_attempt_at": at, "next_attempt_in_seconds": 0.0, "reason": "1 failure in a row"}
    )
    assert due.startswith("next replica launch due now (at 23:41:05)"), due
