"""Tests of the Ray backend against a real multi-node Ray cluster on this machine.

The cluster (head ``node-0`` + ``node-1`` + ``node-2``, each with a custom resource of its name,
``node-1`` also with a node label) is started once for this file by a helper process shared by
the xdist workers (``tests/ray_cluster.py``): private ``RAY_TMPDIR``, 127.0.0.1 only,
shut down with ``Cluster.shutdown()`` and by pid, never ``ray stop``. Tests that remove a node
add a node of their own first, so a test running on the other worker never loses its replicas.

Launches run in a :class:`JobPool` job, as the controller runs them (stdout = the launch log).
Every test checks by pid that the actors and apps it started are gone; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

# Read by Ray when it is first imported: keep the driver on 127.0.0.1 (see engines.md).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")

from conftest import EXAMPLES, pid_alive, wait_for  # noqa: E402
from ray_cluster import LocalRayCluster  # noqa: E402
from ray_support import cluster_dir, guard_topology, topology  # noqa: E402

from corral import jobs  # noqa: E402
from corral.infra import _ray_link  # noqa: E402
from corral.infra import ray as ray_infra  # noqa: E402
from corral.infra._ray_resources import parse_memory, ray_options  # noqa: E402
from corral.infra.base import LaunchRequest, Liveness, ReplicaHandle  # noqa: E402

pytestmark = pytest.mark.timeout(120)

APP = f"exec {sys.executable} app.py"
CHANGES_TOPOLOGY = {"test_node_loss_is_lost_and_kills_its_replicas"}
NODES: list[dict[str, Any]] = [
    {"num_cpus": 2, "resources": {"node-0": 100}},
    {"num_cpus": 2, "resources": {"node-1": 100}, "labels": {"corral-test": "one"}},
    {"num_cpus": 2, "resources": {"node-2": 100}},
]


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _topology_guard(request: pytest.FixtureRequest) -> Iterator[None]:
    yield from guard_topology(request, CHANGES_TOPOLOGY)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRayCluster]:
    """This file's cluster, shared by the xdist workers (see the module docstring). Session
    scope, though only this file sees it: xdist interleaves files on a worker, and a module
    scope would stop and restart the cluster at every switch."""
    local = LocalRayCluster(cluster_dir(tmp_path_factory, __name__), NODES)
    saved = {k: os.environ.get(k) for k in local.env}
    os.environ.update(local.env)
    try:
        local.attach(timeout=150)
        yield local
    finally:
        with contextlib.suppress(Exception):
            if ray.is_initialized():
                ray.shutdown()
        ray_infra._connected.clear()
        survivors = local.detach()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        assert not survivors, f"cluster processes needed SIGKILL: {survivors}"


@pytest.fixture(scope="session")
def infra(cluster: LocalRayCluster) -> ray_infra.RayInfra:
    return ray_infra.RayInfra(cluster.address, connect_timeout=30)


@dataclass
class Launched:
    """One replica launched through a JobPool, and what it recorded."""

    request: LaunchRequest
    job: jobs.Job
    launch_log: Path
    handles: list[ReplicaHandle] = field(default_factory=list)

    @property
    def handle(self) -> ReplicaHandle:
        assert self.handles, "nothing recorded"
        return self.handles[-1]

    def wait(self, timeout: float = 60.0) -> ReplicaHandle:
        assert self.job.wait(timeout), f"launch still running after {timeout}s"
        assert self.job.state is jobs.JobState.SUCCEEDED, (
            f"{self.job.state}: {self.job.exception()!r}\n{self.launch_log.read_text()}"
        )
        return self.handle


@dataclass
class Harness:
    """Launches replicas of one test (its own home marker) and cleans up after it."""

    infra: ray_infra.RayInfra
    tmp: Path
    marker: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    pool: jobs.JobPool = field(default_factory=lambda: jobs.JobPool(max_workers=4))
    launched: list[Launched] = field(default_factory=list)
    next_id: int = 1
    node_removed: bool = False  # a node died with its replica's node-local files on it

    def launch(
        self,
        run: str = APP,
        *,
        setup: str | None = None,
        resources: dict[str, Any] | None = None,
        workdir: Path | None = EXAMPLES,
        envs: dict[str, str] | None = None,
        display_id: int | None = None,
        setup_timeout: float | None = None,
    ) -> Launched:
        rid = self.next_id
        self.next_id += 1
        handles: list[ReplicaHandle] = []
        request = LaunchRequest(
            service="svc",
            replica_id=rid,
            version=1,
            run=run,
            setup=setup,
            envs=envs or {},
            workdir=workdir,
            replica_dir=self.tmp / f"replica-{rid}",
            log_path=self.tmp / f"replica_{rid}.log",
            port=None,
            resources=resources or {},
            home_marker=self.marker,
            on_started=handles.append,
            display_id=display_id,
            setup_timeout=setup_timeout,
        )
        log = self.tmp / f"replica_{rid}_launch.log"
        job = self.pool.submit(self.infra.launch, request, log=log, name=f"launch-{rid}")
        item = Launched(request, job, log, handles)
        self.launched.append(item)
        return item

    def pids(self, handle: ReplicaHandle) -> set[int]:
        return {int(handle.data[k]) for k in ("pid", "actor_pid") if handle.data.get(k)}

    def keyed(self) -> list[int]:
        """Live processes (any node: they all run on this machine) of this test's replicas."""
        found = []
        for proc in psutil.process_iter():
            try:
                env = proc.environ()
                if (
                    env.get("CORRAL_RAY_HOME_MARKER") == self.marker
                    and proc.status() != psutil.STATUS_ZOMBIE
                ):
                    found.append(proc.pid)
            except (psutil.Error, OSError):
                continue
        return found

    def keyed_of(self, handle: ReplicaHandle) -> set[int]:
        """Live processes carrying ``handle``'s replica key."""
        found = set()
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                env = proc.environ()
                if (
                    env.get("CORRAL_REPLICA_KEY") == handle.data["key"]
                    and proc.status() != psutil.STATUS_ZOMBIE
                ):
                    found.add(proc.pid)
        return found

    def assert_gone(self, handle: ReplicaHandle, timeout: float = 20.0) -> None:
        name = handle.data["actor_name"]
        wait_for(lambda: self.infra._lookup(name) is None, timeout, f"actor {name} to be gone")
        for pid in self.pids(handle):
            wait_for(lambda p=pid: not pid_alive(p), timeout, f"pid {pid} to be gone")

    def cleanup(self) -> None:
        for item in self.launched:
            item.job.cancel()
        for item in self.launched:
            item.job.wait(60)
        self.pool.shutdown(timeout=30)
        for item in self.launched:
            if item.handles:
                self.infra.terminate(item.handle, 2.0)
        for item in self.launched:
            if item.handles:
                self.assert_gone(item.handle)
        leftovers = self.keyed()
        assert not leftovers, f"replica processes left: {leftovers}"
        # Each actor removes its node-local directory; the reaper removes that of an actor
        # that died abruptly. Only a node that was removed keeps its files (here: in /tmp).
        local = Path(tempfile.gettempdir()) / f"corral-{self.marker}"
        if self.node_removed:
            shutil.rmtree(local, ignore_errors=True)
        assert not local.exists(), f"node-local files left: {list(local.iterdir())}"


@pytest.fixture
def harness(infra: ray_infra.RayInfra, tmp_path: Path) -> Iterator[Harness]:
    h = Harness(infra, tmp_path)
    try:
        yield h
    finally:
        h.cleanup()


def get(url: str, timeout: float = 5.0) -> bytes:
    assert url.startswith("http://127.0.0.1:"), url
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        body: bytes = answer.read()
        return body


def serving(url: str, timeout: float = 30.0) -> bytes:
    return wait_for(lambda: get(url, 2.0), timeout, f"{url} to answer")


def liveness(infra: ray_infra.RayInfra, handle: ReplicaHandle, want: Liveness, t: float) -> None:
    wait_for(lambda: infra.check(handle) is want, t, f"{handle.data['actor_name']} to be {want}")


# -- no cluster needed ----------------------------------------------------------------------------


def test_resources_map_to_ray_options() -> None:
    placement = ray_options(
        {"cpus": "2+", "memory": "16", "accelerators": ["A100:2", "H100:1"], "ports": [[80, 80]]}
    )
    assert placement.options["num_cpus"] == 2.0
    assert placement.options["memory"] == 16 * 1024**3
    assert placement.options["num_gpus"] == 2.0
    assert placement.options["accelerator_type"] == "A100"
    assert placement.options["scheduling_strategy"] == "SPREAD"
    assert any("at least" in n for n in placement.notes)
    assert any("one request" in n for n in placement.notes)

    pinned = ray_options({"accelerators": ["node-2:0.5"], "labels": {"zone": "a"}})
    assert pinned.options["resources"] == {"node-2": 0.5}
    assert pinned.options["label_selector"] == {"zone": "a"}
    assert ray_options({"accelerators": ["GPU:1"]}).options["num_gpus"] == 1.0
    assert ray_options({}).options["num_cpus"] == 0.01  # next to nothing, but not 0
    assert "cloud" in ray_options({"cloud": "aws"}).notes[0]
    assert parse_memory("512MiB") == 512 * 1024**2
    assert parse_memory("1.5GB") == int(1.5 * 1024**3)
    with pytest.raises(ValueError, match="memory"):
        parse_memory("lots")


def test_a_hanging_cluster_costs_one_timeout() -> None:
    """A call that hangs (GCS gone) fails after its timeout; while it still hangs, later calls
    fail at once instead of each waiting (the controller checks every replica in a row)."""
    release = threading.Event()
    since = time.monotonic()
    with pytest.raises(ray_infra.RayUnreachable, match=r"did not answer within 0\.3s"):
        ray_infra._bounded("stuck", 0.3, release.wait, 30)
    assert 0.3 <= time.monotonic() - since < 2
    since = time.monotonic()
    with pytest.raises(ray_infra.RayUnreachable, match="still has no answer"):
        ray_infra._bounded("next", 5.0, lambda: 1)
    assert time.monotonic() - since < 0.1
    release.set()
    wait_for(lambda: ray_infra._bounded("again", 5.0, lambda: 42) == 42, 5, "calls to work again")
    with pytest.raises(ZeroDivisionError):
        ray_infra._bounded("error", 5.0, lambda: 1 / 0)


@pytest.mark.parametrize("kind", ["closed port", "silent listener"])
def test_unreachable_cluster_fails_within_seconds(kind: str) -> None:
    """A fresh process (one Ray connection per process) pointed at a cluster that is not there:
    a clear RuntimeError within the timeout, never a hang."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        if kind == "silent listener":
            listener.listen(16)  # accepts TCP, never speaks gRPC
        else:
            listener.close()
        code = (
            "import time, sys\n"
            "from corral.infra.ray import RayInfra\n"
            "t = time.monotonic()\n"
            "try:\n"
            f"    RayInfra('127.0.0.1:{port}', connect_timeout=4)\n"
            "except RuntimeError as exc:\n"
            "    print(f'{time.monotonic() - t:.1f} {exc}')\n"
            "    sys.exit(0)\n"
            "sys.exit('connected?!')\n"
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "CORRAL_"))}
        since = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )
        took = time.monotonic() - since
    assert result.returncode == 0, result.stderr[-2000:]
    assert "did not answer" in result.stdout, result.stdout
    assert f"127.0.0.1:{port}" in result.stdout
    assert took < 20, f"took {took:.1f}s"  # interpreter + Ray import included


class _FakeRay:
    """Stands for a connected RayInfra in the tests of RayLink: records what reaches it."""

    name = "ray"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def launch(self, request: LaunchRequest) -> ReplicaHandle:
        self.calls.append("launch")
        return ReplicaHandle("ray", "http://127.0.0.1:1", {"actor_name": "corral-x-s-1"})

    def terminate(self, handle: ReplicaHandle, grace: float) -> None:
        self.calls.append("terminate")

    def check(self, handle: ReplicaHandle) -> Liveness:
        self.calls.append("check")
        return Liveness.ALIVE

    def exit_code(self, handle: ReplicaHandle) -> int | None:
        return 3

    def sweep(self, home_marker: str, known: Any, recorded: Any = None) -> list[str]:
        self.calls.append("sweep")
        return ["swept"]


def _request(tmp: Path) -> LaunchRequest:
    return LaunchRequest(
        service="svc",
        replica_id=1,
        version=1,
        run="true",
        setup=None,
        envs={},
        workdir=None,
        replica_dir=tmp / "replica-1",
        log_path=tmp / "replica_1.log",
        port=None,
        resources={},
        home_marker="x",
        on_started=lambda handle: None,
    )


def test_link_waits_for_its_connection_then_delegates(tmp_path: Path) -> None:
    """While connecting: launches wait (cancellably), checks are UNKNOWN (never evidence of
    death), teardown refuses with the reason; once connected, ``on_connected`` runs before
    anything reaches the backend, then every call does."""
    release = threading.Event()
    fake = _FakeRay()
    order: list[str] = []

    def make(address: str) -> _FakeRay:
        assert release.wait(30), "never released"
        return fake

    link = _ray_link.RayLink("127.0.0.1:9", connect_timeout=30, make=make)
    ready = threading.Event()
    link.start(
        on_connected=lambda infra: order.append(f"connected {infra is fake}"),
        on_ready=lambda: (order.append("ready"), ready.set()),
    )
    handle = ReplicaHandle("ray", "", {"actor_name": "corral-x-s-1"})
    assert "connecting to the Ray cluster at 127.0.0.1:9" in (link.not_ready() or "")
    assert link.settling()
    assert link.check(handle) is Liveness.UNKNOWN
    assert link.exit_code(handle) is None
    assert link.sweep("x", []) == []
    with pytest.raises(RuntimeError, match="connecting to the Ray cluster"):
        link.terminate(handle, 1.0)
    pool = jobs.JobPool(max_workers=2)
    try:
        log = tmp_path / "launch.log"
        waiting = pool.submit(link.launch, _request(tmp_path), log=log, name="waits")
        wait_for(lambda: "waiting: connecting" in log.read_text(), 10, "the launch to wait")
        assert waiting.cancel()
        assert waiting.wait(10) and waiting.state is jobs.JobState.CANCELLED
        launch = pool.submit(link.launch, _request(tmp_path), log=log, name="goes")
        release.set()
        assert ready.wait(10), "never ready"
        assert launch.wait(10) and launch.state is jobs.JobState.SUCCEEDED
    finally:
        pool.shutdown(timeout=10)
    assert order == ["connected True", "ready"]
    assert link.not_ready() is None and not link.settling()
    assert link.check(handle) is Liveness.ALIVE and link.exit_code(handle) == 3
    link.terminate(handle, 1.0)
    assert fake.calls == ["launch", "check", "terminate"]


def test_link_reports_a_cluster_that_fails_and_keeps_trying(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A refused connection ends the first attempt (adoption goes on) with the reason in
    words; the link tries again and connects once the cluster answers."""
    monkeypatch.setattr(_ray_link, "_RETRY_FIRST", 0.05)
    attempts: list[float] = []
    fake = _FakeRay()

    def make(address: str) -> _FakeRay:
        attempts.append(time.monotonic())
        if len(attempts) < 3:
            raise RuntimeError(f"Ray cluster at {address} did not answer: Connection refused")
        return fake

    gate = threading.Event()  # the second attempt waits until the first was looked at

    def held(address: str) -> _FakeRay:
        if len(attempts) == 1:
            assert gate.wait(10)
        return make(address)

    link = _ray_link.RayLink("127.0.0.1:9", connect_timeout=30, make=held)
    ready = threading.Event()
    link.start(on_ready=ready.set)
    wait_for(lambda: not link.settling(), 10, "the first attempt to end")
    reason = link.not_ready() or ""
    assert reason.startswith("Ray cluster at 127.0.0.1:9 is not usable: did not answer"), reason
    assert "still trying" in reason
    gate.set()
    assert ready.wait(10), f"not connected after {len(attempts)} attempts"
    assert len(attempts) == 3 and link.not_ready() is None


def test_link_says_when_the_first_attempt_outlives_its_timeout() -> None:
    """An attempt that hangs (a silent cluster) is reported after ``connect_timeout`` and no
    longer holds adoption up; the attempt goes on and would be used."""
    release = threading.Event()
    link = _ray_link.RayLink("127.0.0.1:9", connect_timeout=0.2, make=lambda a: _wait(release))
    link.start()
    try:
        wait_for(lambda: not link.settling(), 10, "the first attempt to be overdue")
        reason = link.not_ready() or ""
        assert "is not usable: no answer within 0.2s" in reason, reason
    finally:
        release.set()
    wait_for(lambda: link.not_ready() is None, 10, "the late connection to be used")


def _wait(release: threading.Event) -> _FakeRay:
    assert release.wait(30)
    return _FakeRay()


# -- launch, placement, serving -------------------------------------------------------------------


def test_the_actor_and_the_replica_carry_the_id_users_see(harness: Harness) -> None:
    """A replica whose internal key differs from its id within the service (here 1 and 7):
    its actor's name, its CORRAL_REPLICA_ID and its launch log's lines say 7 (issue 25:
    replica 3's actor was named after row 5)."""
    item = harness.launch(display_id=7)
    handle = item.wait()
    assert item.request.replica_id != 7
    assert handle.data["actor_name"] == f"corral-{harness.marker}-svc-7"
    assert harness.infra._lookup(f"corral-{harness.marker}-svc-7") is not None
    assert b'"replica": "7"' in serving(handle.endpoint + "/")
    launch_log = item.launch_log.read_text()
    assert "[corral] launching replica svc/7 " in launch_log, launch_log
    assert f"as actor corral-{harness.marker}-svc-7 " in launch_log, launch_log


def test_an_actor_named_by_an_earlier_corral_is_never_stopped_for_another_replica(
    harness: Harness,
) -> None:
    """An upgraded home: a replica started when actors were named by the internal row id
    (here row 1, named ``svc-1``) still serves; a new replica shown as 1 (row 2) must not take
    its name by stopping it: it gets the name with its internal id appended."""
    first = harness.launch(display_id=1).wait()
    assert first.data["actor_name"] == f"corral-{harness.marker}-svc-1"
    second = harness.launch(display_id=1).wait()
    assert second.data["actor_name"] == f"corral-{harness.marker}-svc-1.2"
    assert serving(first.endpoint + "/") and serving(second.endpoint + "/")
    assert harness.infra._lookup(f"corral-{harness.marker}-svc-1") is not None


def test_three_replicas_spread_over_nodes_and_serve(harness: Harness) -> None:
    items = [harness.launch(envs={"APP_VERSION": "7"}) for _ in range(3)]
    handles = [item.wait() for item in items]
    nodes = {h.data["node_id"] for h in handles}
    assert len(nodes) == 3, f"SPREAD put 3 replicas on {len(nodes)} node(s)"
    for item, handle in zip(items, handles, strict=True):
        assert handle.endpoint == f"http://127.0.0.1:{handle.data['port']}"
        body = serving(handle.endpoint + "/hello")
        assert b'"version": "7"' in body
        assert f'"replica": "{item.request.replica_id}"'.encode() in body
        assert f'"pid": {handle.data["pid"]}'.encode() in body
        assert harness.infra.check(handle) is Liveness.ALIVE
        launch_log = item.launch_log.read_text()
        assert "placed on node" in launch_log and "started pid" in launch_log
    # on_started came first with the name only, then with the endpoint, then with the pid.
    first, second, third = items[0].handles
    assert first.endpoint == "" and set(first.data) >= {"actor_name", "namespace", "key"}
    assert second.endpoint and "pid" not in second.data
    assert third.data["pid"]
    # The app's output reaches the daemon-side log.
    wait_for(
        lambda: "/hello" in items[0].request.log_path.read_text(errors="replace"),
        10,
        "the request line in the replica log",
    )


def test_pinned_replicas_land_on_their_node(harness: Harness, cluster: LocalRayCluster) -> None:
    by_resource = harness.launch(resources={"accelerators": ["node-2:1"]})
    by_label = harness.launch(resources={"labels": {"corral-test": "one"}})
    assert by_resource.wait().data["node_id"] == cluster.node_id("node-2")
    assert by_label.wait().data["node_id"] == cluster.node_id("node-1")
    serving(by_resource.handle.endpoint + "/")


def test_setup_output_streams_and_failed_setup_leaves_nothing(harness: Harness) -> None:
    ok = harness.launch(setup="echo preparing; echo 'héllo wörld'; sleep 0.3; echo prepared")
    ok.wait()
    text = ok.launch_log.read_text()
    assert "preparing\nhéllo wörld\nprepared\n" in text
    assert text.index("prepared") < text.index("[corral] run:")

    bad = harness.launch(setup="echo broken >&2; exit 7")
    assert bad.job.wait(60)
    assert bad.job.state is jobs.JobState.FAILED
    assert isinstance(bad.job.exception(), jobs.CommandFailed)
    assert "broken" in bad.launch_log.read_text()
    assert bad.handles, "the actor was recorded before it was created"
    harness.assert_gone(bad.handle)

    missing = harness.launch(workdir=Path("/nonexistent/corral-workdir"))
    assert missing.job.wait(60)
    assert missing.job.state is jobs.JobState.FAILED
    assert "does not exist on Ray node" in str(missing.job.exception())
    harness.assert_gone(missing.handle)


# -- liveness -------------------------------------------------------------------------------------


def test_app_exit_is_exited_with_its_code(harness: Harness) -> None:
    item = harness.launch(run="echo 'about to fail'; sleep 0.5; exit 3")
    handle = item.wait()
    liveness(harness.infra, handle, Liveness.EXITED, 15)
    assert harness.infra.exit_code(handle) == 3
    wait_for(
        lambda: "about to fail" in item.request.log_path.read_text(),
        10,
        "the app's last words in its log",
    )


def test_killed_app_process_is_exited(harness: Harness) -> None:
    handle = harness.launch().wait()
    serving(handle.endpoint + "/")
    os.kill(int(handle.data["pid"]), signal.SIGKILL)  # all nodes are this machine
    liveness(harness.infra, handle, Liveness.EXITED, 15)
    assert harness.infra.exit_code(handle) == -signal.SIGKILL
    harness.infra.terminate(handle, 2.0)
    harness.assert_gone(handle)


def test_killed_actor_is_lost_and_takes_its_app(harness: Harness) -> None:
    handle = harness.launch(run=f"sleep 300 & {APP}").wait()
    serving(handle.endpoint + "/")
    ray.kill(ray.get_actor(handle.data["actor_name"], namespace="corral"))
    liveness(harness.infra, handle, Liveness.LOST, 20)
    # The actor's process group (app and its background sleep) died with it.
    wait_for(lambda: not harness.keyed(), 15, "the replica's processes to die with the actor")
    harness.infra.terminate(handle, 2.0)  # already gone: succeeds
    harness.assert_gone(handle)


def test_node_loss_is_lost_and_kills_its_replicas(
    harness: Harness, cluster: LocalRayCluster
) -> None:
    resource = f"doomed-{uuid.uuid4().hex[:8]}"
    with topology(cluster, exclusive=True):
        node = cluster.add_node(num_cpus=1, resources={resource: 10})
        handle = harness.launch(resources={"accelerators": [f"{resource}:1"]}).wait()
        assert handle.data["node_id"] == node
        serving(handle.endpoint + "/")
        cluster.remove_node(node)
    harness.node_removed = True
    liveness(harness.infra, handle, Liveness.LOST, 60)
    for pid in harness.pids(handle):
        wait_for(lambda p=pid: not pid_alive(p), 15, f"pid {pid} to die with its node")
    assert not harness.keyed()
    harness.infra.terminate(handle, 2.0)


# -- teardown -------------------------------------------------------------------------------------


def test_terminate_stops_the_app_group_and_is_idempotent(harness: Harness) -> None:
    handle = harness.launch(run=f"sleep 300 & {APP}").wait()
    serving(handle.endpoint + "/")
    before = set(harness.keyed())
    assert len(before) >= 2, before  # the app and its background sleep
    since = time.monotonic()
    harness.infra.terminate(handle, 3.0)
    assert time.monotonic() - since < 10
    harness.assert_gone(handle)
    assert not [p for p in before if pid_alive(p)]
    harness.infra.terminate(handle, 3.0)  # again: nothing to do, no error
    assert harness.infra.check(handle) is Liveness.LOST


def test_cancel_mid_setup_leaves_no_actor_and_no_process(harness: Harness) -> None:
    item = harness.launch(setup="echo setting up; sleep 120")
    wait_for(lambda: "setting up" in item.launch_log.read_text(), 30, "setup to start")
    # Its processes, found by their environment: read while the shell execs ``sleep`` (right
    # after the echo), /proc/<pid>/environ can come back empty, so this waits a little.
    wait_for(harness.keyed, 10, "setup's processes on the node")
    assert item.job.cancel()
    assert item.job.wait(30)
    assert item.job.state is jobs.JobState.CANCELLED
    harness.assert_gone(item.handle)
    wait_for(lambda: not harness.keyed(), 10, "setup's processes to be gone")


def test_a_setup_past_its_timeout_fails_and_leaves_nothing(harness: Harness) -> None:
    """service.setup_timeout_seconds holds on Ray as locally (docs/spec.md, `setup`): a hung
    setup fails its launch and goes with its actor, instead of holding a launch slot forever."""
    item = harness.launch(setup="echo setting up; sleep 120", setup_timeout=2.0)
    assert item.job.wait(45), "a setup past its timeout still runs"
    assert item.job.state is jobs.JobState.FAILED
    assert "setup did not finish within 2s (service.setup_timeout_seconds)" in str(
        item.job.exception()
    )
    harness.assert_gone(item.handle)
    wait_for(lambda: not harness.keyed(), 10, "setup's processes to be gone")


# -- restart: adoption and sweep ------------------------------------------------------------------


def test_restarted_daemon_adopts_and_resumes_the_log(
    harness: Harness, cluster: LocalRayCluster
) -> None:
    item = harness.launch()
    handle = item.wait()
    serving(handle.endpoint + "/before")
    log = item.request.log_path
    wait_for(lambda: "/before" in log.read_text(), 10, "the first request in the log")
    # A restarted daemon: a new backend object that never saw the launch (same connection:
    # Ray allows one per process); the old one stops following, as if it had died.
    harness.infra._pump.forget(handle.data["actor_name"])
    fresh = ray_infra.RayInfra(cluster.address)
    assert fresh.sweep(harness.marker, [handle]) == []  # known: spared
    assert fresh.check(handle) is Liveness.ALIVE
    serving(handle.endpoint + "/after")
    wait_for(lambda: "/after" in log.read_text(), 10, "the second request in the log")
    text = log.read_text()
    assert text.count("/before") == 1, text  # resumed where it stopped, nothing twice
    fresh.terminate(handle, 2.0)
    harness.assert_gone(handle)


def test_sweep_removes_unrecorded_actors_only(harness: Harness, cluster: LocalRayCluster) -> None:
    kept = harness.launch().wait()
    lost = harness.launch(run=f"sleep 300 & {APP}").wait()
    serving(kept.endpoint + "/")
    serving(lost.endpoint + "/")
    lost_pids = harness.pids(lost) | harness.keyed_of(lost)
    kept_pids = harness.pids(kept) | harness.keyed_of(kept)
    assert len(lost_pids) >= 3, lost_pids  # actor, app, background sleep
    # A restarted daemon whose state knows only `kept` (`lost` was never recorded).
    restarted = ray_infra.RayInfra(cluster.address)
    report = restarted.sweep(harness.marker, [kept])
    assert any(lost.data["actor_name"] in line for line in report), report
    harness.assert_gone(lost)
    for pid in lost_pids:
        wait_for(lambda p=pid: not pid_alive(p), 10, f"swept pid {pid} to be gone")
    assert all(pid_alive(p) for p in kept_pids)
    assert harness.infra.check(kept) is Liveness.ALIVE
    serving(kept.endpoint + "/")


def test_sweep_spares_an_unrecorded_actor_with_its_app(
    harness: Harness, cluster: LocalRayCluster
) -> None:
    """A replica the state file does not know (forgotten by `down --purge` while the cluster
    did not answer, or a state file restored from an older backup) is spared, with its app:
    its actor's name carries the id users see (5), its processes the internal key (row 1).
    The sweep once judged and kept keys by the name, so it reported the actor spared and
    killed its app, leaving a live actor that nothing follows."""
    item = harness.launch(run=f"sleep 300 & {APP}", display_id=5)
    handle = item.wait()
    serving(handle.endpoint + "/")
    app = harness.keyed_of(handle)
    assert len(app) >= 2, app  # the app and its background sleep
    restarted = ray_infra.RayInfra(cluster.address)
    report = restarted.sweep(harness.marker, [], recorded=set())
    assert any(line.startswith("spared Ray actor") for line in report), report
    assert not [line for line in report if "process on Ray node" in line], report
    assert all(pid_alive(p) for p in app), report
    serving(handle.endpoint + "/")
    # The state file knows its key (a row without a handle): not spared, removed.
    report = restarted.sweep(harness.marker, [], recorded={handle.data["key"]})
    assert any(handle.data["actor_name"] in line for line in report), report
    harness.assert_gone(handle)
    for pid in app:
        wait_for(lambda p=pid: not pid_alive(p), 10, f"swept pid {pid} to be gone")


def test_concurrent_checks_are_cheap(harness: Harness) -> None:
    """check() answers from the pump: ~1 call/s per replica costs no round trip."""
    handle = harness.launch().wait()
    liveness(harness.infra, handle, Liveness.ALIVE, 10)
    results: list[float] = []

    def many() -> None:
        for _ in range(50):
            since = time.perf_counter()
            harness.infra.check(handle)
            results.append(time.perf_counter() - since)

    threads = [threading.Thread(target=many) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    results.sort()
    assert results[len(results) // 2] < 0.005, f"median check {results[len(results) // 2]:.4f}s"


def test_a_bounded_call_prints_into_its_callers_log(tmp_path: Path) -> None:
    """A Ray call from a launch or teardown job runs on a helper thread (so a silent cluster
    costs a timeout, not a hung job): what it prints or logs belongs to that job's log, not to
    the daemon's."""
    from corral.infra import _ray_calls

    pool = jobs.JobPool(max_workers=1)
    try:
        log = tmp_path / "launch.log"
        job = pool.submit(_ray_calls._bounded, "probe", 10.0, print, "said on the helper", log=log)
        assert job.wait(10)
    finally:
        assert pool.shutdown(timeout=10)
    assert "said on the helper" in log.read_text()
