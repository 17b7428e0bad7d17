"""A blue-green update holds its version's READY replicas out of the balancer until enough
of them are READY, then switches in one step. That hold lived only in the controller's
memory: a daemon restarted (a crash) in the middle of the update re-adopted the new
version's READY replicas into the ready set and pushed it to the balancer workers, and
traffic reached the held version before the first reconcile step held it again."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from conftest import CorralHome, finished, write_spec
from test_updates import Load, endpoint, spec

POLICY = "  replica_policy: {min_replicas: 2, max_replicas: 2}\n"


def test_a_restart_mid_blue_green_update_keeps_the_new_version_held(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    home = corral_home
    home.env["CORRAL_DAEMON_RESPAWN"] = "0"  # this test restarts it, at a known moment
    v1 = write_spec(tmp_path / "v1.yaml", spec("bgr", version="1", service=POLICY))
    # Version 2: the first replica serves; the second never listens (the lock is taken), so
    # the version stays held with one READY replica of the two it needs.
    lock = tmp_path / "first"
    half = f"if mkdir {lock} 2>/dev/null; then exec python3 app.py; else exec sleep 600; fi"
    v2_text = spec("bgr", version="2", service=POLICY).replace("exec python3 app.py", half)
    v2 = write_spec(tmp_path / "v2.yaml", v2_text)
    home.run("up", str(v1))
    home.wait_replicas("bgr", 2)
    home.run("update", "bgr", str(v2), "--mode", "blue_green", "-d")

    def held() -> bool:
        svc = home.service("bgr") or {}
        ready = [r for r in svc.get("replicas") or () if r["status"] == "READY"]
        return svc.get("traffic_held_for_version") == 2 and {r["version"] for r in ready} == {
            1,
            2,
        }

    home.wait_for(held, 60, "version 2 held with one READY replica")
    load = Load(endpoint(home, "bgr"), rate=100, seconds=30).start()
    try:
        time.sleep(1.0)
        old = home.daemon_pid()
        os.kill(old, signal.SIGKILL)
        home.wait_for(lambda: finished(old), 10, "the daemon to die")
        home.start_daemon()
        time.sleep(4.0)  # past the restarted daemon's first reconcile steps
    finally:
        load.stop()
    assert not load.errors, load.errors[:3]
    assert load.answers, "no answer at all"
    versions = sorted({a[2] for a in load.answers})
    assert versions == ["1"], f"the held version 2 got traffic: {versions}"
    svc = home.service("bgr")
    assert svc is not None and svc["traffic_held_for_version"] == 2, svc
