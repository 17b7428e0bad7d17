"""Autoscaling on real load and updates with zero dropped requests, end to end.

Each test runs its own daemon (fast autoscaler decisions through CORRAL_DECISION_INTERVAL and a
short CORRAL_QPS_WINDOW), real replicas of examples/app.py, and a bounded load generator
against the service's endpoint on 127.0.0.1. The load generator records, for every answer, the
replica and version that served it and when, so the tests can check that no request failed
and no request was served by a replica after its teardown finished.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conftest import EXAMPLES, CorralHome, spec_text, write_spec


def spec(name: str, *, version: str, service: str) -> str:
    return (
        f"name: {name}\n"
        f"workdir: {EXAMPLES}\n"
        "run: exec python3 app.py\n"
        f'envs: {{APP_VERSION: "{version}"}}\n'
        "service:\n"
        "  readiness_probe: {path: /health, period_seconds: 0.2, initial_delay_seconds: 30}\n"
        f"{service}"
    )


@dataclass
class Load:
    """A bounded fixed-rate load: ``rate`` requests/s on ``threads`` threads for at most
    ``seconds``, or until :meth:`stop`."""

    url: str
    rate: float
    seconds: float
    threads: int = 4
    # (when the replica answered, by its clock; replica id; version)
    answers: list[tuple[float, str, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _workers: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Load:
        interval = self.threads / self.rate
        deadline = time.monotonic() + self.seconds

        def work() -> None:
            while not self._stop.is_set() and time.monotonic() < deadline:
                started = time.monotonic()
                try:
                    with urllib.request.urlopen(self.url + "/", timeout=10) as response:
                        body = json.load(response)
                    # The replica's own clock: when it answered, not when this thread got
                    # around to reading the answer.
                    with self._lock:
                        self.answers.append((body["time"], body["replica"], body["version"]))
                except (urllib.error.URLError, OSError, ValueError) as exc:
                    with self._lock:
                        self.errors.append(repr(exc))
                self._stop.wait(max(0.0, interval - (time.monotonic() - started)))

        self._workers = [threading.Thread(target=work, daemon=True) for _ in range(self.threads)]
        for worker in self._workers:
            worker.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for worker in self._workers:
            worker.join(timeout=15)
        assert not any(w.is_alive() for w in self._workers), "load threads did not stop"


def endpoint(home: CorralHome, name: str) -> str:
    svc = home.service(name)
    assert svc is not None and svc["endpoint"]
    return str(svc["endpoint"])


def terminated_at(home: CorralHome, name: str) -> dict[str, float]:
    """Replica id -> when its teardown finished, from the event log."""
    answer = home.api("GET", f"/v1/services/{name}/events")
    assert answer.status == 200
    return {
        str(e["replica_id"]): e["ts"]
        for e in answer.json()["events"]
        if e["action"] == "replica.terminated"
    }


def assert_no_late_answers(home: CorralHome, name: str, load: Load) -> None:
    ended = terminated_at(home, name)
    late = [a for a in load.answers if a[1] in ended and a[0] > ended[a[1]]]
    assert not late, f"answered by replicas after their teardown: {late[:5]}"


def fast_home(home: CorralHome) -> CorralHome:
    home.env["CORRAL_DECISION_INTERVAL"] = "0.3"
    home.env["CORRAL_QPS_WINDOW"] = "4"
    return home


def test_rolling_update_under_load_drops_nothing(corral_home: CorralHome, tmp_path: Path) -> None:
    home = corral_home
    v1 = write_spec(tmp_path / "v1.yaml", spec("roll", version="1", service="  replicas: 3\n"))
    v2 = write_spec(tmp_path / "v2.yaml", spec("roll", version="2", service="  replicas: 3\n"))
    home.run("up", str(v1))
    home.wait_replicas("roll", 3)
    load = Load(endpoint(home, "roll"), rate=100, seconds=40).start()
    try:
        time.sleep(1.0)  # some v1 traffic first (the load is what is measured, not this)
        result = home.run("update", "roll", str(v2), timeout=60)
        assert "version 2 serves all traffic" in result.stdout
        svc = home.wait_replicas("roll", 3)
        # Let traffic flow on the new version for a moment after the last old replica went.
        time.sleep(1.0)
    finally:
        load.stop()
    assert not load.errors, f"{len(load.errors)} failed requests: {load.errors[:3]}"
    versions = {a[2] for a in load.answers}
    assert versions == {"1", "2"}, versions
    live = [r for r in svc["replicas"] if r["status"] == "READY"]
    assert {r["version"] for r in live} == {2}
    # After the switch every answer comes from version 2.
    last_v1 = max(a[0] for a in load.answers if a[2] == "1")
    assert all(a[2] == "2" for a in load.answers if a[0] > last_v1)
    assert_no_late_answers(home, "roll", load)


def test_blue_green_switches_traffic_once(corral_home: CorralHome, tmp_path: Path) -> None:
    home = corral_home
    service = "  replica_policy: {min_replicas: 2, max_replicas: 2}\n"
    v1 = write_spec(tmp_path / "v1.yaml", spec("bg", version="1", service=service))
    v2 = write_spec(tmp_path / "v2.yaml", spec("bg", version="2", service=service))
    home.run("up", str(v1))
    home.wait_replicas("bg", 2)
    load = Load(endpoint(home, "bg"), rate=100, seconds=40).start()
    try:
        time.sleep(1.0)
        home.run("update", "bg", str(v2), "--mode", "blue_green", timeout=60)
        home.wait_replicas("bg", 2)
        time.sleep(1.0)
    finally:
        load.stop()
    assert not load.errors, f"{len(load.errors)} failed requests: {load.errors[:3]}"
    # One switch: once version 2 answered, version 1 never answers again (no mixing).
    ordered = sorted(load.answers)
    first_v2 = next(i for i, a in enumerate(ordered) if a[2] == "2")
    # Requests in flight at the switch may finish on v1 a moment later; allow those only.
    switch_time = ordered[first_v2][0]
    stragglers = [a for a in ordered[first_v2:] if a[2] == "1" and a[0] > switch_time + 2.0]
    assert not stragglers, stragglers[:5]
    assert_no_late_answers(home, "bg", load)


def test_failing_version_is_not_promoted_and_rollback(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    home = corral_home
    v1 = write_spec(tmp_path / "v1.yaml", spec("keep", version="1", service="  replicas: 2\n"))
    bad = write_spec(
        tmp_path / "bad.yaml",
        spec("keep", version="2", service="  replicas: 2\n").replace(
            "exec python3 app.py", "exit 3"
        ),
    )
    home.run("up", str(v1))
    home.wait_replicas("keep", 2)
    load = Load(endpoint(home, "keep"), rate=40, seconds=60).start()
    try:
        result = home.run("update", "keep", str(bad), check=False, timeout=90)
        assert result.returncode != 0
        assert "version 2 not promoted" in result.stderr
        assert "traffic stays on version 1" in result.stderr
        svc = home.service("keep")
        assert svc is not None and svc["status"] == "READY"
        # The service is not FAILED: why the update failed has a field of its own.
        assert svc["failure"] is None
        assert "never became ready" in (svc["last_update_failure"] or "")
        assert svc["traffic_versions"] == [1]
        ready = [r for r in svc["replicas"] if r["status"] == "READY"]
        assert len(ready) == 2 and {r["version"] for r in ready} == {1}
        # Roll back: version 3 is version 1's spec again, and the failure is cleared. Version
        # 1's replicas still serve: they are kept, relabelled (they were all relaunched).
        home.run("update", "keep", "--to-version", "1", timeout=60)
        svc = home.wait_replicas("keep", 2)
        kept = [r for r in svc["replicas"] if r["status"] == "READY" and r["version"] == 3]
        assert {r["pid"] for r in kept} == {r["pid"] for r in ready}, svc["replicas"]
    finally:
        load.stop()
    assert not load.errors, f"{len(load.errors)} failed requests: {load.errors[:3]}"
    assert svc["version"] == 3 and svc["failure"] is None and svc["last_update_failure"] is None
    assert [v["version"] for v in svc["versions"]] == [1, 2, 3]
    assert {a[2] for a in load.answers} == {"1"}


def test_service_section_change_keeps_replicas(corral_home: CorralHome, tmp_path: Path) -> None:
    home = corral_home
    v1 = write_spec(tmp_path / "v1.yaml", spec("inplace", version="1", service="  replicas: 2\n"))
    v2 = write_spec(tmp_path / "v2.yaml", spec("inplace", version="1", service="  replicas: 3\n"))
    home.run("up", str(v1))
    before = home.wait_replicas("inplace", 2)
    pids = {r["pid"] for r in before["replicas"]}
    home.run("update", "inplace", str(v2), timeout=60)
    after = home.wait_replicas("inplace", 3)
    assert after["version"] == 2
    assert pids <= {r["pid"] for r in after["replicas"]}, "a service-only change relaunched"
    assert all(r["version"] == 2 for r in after["replicas"])


def _target_history(home: CorralHome, name: str) -> list[int]:
    answer = home.api("GET", f"/v1/services/{name}/events")
    reasons = [e["reason"] for e in answer.json()["events"] if e["action"] == "autoscale"]
    return [int(r.split("wants ")[1].split()[0]) for r in reasons if "wants " in r]


def test_autoscaling_follows_load_up_and_back(corral_home: CorralHome, tmp_path: Path) -> None:
    home = fast_home(corral_home)
    policy = (
        "  replica_policy: {min_replicas: 1, max_replicas: 3, target_qps_per_replica: 5,"
        " upscale_delay_seconds: 1, downscale_delay_seconds: 3}\n"
    )
    path = write_spec(tmp_path / "auto.yaml", spec("auto", version="1", service=policy))
    home.run("up", str(path))
    home.wait_replicas("auto", 1)
    load = Load(endpoint(home, "auto"), rate=30, seconds=60).start()
    try:
        svc = home.wait_replicas("auto", 3, timeout=45)
        assert svc["target"] == 3
        assert svc["autoscaler"]["qps"] > 10
    finally:
        load.stop()
    assert not load.errors, load.errors[:3]
    svc = home.wait_replicas("auto", 1, timeout=45)
    assert svc["target"] == 1
    assert "downscale" in svc["autoscaler"]["reason"] or "holding 1" in svc["autoscaler"]["reason"]
    assert_no_late_answers(home, "auto", load)


def test_scale_to_zero_holds_the_first_request(corral_home: CorralHome, tmp_path: Path) -> None:
    home = fast_home(corral_home)
    policy = (
        "  replica_policy: {min_replicas: 0, max_replicas: 2, target_qps_per_replica: 5,"
        " upscale_delay_seconds: 1, downscale_delay_seconds: 2}\n"
    )
    path = write_spec(tmp_path / "zero.yaml", spec("zero", version="1", service=policy))
    # `up` returns: no replica is the steady state of a scale-to-zero service with no traffic.
    said = home.run("up", str(path), timeout=60).stdout
    assert "up with no replica" in said and "the first request to http://127.0.0.1:" in said
    svc: Any = home.wait_for(
        lambda: (s := home.service("zero")) and s["target"] == 0 and s, 20, "target 0"
    )
    assert not [r for r in svc["replicas"] if r["status"] == "READY"]
    # The first request waits for a replica to start instead of failing.
    with urllib.request.urlopen(svc["endpoint"] + "/", timeout=60) as response:
        assert response.status == 200
        assert json.load(response)["version"] == "1"
    # With no more load it goes back to zero replicas.
    home.wait_for(
        lambda: (
            (s := home.service("zero"))
            and s["target"] == 0
            and not [r for r in s["replicas"] if r["status"] in ("READY", "STARTING", "PENDING")]
        ),
        45,
        "back to zero replicas",
    )


def test_an_update_superseded_by_a_later_one_stops_waiting(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """`corral update` (no --timeout) waits until its version serves alone; a later update
    retires that version, so the first command must say so and exit, not wait for good."""
    home = corral_home
    home.run("up", str(write_spec(tmp_path / "v1.yaml", spec_text("sup", 1))))
    never = spec_text("sup", 1, setup="sleep 600")  # version 2 never gets READY
    waiting = home.popen("update", "sup", str(write_spec(tmp_path / "v2.yaml", never)))
    home.wait_for(
        lambda: any(
            r["version"] == 2 for r in (home.service("sup") or {"replicas": []})["replicas"]
        ),
        30,
        "version 2's replica to start launching",
    )
    home.run("update", "sup", str(write_spec(tmp_path / "v3.yaml", spec_text("sup", 2))), "-d")
    try:
        output, _ = waiting.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        waiting.kill()
        output, _ = waiting.communicate()
        raise AssertionError(f"`corral update` still waits:\n{output.decode()}") from None
    assert waiting.returncode == 1, output
    assert b"version 2 was superseded by version 3 (a later update)" in output, output
