"""Updates on a machine with no spare room, end to end: a real daemon on a declared inventory
of 2 CPUs, replicas that each reserve one (``cpu_pinning: exclusive``, so two fill the machine),
real processes of examples/app.py, real traffic on 127.0.0.1.

What is shown: a rolling update cannot surge there, so it retires one old replica before each
successor starts (Kubernetes' maxSurge 0, maxUnavailable 1), says so in the CLI's output and the
event log, completes and returns, with 1 of 2 replicas READY at every poll and no request
failed; an update that could never be placed (each new replica needs both CPUs, or blue-green
beside the old replicas) is refused at once with the reason, and nothing changes.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES, CorralHome, spec_text, wait_for, write_spec
from test_updates import Load, assert_no_late_answers, endpoint

pytestmark = pytest.mark.timeout(170)


@pytest.fixture
def cpu_home(corral_home: CorralHome, tmp_path: Path) -> CorralHome:
    """A home whose daemon sees 2 CPUs to reserve (a declared count: accounted, not pinned)."""
    path = tmp_path / "inventory.yaml"
    path.write_text("cpus: 2\n")
    corral_home.env["CORRAL_INVENTORY"] = str(path)
    return corral_home


def pinned_spec(directory: Path, replicas: int, cpus: int, version: str) -> Path:
    text = spec_text(
        "full",
        replicas,
        run=f"exec {sys.executable} app.py",
        workdir=EXAMPLES,
        envs={"APP_VERSION": version},
        extra=f"resources:\n  cpus: {cpus}\n  cpu_pinning: exclusive\n",
    )
    return write_spec(directory / f"full-v{version}-{replicas}x{cpus}.yaml", text)


def ready(home: CorralHome) -> list[dict[str, Any]]:
    svc = home.service("full")
    assert svc is not None
    return [r for r in svc["replicas"] if r["status"] == "READY"]


def test_a_rolling_update_on_a_full_machine_swaps_one_at_a_time_under_load(
    cpu_home: CorralHome, tmp_path: Path
) -> None:
    home = cpu_home
    home.run("up", str(pinned_spec(tmp_path, 2, 1, "1")))
    old = {r["pid"] for r in home.wait_replicas("full", 2, timeout=60)["replicas"]}
    load = Load(endpoint(home, "full"), rate=40, seconds=90).start()
    floor: list[int] = []
    polling = threading.Event()

    def poll() -> None:
        while not polling.is_set():
            floor.append(len(ready(home)))
            polling.wait(0.05)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        wait_for(lambda: any(a[2] == "1" for a in list(load.answers)), 30, "version 1 answering")
        # No --timeout: the command must return by itself.
        result = home.run("update", "full", str(pinned_spec(tmp_path, 2, 1, "2")), timeout=120)
        wait_for(lambda: len(ready(home)) == 2, 30, "2 READY replicas after the update")
        # Version 2 serves alone for a while: answers of it come after the update returned.
        answered = len(load.answers)
        wait_for(
            lambda: sum(a[2] == "2" for a in list(load.answers)[answered:]) >= 10,
            30,
            "version 2 answering alone",
        )
    finally:
        polling.set()
        poller.join(10)
        load.stop()
    said = " ".join(result.stdout.split())
    assert "version 2 serves all traffic" in said, said
    # With why (the devices the old replicas hold), not "no spare capacity" alone: a fixed
    # port read as a full machine.
    assert said.count("no room for version 2 beside the old replicas (needs ") == 2, said
    assert said.count("): replica") == 2, said
    assert said.count("starts in its place; 1 of 2 serve meanwhile") == 2, said
    # READY never below target - 1, and the requests of those moments went to the other one.
    assert floor and min(floor) == 1, floor
    assert not load.errors, f"{len(load.errors)} failed requests: {load.errors[:3]}"
    assert {a[2] for a in load.answers} == {"1", "2"}
    assert_no_late_answers(home, "full", load)
    now = home.service("full")
    assert now is not None and {r["version"] for r in ready(home)} == {2}
    assert not {r["pid"] for r in now["replicas"]} & old
    events = home.api("GET", "/v1/services/full/events").json()["events"]
    swaps = [e["reason"] for e in events if e["action"] == "update.no_room"]
    assert len(swaps) == 2 and all("1 of 2 serve meanwhile" in r for r in swaps), swaps
    retired = [e for e in events if "replacing one at a time" in (e["reason"] or "")]
    assert len(retired) == 2, retired


def test_an_update_that_could_never_be_placed_is_refused_at_once(
    cpu_home: CorralHome, tmp_path: Path
) -> None:
    home = cpu_home
    home.run("up", str(pinned_spec(tmp_path, 2, 1, "1")))
    before = {r["pid"] for r in home.wait_replicas("full", 2, timeout=60)["replicas"]}

    # Each new replica wants both CPUs: retiring one old replica frees one. It would wait for
    # ever while the old ones serve: refused before anything changes, and the command returns.
    started = time.monotonic()
    bigger = home.run("update", "full", str(pinned_spec(tmp_path, 2, 2, "2")), check=False)
    assert bigger.returncode != 0 and time.monotonic() - started < 20
    said = " ".join(bigger.stderr.split())
    assert "a rolling update of 'full' could never place its new version" in said, said
    assert "even retiring one old replica before each new one starts" in said, said
    assert "new replica 1 of 2 needs 2 CPUs of its own" in said, said

    # Blue-green keeps both old replicas until a new one is READY: no room beside them.
    blue = home.run(
        "update",
        "full",
        str(pinned_spec(tmp_path, 2, 1, "2")),
        "--mode",
        "blue_green",
        check=False,
    )
    assert blue.returncode != 0
    said = " ".join(blue.stderr.split())
    assert "blue-green update" in said and "--mode rolling" in said, said

    svc = home.service("full")
    assert svc is not None and svc["version"] == 1 and svc["status"] == "READY", svc
    assert [v["version"] for v in svc["versions"]] == [1]
    assert {r["pid"] for r in svc["replicas"]} == before

    # One replica on both CPUs is placeable: the surplus old replica goes first, then the
    # other's CPU is handed over.
    home.run("update", "full", str(pinned_spec(tmp_path, 1, 2, "3")), timeout=120)
    home.wait_replicas("full", 1, timeout=60)
    (replica,) = ready(home)
    assert replica["version"] == 2 and replica["devices"]["cpus"] == 2
