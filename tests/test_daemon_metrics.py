"""The daemon's /metrics: every service's balancer in one Prometheus exposition."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import EXAMPLES, CorralHome, http, wait_for, write_spec


def test_metrics_count_requests_per_service(corral_home: CorralHome, tmp_path: Path) -> None:
    home = corral_home
    path = write_spec(
        tmp_path / "m.yaml",
        f"name: m\nworkdir: {EXAMPLES}\nrun: exec python3 app.py\n"
        "service:\n  readiness_probe: {path: /health, period_seconds: 0.2}\n  replicas: 1\n",
    )
    home.run("up", str(path))
    svc = home.wait_replicas("m", 1)
    for _ in range(7):
        assert http(svc["endpoint"] + "/x").status == 200
    assert home.api("GET", "/metrics", token=None).status == 401

    def scraped() -> str | None:
        # The balancer workers report every 0.25 s: the counts are that much behind at most.
        answer = home.api("GET", "/metrics")
        assert answer.status == 200
        assert answer.headers["Content-Type"].startswith("text/plain")
        text = answer.body.decode()
        return text if 'corral_lb_requests_total{code="200",service="m"} 7.0' in text else None

    text = wait_for(scraped, 10, "7 requests in /metrics")
    assert 'corral_lb_request_seconds_count{service="m"} 7.0' in text
    replica = svc["replicas"][0]["id"]
    assert f'corral_lb_in_flight{{replica="{replica}",service="m"}} 0.0' in text


def test_replica_label_is_the_id_status_shows(corral_home: CorralHome, tmp_path: Path) -> None:
    """With two services the internal keys and the ids within each service differ: the
    ``replica`` label must be the id `corral status` shows (and `down --replica-id` takes)."""
    home = corral_home
    for name, count in (("a", 2), ("b", 1)):
        path = write_spec(
            tmp_path / f"{name}.yaml",
            f"name: {name}\nworkdir: {EXAMPLES}\nrun: exec python3 app.py\n"
            "service:\n  readiness_probe: {path: /health, period_seconds: 0.2}\n"
            f"  replicas: {count}\n",
        )
        home.run("up", str(path))
        home.wait_replicas(name, count)
    shown = home.wait_replicas("b", 1)["replicas"][0]
    assert shown["id"] == 1 and shown["uid"] != 1  # what makes the two differ

    def scraped() -> str | None:
        text = home.api("GET", "/metrics").body.decode()
        return text if 'service="b"' in text else None

    text = wait_for(scraped, 10, "service b in /metrics")
    labels = re.findall(r'corral_lb_in_flight\{replica="(\d+)",service="b"\}', text)
    assert labels == ["1"], labels
