"""One id per replica wherever a user looks (issue 25): its number within its service names its
log files, the lines of ``controller.log``, its events, the API's and the CLI's logs, and its
launch log's own lines. Two services (alpha with 2 replicas, beta with 3) make the internal ids
differ from the per-service ones (beta's replica 1 is row 3), and a replacement adds one more.

Each replica prints who it is when it starts (its $CORRAL_SERVICE, $CORRAL_REPLICA_ID and pid),
so a log that shows another replica's output is caught by its first line.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import CorralHome, http, spec_text, wait_for, write_spec

from corral import logfiles
from corral.state import Store

# `exec`: the pid the shell prints is the app's, the one the API shows.
RUN = 'echo "I am $CORRAL_SERVICE replica $CORRAL_REPLICA_ID pid $$"; exec {python} app.py'


def whoami(service: str, replica: dict[str, Any]) -> str:
    return f"I am {service} replica {replica['id']} pid {replica['pid']}"


def up(home: CorralHome, tmp_path: Path, name: str, replicas: int) -> dict[str, Any]:
    text = spec_text(name, replicas, run=RUN.format(python=sys.executable))
    home.run("up", str(write_spec(tmp_path / f"{name}.yaml", text)))
    return home.wait_replicas(name, replicas, timeout=60)


def replica_files(home: CorralHome, name: str) -> set[str]:
    logs = home.path / "services" / name / "logs"
    return {p.name for p in logs.iterdir() if p.name.startswith("replica_")}


def api_log(home: CorralHome, name: str, replica: int, kind: str = "replica") -> str:
    answer = home.api("GET", f"/v1/services/{name}/logs?replica={replica}&kind={kind}")
    assert answer.status == 200, (answer.status, answer.body)
    return answer.body.decode()


def events(home: CorralHome, name: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = home.api("GET", f"/v1/services/{name}/events").json()["events"]
    return found


def own_output_only(home: CorralHome, name: str, svc: dict[str, Any], everyone: list[str]) -> None:
    """Each replica's log, by file, API and CLI, starts with its own line and no other's."""
    logs = home.path / "services" / name / "logs"
    for r in svc["replicas"]:
        mine = whoami(name, r)
        others = [line for line in everyone if line != mine]
        for text in (
            (logs / f"replica_{r['id']}.log").read_text(),
            api_log(home, name, r["id"]),
            home.run("logs", name, str(r["id"]), "--no-follow").stdout,
        ):
            assert mine in text, (name, r["id"], text[:400])
            assert not [o for o in others if o in text], (name, r["id"], text[:400])
        launch = api_log(home, name, r["id"], "launch")
        assert f"[corral] launching replica {name}/{r['id']} " in launch, launch[:400]


@pytest.mark.timeout(240)
def test_two_services_and_a_replacement_use_one_id_everywhere(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    home = corral_home
    alpha = up(home, tmp_path, "alpha", 2)
    beta = up(home, tmp_path, "beta", 3)
    assert sorted(r["id"] for r in alpha["replicas"]) == [1, 2]
    assert sorted(r["id"] for r in beta["replicas"]) == [1, 2, 3]
    # The case the issue is about: beta's internal ids are not its per-service ones.
    assert sorted(r["uid"] for r in beta["replicas"]) == [3, 4, 5]
    everyone = [whoami("alpha", r) for r in alpha["replicas"]]
    everyone += [whoami("beta", r) for r in beta["replicas"]]

    for name, svc in (("alpha", alpha), ("beta", beta)):
        ids = sorted(r["id"] for r in svc["replicas"])
        assert replica_files(home, name) == {
            f"replica_{i}{kind}.log" for i in ids for kind in ("", "_launch")
        }
        own_output_only(home, name, svc, everyone)
        controller = (home.path / "services" / name / "logs" / "controller.log").read_text()
        for i in ids:
            assert f"service {name}: replica {i} launching (version 1) on local" in controller
            assert re.search(rf"service {name}: replica {i} READY at http://", controller)
        ready = [e for e in events(home, name) if e["action"] == "replica.ready"]
        assert sorted(e["replica_id"] for e in ready) == ids, ready
        assert all(e["replica"] == e["replica_id"] for e in ready), ready

    # Replace beta's replica 2: it fails, replica 4 takes its place.
    victim = next(r for r in beta["replicas"] if r["id"] == 2)
    os.kill(int(victim["pid"]), signal.SIGKILL)

    def replaced() -> dict[str, Any] | None:
        svc = home.service("beta")
        assert svc is not None
        by_id = {r["id"]: r for r in svc["replicas"]}
        if by_id.get(4, {}).get("status") == "READY" and by_id[2]["status"] == "FAILED":
            return svc
        return None

    beta = wait_for(replaced, 60, "beta's replica 2 FAILED and replica 4 READY")
    new = next(r for r in beta["replicas"] if r["id"] == 4)
    everyone.append(whoami("beta", new))
    assert "replica_4.log" in replica_files(home, "beta")
    own_output_only(home, "beta", beta, everyone)
    controller = (home.path / "services" / "beta" / "logs" / "controller.log").read_text()
    assert re.search(r"service beta: replica 2 failed: .*see `corral logs beta 2`", controller)
    assert "service beta: replica 4 launching (version 1)" in controller
    assert re.search(r"service beta: replica 4 READY at http://", controller)
    assert not re.search(r"replica [5-9]\b", controller), controller
    shown = {(e["action"], e["replica_id"]) for e in events(home, "beta")}
    assert {("replica.failed", 2), ("replica.launch", 4), ("replica.ready", 4)} <= shown
    assert {e["replica_id"] for e in events(home, "beta")} <= {None, 1, 2, 3, 4}
    failed = next(r for r in beta["replicas"] if r["id"] == 2)
    assert "see `corral logs beta 2`" in failed["failure"], failed

    # A `down` then `up` of a name is a new service: its logs and events start empty, the
    # earlier service's logs are kept aside in logs.previous.
    home.run("down", "alpha", timeout=90)
    again = up(home, tmp_path, "alpha", 1)
    logs = home.path / "services" / "alpha" / "logs"
    controller = (logs / "controller.log").read_text()
    assert "replica 2" not in controller, controller
    assert controller.count("service alpha: controller started") == 1, controller
    assert replica_files(home, "alpha") == {"replica_1.log", "replica_1_launch.log"}
    first = whoami("alpha", again["replicas"][0])
    assert (logs / "replica_1.log").read_text().startswith(first)
    previous = home.path / "services" / "alpha" / "logs.previous"
    assert "service alpha: replica 2 launching" in (previous / "controller.log").read_text()
    assert whoami("alpha", alpha["replicas"][0]) in (previous / "replica_1.log").read_text()
    assert [e["action"] for e in events(home, "alpha")].count("service.create") == 1
    assert [e["replica_id"] for e in events(home, "alpha") if e["action"] == "replica.ready"] == [1]


# Answers its probe, and drops every other request unanswered: the balancer's 502 names it.
MUTE_APP = """
import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path != "/health":
            self.close_connection = True
            return
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


ThreadingHTTPServer(("127.0.0.1", int(os.environ["PORT"])), Handler).serve_forever()
"""


@pytest.mark.timeout(180)
def test_the_balancer_names_a_failing_replica_by_the_id_status_shows(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """A replica's failure, in the 502 a client gets and in the balancer's log, names it as
    `corral status` and `corral logs` do: its internal key is another replica's id there
    (beta's replica 1 below is row 2, and beta's replica 2 a healthy one next to it)."""
    home = corral_home
    (tmp_path / "mute.py").write_text(MUTE_APP)
    run = f"exec {sys.executable} mute.py"
    for name in ("alpha", "beta"):
        text = spec_text(name, 1, run=run, workdir=tmp_path)
        home.run("up", str(write_spec(tmp_path / f"{name}.yaml", text)))
        svc = home.wait_replicas(name, 1, timeout=60)
    (replica,) = svc["replicas"]
    assert (replica["id"], replica["uid"]) == (1, 2), replica
    answer = http(svc["endpoint"] + "/question")
    assert answer.status == 502, (answer.status, answer.body)
    error = answer.json()["error"]
    assert "replica 1: " in error and "replica 2" not in error, error

    def logged() -> str | None:
        text = home.run("logs", "beta", "--load-balancer", "--tail", "50").stdout
        return text if "GET /question failed" in text else None

    text = home.wait_for(logged, 30, "the balancer's line about the failure")
    assert "balancer beta: replica 1: GET /question failed" in text, text
    assert "replica 2:" not in text, text


def test_log_files_of_a_home_from_before_are_renamed_once(tmp_path: Path) -> None:
    """A home whose files are named by internal ids: those of known replicas take their
    per-service ids (row 37 is replica 1, row 38 replica 2), others go to old-ids/ as they
    were, controller.log stays; a second start changes nothing, and one that crashed
    midway (the directory set aside) resumes."""
    logs = tmp_path / "logs"
    logs.mkdir()
    for name in ("replica_37.log", "replica_37_launch.log", "replica_37.log.1", "replica_1.log"):
        (logs / name).write_text(name)
    (logs / "controller.log").write_text("controller")
    assert logfiles.by_seq(logs, {37: 1, 1: 2})
    assert sorted(p.name for p in logs.iterdir()) == [
        ".replica-ids",
        "controller.log",
        "replica_1.log",
        "replica_1.log.1",
        "replica_1_launch.log",
        "replica_2.log",
    ]
    assert (logs / "replica_1.log").read_text() == "replica_37.log"
    assert (logs / "replica_2.log").read_text() == "replica_1.log"
    assert not logfiles.by_seq(logs, {1: 5})  # once only
    assert (logs / "replica_1.log").read_text() == "replica_37.log"

    crashed = tmp_path / "crashed" / "logs"
    aside = crashed.with_name("logs.old-ids")
    aside.mkdir(parents=True)
    (aside / "replica_9.log").write_text("nine")
    (aside / "replica_8.log").write_text("gone")
    assert logfiles.by_seq(crashed, {9: 3})
    assert (crashed / "replica_3.log").read_text() == "nine"
    assert (crashed / "old-ids" / "replica_8.log").read_text() == "gone"
    assert not aside.exists()


def test_a_new_service_of_a_name_gets_fresh_logs(tmp_path: Path) -> None:
    logs = tmp_path / "svc" / "logs"
    logfiles.fresh(logs)  # the first service of the name
    (logs / "controller.log").write_text("first")
    logfiles.fresh(logs)
    (logs / "controller.log").write_text("second")
    logfiles.fresh(logs)
    assert sorted(p.name for p in logs.iterdir()) == [logfiles.MARKER]
    assert (logs.with_name("logs.previous") / "controller.log").read_text() == "second"
    assert not logfiles.by_seq(logs, {})  # marked: nothing to rename


def test_events_carry_the_id_users_see_and_a_new_service_starts_without_old_ones(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "state.db")
    try:
        store.create_service("a", "name: a\n", source=None, base_dir=None, lb_port=None)
        store.create_service("b", "name: b\n", source=None, base_dir=None, lb_port=None)
        store.add_replica("a", 1, "local", "target 1")
        b1 = store.add_replica("b", 1, "local", "target 1")
        store.event("b", "replica.ready", replica_id=b1.id)
        assert (b1.id, b1.seq) == (2, 1)
        shown = [(e.action, e.replica_id, e.replica) for e in store.events("b")]
        assert shown == [
            ("service.create", None, None),
            ("replica.create", 2, 1),
            ("replica.ready", 2, 1),
        ]
        store.delete_service("b")
        store.create_service("b", "name: b\n", source=None, base_dir=None, lb_port=None)
        assert [e.action for e in store.events("b")] == ["service.create"]
    finally:
        store.close()
