"""End-to-end tests of ``infra: ray``: the real CLI and daemon, replicas on a real Ray cluster.

The cluster (head ``node-0`` + ``node-1`` + ``node-2``, each with a custom resource of its name,
the two workers also with ``pool``) runs on this machine for this file, owned by a helper
process the xdist workers share (``tests/ray_cluster.py``): private ``RAY_TMPDIR``,
127.0.0.1 only, shut down with ``Cluster.shutdown()`` and by pid, never ``ray stop``.

Each test has its own corral home (``corral_home`` in conftest.py) whose daemon gets
``RAY_ADDRESS``. Every test ends by taking its services down and checking that no actor of its
home is left on the cluster and that every replica process (found by pid, and by the
``CORRAL_RAY_HOME_MARKER`` in their environment: all nodes are this machine) is gone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # see test_infra_ray.py
pytest.importorskip("ray")

from conftest import (
    CorralHome,
    LineReader,
    endpoint_of,
    get_json,
    pid_alive,
    spec_text,
    wait_for,
    write_spec,
)
from ray_cluster import LocalRayCluster
from ray_support import cluster_dir, guard_topology, topology

pytestmark = pytest.mark.timeout(180)

NODES: list[dict[str, Any]] = [
    {"num_cpus": 2, "resources": {"node-0": 100}},
    {"num_cpus": 2, "resources": {"node-1": 100, "pool": 100}},
    {"num_cpus": 2, "resources": {"node-2": 100, "pool": 100}},
]
CHANGES_TOPOLOGY = {"test_removed_node_replicas_are_replaced_elsewhere"}
LIVE = {"PENDING", "PROVISIONING", "STARTING", "NOT_READY", "READY"}


# -- helpers --------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _topology_guard(request: pytest.FixtureRequest) -> Iterator[None]:
    yield from guard_topology(request, CHANGES_TOPOLOGY)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRayCluster]:
    """This file's cluster, shared by the xdist workers (see the module docstring). Session
    scope, though only this file sees it: xdist interleaves files on a worker, and a module
    scope would stop and restart the cluster at every switch."""
    local = LocalRayCluster(cluster_dir(tmp_path_factory, __name__), NODES)
    try:
        local.attach(timeout=150)
        yield local
    finally:
        survivors = local.detach()
        assert not survivors, f"cluster processes needed SIGKILL: {survivors}"


class RayHome:
    """A corral home whose daemon uses the cluster, and what its replicas were seen to be."""

    def __init__(self, home: CorralHome, cluster: LocalRayCluster) -> None:
        self.home = home
        self.cluster = cluster
        self.pids: set[int] = set()  # app and actor pids seen in recorded handles
        self.node_removed = False
        home.env.update(cluster.env)
        home.env["RAY_ADDRESS"] = cluster.address

    def handles(self, service: str | None = None) -> dict[int, dict[str, Any]]:
        """Recorded Ray handles by replica id (and remember their pids for the final check)."""
        sql = "SELECT id, handle_json FROM replicas WHERE handle_json IS NOT NULL"
        if service is not None:
            rows = self.home.db_rows(sql + " AND service = ?", (service,))
        else:
            rows = self.home.db_rows(sql)
        found = {}
        for rid, raw in rows:
            data = json.loads(raw)["data"]
            found[int(rid)] = data
            self.pids |= {int(data[k]) for k in ("pid", "actor_pid") if data.get(k)}
        return found

    def processes(self) -> list[int]:
        """Live processes (every node is this machine) started for this home's replicas."""
        marker = self.home.marker
        found = []
        for proc in psutil.process_iter():
            try:
                if (
                    proc.environ().get("CORRAL_RAY_HOME_MARKER") == marker
                    and proc.status() != psutil.STATUS_ZOMBIE
                ):
                    found.append(proc.pid)
            except (psutil.Error, OSError):
                continue
        return found

    def actors(self) -> list[str]:
        return self.cluster.named_actors(f"corral-{self.home.marker}-")

    def check_clean(self) -> None:
        """Everything down: no actor of this home, no replica process (by pid and marker)."""
        if self.home.healthy():
            self.home.run("down", "--all", "--purge", "--timeout", "60", timeout=90)
        if self.home.marker is None:
            return
        wait_for(lambda: not self.actors(), 20, "every actor of this home to be gone")
        wait_for(lambda: not self.processes(), 15, "every replica process to be gone")
        left = sorted(p for p in self.pids if pid_alive(p))
        assert not left, f"replica/actor pids still alive: {left}"
        local = Path(tempfile.gettempdir()) / f"corral-{self.home.marker}"
        if self.node_removed:  # its files died with the node (here: they stay in /tmp)
            shutil.rmtree(local, ignore_errors=True)
        assert not local.exists(), f"node-local files left: {list(local.iterdir())}"


@pytest.fixture
def ray_home(corral_home: CorralHome, cluster: LocalRayCluster) -> Iterator[RayHome]:
    home = RayHome(corral_home, cluster)
    yield home
    home.check_clean()


def ray_spec(
    directory: Path,
    name: str,
    replicas: int,
    *,
    setup: str | None = None,
    run: str | None = None,
    resources: str = "",
) -> Path:
    text = spec_text(name, replicas, run=run, setup=setup, extra="infra: ray\n" + resources)
    return write_spec(directory / f"{name}.yaml", text)


def replaced(home: CorralHome, name: str, victim: int, status: str, ready: int) -> Any:
    """Wait until replica ``victim`` shows ``status`` and ``ready`` others are READY."""

    def check() -> dict[str, Any] | None:
        svc = home.service(name)
        assert svc is not None
        states = {r["id"]: r["status"] for r in svc["replicas"]}
        live = [r for r in svc["replicas"] if r["status"] in LIVE]
        if states.get(victim) != status or len(live) != ready:
            return None
        return svc if all(r["status"] == "READY" for r in live) else None

    return wait_for(check, 60, f"replica {victim} {status} and {ready} READY again")


# -- serving, placement, logs ---------------------------------------------------------------------


def test_three_replicas_spread_serve_and_stream_logs(ray_home: RayHome, tmp_path: Path) -> None:
    home = ray_home.home
    result = home.run("up", str(ray_spec(tmp_path, "trio", 3)))
    endpoint = endpoint_of(result.stdout)
    service = home.wait_replicas("trio", 3, timeout=60)
    handles = ray_home.handles("trio")
    assert len({h["node_id"] for h in handles.values()}) == 3, "replicas share a node"
    for r in service["replicas"]:
        assert r["infra"] == "ray" and r["endpoint"].startswith("http://127.0.0.1:")
        assert r["pid"] == handles[r["id"]]["pid"]

    seen = Counter(get_json(f"{endpoint}/hello/{i}")["replica"] for i in range(30))
    assert set(seen) == {str(r["id"]) for r in service["replicas"]}, seen

    # The replica's own output, produced on its node, is readable on the daemon side...
    rid = service["replicas"][0]["id"]
    text = wait_for(
        lambda: (
            (t := home.run("logs", "trio", str(rid), "--no-follow").stdout)
            and "GET /hello/" in t
            and t
        ),
        15,
        "the remote replica's request lines in `corral logs`",
    )
    assert f"replica {rid} listening on 127.0.0.1:" in text, text
    launch = home.run("logs", "trio", str(rid), "--launch", "--no-follow").stdout
    assert "on Ray at" in launch and "placed on node" in launch and "started pid" in launch
    # ...and followed as it comes.
    reader = LineReader(home.popen("logs", "trio", str(rid)))
    reader.wait_line(rf"replica {rid} listening", timeout=20)
    marker = f"/follow-{uuid.uuid4().hex}"
    get_json(service["replicas"][0]["endpoint"] + marker)
    reader.wait_line(re.escape(marker), timeout=20)


def test_two_services_name_actors_and_logs_by_the_id_users_see(
    ray_home: RayHome, tmp_path: Path
) -> None:
    """alpha (1 replica) then beta (2): beta's rows are 2 and 3, its replicas 1 and 2. Each
    actor is named after the replica's id within its service, and each replica's log (pumped
    from its node) starts with its own line (issue 25)."""
    home = ray_home.home
    run = f'echo "I am $CORRAL_SERVICE replica $CORRAL_REPLICA_ID"; exec {sys.executable} app.py'
    for name, count in (("alpha", 1), ("beta", 2)):
        home.run("up", str(ray_spec(tmp_path, name, count, run=run)))
    services = {
        name: home.wait_replicas(name, n, timeout=60) for name, n in (("alpha", 1), ("beta", 2))
    }
    assert sorted(r["uid"] for r in services["beta"]["replicas"]) == [2, 3]
    marker = home.marker
    want = {f"corral-{marker}-alpha-1", f"corral-{marker}-beta-1", f"corral-{marker}-beta-2"}
    assert set(ray_home.actors()) == want
    for name, svc in services.items():
        handles = ray_home.handles(name)
        for r in svc["replicas"]:
            assert handles[r["uid"]]["actor_name"] == f"corral-{marker}-{name}-{r['id']}"
            mine = f"I am {name} replica {r['id']}"
            text = wait_for(
                lambda n=name, i=r["id"]: home.run("logs", n, str(i), "--no-follow").stdout,
                20,
                f"{name} replica {r['id']}'s log",
            )
            assert mine in text and text.count("I am ") == 1, text[:400]
            path = home.path / "services" / name / "logs" / f"replica_{r['id']}.log"
            assert mine in path.read_text(errors="replace")


def test_pinned_replica_lands_on_its_node(ray_home: RayHome, tmp_path: Path) -> None:
    spec = ray_spec(tmp_path, "pinned", 2, resources="resources:\n  accelerators: node-2:1\n")
    ray_home.home.run("up", str(spec))
    ray_home.home.wait_replicas("pinned", 2, timeout=60)
    node = ray_home.cluster.node_id("node-2")
    assert {h["node_id"] for h in ray_home.handles("pinned").values()} == {node}


# -- failures -------------------------------------------------------------------------------------


def test_killed_replica_process_is_failed_and_replaced(ray_home: RayHome, tmp_path: Path) -> None:
    home = ray_home.home
    endpoint = endpoint_of(home.run("up", str(ray_spec(tmp_path, "phoenix", 2))).stdout)
    before = home.wait_replicas("phoenix", 2, timeout=60)
    victim = before["replicas"][0]
    ray_home.handles("phoenix")
    os.kill(victim["pid"], signal.SIGKILL)  # the app, on its node (this machine)
    after = replaced(home, "phoenix", victim["id"], "FAILED", 2)
    dead = next(r for r in after["replicas"] if r["id"] == victim["id"])
    assert dead["exit_code"] == -signal.SIGKILL, dead
    served = {get_json(f"{endpoint}/after/{i}")["replica"] for i in range(10)}
    assert str(victim["id"]) not in served


def test_removed_node_replicas_are_replaced_elsewhere(ray_home: RayHome, tmp_path: Path) -> None:
    home, cluster = ray_home.home, ray_home.cluster
    with topology(cluster, exclusive=True):
        doomed = cluster.add_node(num_cpus=2, resources={"pool": 100})
        spec = ray_spec(tmp_path, "nomad", 3, resources="resources:\n  accelerators: pool:1\n")
        home.run("up", str(spec))
        home.wait_replicas("nomad", 3, timeout=60)
        handles = ray_home.handles("nomad")
        on_doomed = [rid for rid, h in handles.items() if h["node_id"] == doomed]
        assert len(on_doomed) == 1, f"3 replicas over 3 pool nodes: {handles}"
        victim = on_doomed[0]
        cluster.remove_node(doomed)
        ray_home.node_removed = True
    after = replaced(home, "nomad", victim, "PREEMPTED", 3)
    for pid in (handles[victim]["pid"], handles[victim]["actor_pid"]):
        assert not pid_alive(pid), f"pid {pid} outlived its node"
    now = ray_home.handles("nomad")
    live = [r["id"] for r in after["replicas"] if r["status"] == "READY"]
    assert all(now[rid]["node_id"] != doomed for rid in live)
    events = home.api("GET", "/v1/services/nomad/events").json()["events"]
    assert not any(e["action"] == "service.failed" for e in events)


def test_scale_down_mid_launch_leaves_no_actor_and_no_process(
    ray_home: RayHome, tmp_path: Path
) -> None:
    home = ray_home.home
    spec = ray_spec(tmp_path, "hasty", 3, setup="echo preparing; sleep 120")
    home.run("up", "--detach", str(spec))

    def in_setup() -> bool:
        svc = home.service("hasty")
        if svc is None or [r["status"] for r in svc["replicas"]] != ["PROVISIONING"] * 3:
            return False
        return len(ray_home.actors()) == 3 and len(ray_home.processes()) >= 3

    wait_for(in_setup, 60, "3 replicas in setup on the cluster", interval=0.3)
    handles = ray_home.handles("hasty")
    smaller = ray_spec(tmp_path, "hasty", 1, setup="echo preparing; sleep 120")
    home.run("update", "hasty", str(smaller), "--detach")

    def scaled() -> bool:
        svc = home.service("hasty")
        return svc is not None and len(svc["replicas"]) == 1 and len(ray_home.actors()) == 1

    wait_for(scaled, 30, "2 launches cancelled and their actors removed", interval=0.3)
    svc = home.service("hasty")
    assert svc is not None
    (kept,) = [r["id"] for r in svc["replicas"]]
    for rid, data in handles.items():
        if rid != kept:
            actor = data.get("actor_pid")
            assert actor is None or not pid_alive(actor), f"actor of replica {rid} alive"
    wait_for(lambda: len(ray_home.processes()) <= 2, 15, "the cancelled setups to be gone")
    # The kept one is still in setup: `down` cancels it too and leaves nothing (checked by the
    # fixture: actors by name on the cluster, processes by pid and marker).


# -- restart --------------------------------------------------------------------------------------


def test_daemon_restart_readopts_and_resumes_logs(ray_home: RayHome, tmp_path: Path) -> None:
    home = ray_home.home
    endpoint = endpoint_of(home.run("up", str(ray_spec(tmp_path, "sticky", 2))).stdout)
    before = home.wait_replicas("sticky", 2, timeout=60)
    pids = {r["id"]: r["pid"] for r in before["replicas"]}
    actors = {rid: h["actor_pid"] for rid, h in ray_home.handles("sticky").items()}
    rid = min(pids)
    get_json(f"{before['replicas'][0]['endpoint']}/before-restart")
    wait_for(
        lambda: "/before-restart" in home.run("logs", "sticky", str(rid), "--no-follow").stdout,
        15,
        "the first request in the log",
    )

    home.run("daemon", "stop")
    wait_for(lambda: home.daemon_info() is None, 20, "the daemon to stop")
    stopped = time.time()
    assert all(pid_alive(p) for p in [*pids.values(), *actors.values()]), "died with the daemon"
    home.start_daemon()  # it answers at once; it adopts once it has connected to the cluster

    def adopted() -> list[dict[str, Any]] | None:
        events = home.api("GET", "/v1/services/sticky/events").json()["events"]
        after_stop = [e for e in events if e["ts"] > stopped]
        found = [e for e in after_stop if e["action"] == "replica.adopt"]
        return after_stop if len(found) == 2 else None

    events = wait_for(adopted, 60, "both replicas re-adopted")
    assert not any(e["action"] == "replica.unknown" for e in events), events
    after = home.wait_replicas("sticky", 2, timeout=60)
    assert {r["id"]: r["pid"] for r in after["replicas"]} == pids
    assert {rid: h["actor_pid"] for rid, h in ray_home.handles("sticky").items()} == actors
    assert len(ray_home.actors()) == 2
    if after["endpoint"] != endpoint:
        endpoint = after["endpoint"]
    seen = {get_json(f"{endpoint}/again")["replica"] for _ in range(10)}
    assert seen == {str(i) for i in pids}

    # The log resumes where it stopped: new lines arrive, old ones are not copied twice.
    get_json(f"{after['replicas'][0]['endpoint']}/after-restart")
    text = wait_for(
        lambda: (
            (t := home.run("logs", "sticky", str(rid), "--no-follow").stdout)
            and "/after-restart" in t
            and t
        ),
        15,
        "a request after the restart in the log",
    )
    assert text.count("/before-restart") == 1, text

    # An adopted replica's death is still seen and replaced.
    victim = max(pids)
    os.kill(pids[victim], signal.SIGKILL)
    replaced(home, "sticky", victim, "FAILED", 2)


def test_daemon_killed_during_launch_leaks_nothing(ray_home: RayHome, tmp_path: Path) -> None:
    """SIGKILL the daemon while every replica is in setup; the restarted daemon removes the
    orphaned actors (their launches can never finish) and relaunches: exactly N replicas."""
    home = ray_home.home
    flags = tmp_path / "flags"
    flags.mkdir()
    setup = f"f={flags}/$CORRAL_REPLICA_ID; [ -e $f ] && echo again || {{ touch $f; sleep 120; }}"
    home.run("up", "--detach", str(ray_spec(tmp_path, "slow", 2, setup=setup)))
    wait_for(lambda: len(list(flags.iterdir())) == 2, 60, "2 setups running", interval=0.2)
    first = ray_home.handles("slow")
    daemon = home.daemon_pid()
    os.kill(daemon, signal.SIGKILL)
    wait_for(lambda: not pid_alive(daemon), 10, "the daemon to die")
    assert len(ray_home.actors()) == 2, "the actors outlive the daemon"

    home.start_daemon()
    service = home.wait_replicas("slow", 2, timeout=90)
    assert sorted(r["id"] for r in service["replicas"]) == sorted(first)
    for data in first.values():
        assert not pid_alive(data["actor_pid"]), "an orphaned actor survived the restart"
    assert len(ray_home.actors()) == 2
    get_json(service["endpoint"] + "/x")


def test_actors_lost_while_no_daemon_ran_are_preempted_not_failed(
    ray_home: RayHome, tmp_path: Path
) -> None:
    """Replicas still STARTING whose actors die while the daemon is down: the restarted daemon
    judges them as a running one would (PREEMPTED, relaunched), not as failed apps that count
    toward the crash-loop rule and give the service up."""
    home = ray_home.home
    home.run("up", "--detach", str(ray_spec(tmp_path, "lost", 3, run="sleep 600")))

    def started() -> dict[int, dict[str, Any]] | None:
        # Launched, not just placed: an actor is recorded (with its pid) before its app starts,
        # and a launch the daemon died in is relaunched as itself, not judged PREEMPTED.
        svc = home.service("lost")
        launched = svc is not None and [r["status"] for r in svc["replicas"]] == ["STARTING"] * 3
        found = ray_home.handles("lost")
        return found if launched and all(h.get("pid") for h in found.values()) else None

    first = wait_for(started, 60, "3 replicas launched on the cluster", interval=0.3)
    daemon = home.daemon_pid()
    os.kill(daemon, signal.SIGKILL)
    wait_for(lambda: not pid_alive(daemon), 10, "the daemon to die")
    for data in first.values():
        os.kill(data["actor_pid"], signal.SIGKILL)
    wait_for(lambda: not ray_home.actors(), 30, "the killed actors to leave the cluster")

    home.start_daemon()

    def relaunched() -> dict[str, Any] | None:
        svc = home.service("lost")
        assert svc is not None
        states = {r["id"]: r["status"] for r in svc["replicas"]}
        fresh = [rid for rid, status in states.items() if rid not in first and status in LIVE]
        gone = [states.get(rid) for rid in first]
        if len(fresh) == 3 and gone == ["PREEMPTED"] * 3:
            return svc
        raise AssertionError(f"replica states {states}")  # shown if the wait times out

    svc = wait_for(relaunched, 60, "the 3 lost replicas PREEMPTED and 3 new ones launched")
    assert svc["status"] != "FAILED", svc
    events = home.api("GET", "/v1/services/lost/events").json()["events"]
    assert not any(e["action"] == "service.failed" for e in events), events


# -- a cluster that is not there (yet) -------------------------------------------------------------


def _waiting_reason(home: CorralHome, name: str) -> str | None:
    """The reason the service's only replica waits, once it is PENDING with one."""
    svc = home.service(name)
    if svc is None or len(svc["replicas"]) != 1:
        return None
    replica = svc["replicas"][0]
    return replica["waiting"] if replica["status"] == "PENDING" else None


def test_unreachable_cluster_is_reported_and_its_replicas_wait(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """A cluster that refuses connections: `up` is taken at once, the replica waits (not
    failed, not refused as an unknown backend) with the reason in status, the daemon's log says
    so, and `down` still removes the service."""
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    corral_home.env["RAY_ADDRESS"] = f"127.0.0.1:{port}"
    since = time.monotonic()
    corral_home.run("up", "--detach", str(ray_spec(tmp_path, "nowhere", 1)), timeout=60)
    took = time.monotonic() - since
    assert took < 30, f"`corral up` took {took:.1f}s"
    usable = f"Ray cluster at 127.0.0.1:{port} is not usable"
    reason = wait_for(
        lambda: (r := _waiting_reason(corral_home, "nowhere")) and usable in r and r,
        30,
        "the replica to wait, saying the cluster is not usable",
    )
    assert "Connection refused" in reason, reason
    events = corral_home.api("GET", "/v1/services/nowhere/events").json()["events"]
    assert any(e["action"] == "replica.waiting" for e in events), events
    assert not any(e["action"] in ("replica.failed", "service.failed") for e in events), events
    assert usable in corral_home.tail("daemon.log", 50)
    corral_home.run("down", "nowhere", "--timeout", "30", timeout=60)
    assert corral_home.service("nowhere") is None


def test_api_answers_while_the_cluster_is_still_connecting(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """A cluster that takes connections and never answers: the daemon's API answers anyway
    (it cannot have connected), a Ray replica waits naming the cluster, and a local service on
    the same daemon is served meanwhile."""
    with socket.create_server(("127.0.0.1", 0), backlog=64) as silent:
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        corral_home.env["RAY_ADDRESS"] = address
        corral_home.start_daemon()
        assert "connected to the Ray cluster" not in corral_home.tail("daemon.log", 200)
        corral_home.run("up", "--detach", str(ray_spec(tmp_path, "later", 1)), timeout=60)
        reason = wait_for(
            lambda: _waiting_reason(corral_home, "later"), 30, "the Ray replica to wait"
        )
        assert f"Ray cluster at {address}" in reason, reason
        local = write_spec(tmp_path / "here.yaml", spec_text("here", 1))
        corral_home.run("up", str(local), timeout=90)
        corral_home.wait_replicas("here", 1, timeout=60)
        still = _waiting_reason(corral_home, "later")
        assert still is not None and f"Ray cluster at {address}" in still, still
        corral_home.run("down", "--all", "--timeout", "30", timeout=60)


def test_a_deleted_home_takes_its_ray_replicas_along(ray_home: RayHome, tmp_path: Path) -> None:
    """A home deleted while its daemon runs: the daemon ends every replica of it before it
    exits (docs/architecture.md, "Owned by a home"), its Ray actors and their apps too. Nothing
    else ever could: no balancer worker, no later daemon and no `corral doctor` sees a
    cluster's actors, and the daemon forgets the home's registration on the way out."""
    home = ray_home.home
    home.run("up", str(ray_spec(tmp_path, "orphaned", 2)))
    home.wait_replicas("orphaned", 2, timeout=60)
    marker = home.marker
    assert marker is not None
    daemon = home.daemon_pid()
    ray_home.handles("orphaned")  # the actors' and apps' pids, checked below
    assert len(ray_home.actors()) == 2

    shutil.rmtree(home.path)
    wait_for(lambda: not pid_alive(daemon), 30, "the daemon of the deleted home to exit")
    left = ray_home.cluster.named_actors(f"corral-{marker}-")
    assert not left, f"actors of the deleted home left on the cluster: {left}"
    wait_for(
        lambda: not [p for p in ray_home.pids if pid_alive(p)], 15, "its actors and apps to end"
    )
    assert not (Path(tempfile.gettempdir()) / f"corral-{marker}").exists()
