"""A restarted daemon's autoscaler goes on from the fleet that runs and the load the workers kept.

Its own daemon, real replicas of examples/app.py and a bounded load on 127.0.0.1: the daemon is
stopped and started while the load runs. Its first decision must read the requests the balancer
workers kept (their history, sent with their first report) and start from the replicas that
run, not from min_replicas: a first decision at QPS 0 and min_replicas tore down a loaded
fleet at once, and the upscale delay held it down.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import EXAMPLES, CorralHome, wait_for, write_spec
from load import PacedLoad

POLICY = (
    "  replica_policy: {min_replicas: 1, max_replicas: 3, target_qps_per_replica: 5,"
    " upscale_delay_seconds: 1, downscale_delay_seconds: 60}\n"
)


def autoscale_reasons(home: CorralHome, name: str) -> list[str]:
    answer = home.api("GET", f"/v1/services/{name}/events")
    assert answer.status == 200
    return [e["reason"] for e in answer.json()["events"] if e["action"] == "autoscale"]


def test_a_restarted_daemon_keeps_the_loaded_fleet(corral_home: CorralHome, tmp_path: Path) -> None:
    home = corral_home
    home.env["CORRAL_DECISION_INTERVAL"] = "0.3"
    home.env["CORRAL_QPS_WINDOW"] = "20"
    text = (
        f"name: kept\nworkdir: {EXAMPLES}\nrun: exec python3 app.py\nservice:\n"
        "  readiness_probe: {path: /health, period_seconds: 0.2, initial_delay_seconds: 30}\n"
        + POLICY
    )
    home.run("up", str(write_spec(tmp_path / "kept.yaml", text)))
    svc: Any = home.wait_replicas("kept", 1)
    load = PacedLoad(svc["endpoint"], rate=30.0, duration=50.0)
    load.start()
    try:
        home.wait_replicas("kept", 3, timeout=30)
        before = len(autoscale_reasons(home, "kept"))
        home.run("daemon", "stop")
        home.run("daemon", "start")
        home.note_daemon()
        # The new daemon's first decision (the first always makes an event).
        first = wait_for(
            lambda: (r := autoscale_reasons(home, "kept")[before:]) and r[0],
            20,
            "the restarted daemon's first decision",
        )
        assert "(= current 3): holding 3" in first, first
        qps = float(first.split("QPS ")[1].split()[0])
        assert qps > 20, first  # 30 req/s, read back from the workers' history
        svc = home.status("kept")
        assert svc["target"] == 3, svc["autoscaler"]
        assert len([r for r in svc["replicas"] if r["status"] == "READY"]) == 3
    finally:
        load.stop()  # the rest of its 50 s is a margin for a slow machine, not needed now
        result = load.join()
    assert result.failed == 0, (result.summary(), result.errors, result.examples)
