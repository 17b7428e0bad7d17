"""The Ray backend: every replica is a detached, named Ray actor whose child is the app.

A user who already runs a Ray cluster sets ``infra: ray`` in a spec and points the daemon at the
cluster with ``RAY_ADDRESS`` (or ``CORRAL_RAY_ADDRESS``); nothing else about corral changes.
Install with ``pip install -e '.[ray]'`` from corral's checkout (it is not on PyPI): Ray stays
an optional dependency, imported only here.

What runs where:

* On a node: one :class:`~corral.infra._ray_actor.ReplicaActor` per replica, named
  ``corral-<home marker>-<service>-<replica id>`` in the namespace (default ``corral``),
  ``lifetime="detached"`` (it outlives the daemon, so a restarted daemon re-adopts it by name) and
  ``max_restarts=0`` (a restarted actor would be a new replica with a new port: corral replaces
  replicas itself). The actor picks a free port on its node, runs ``setup`` then ``run`` as its
  direct children in its own process group, so the app dies with the actor however the actor
  dies (see :mod:`corral.infra._ray_actor`). Output goes to node-local files.
* In the daemon: :meth:`RayInfra.launch` (a JobPool job) creates the actor, records its handle at
  once, streams setup's output into the launch log and starts ``run``. One :class:`_Pump` thread
  follows every replica: twice a second it asks each actor for new output (appended to the
  replica's log on the daemon side, so ``corral logs --follow`` works for remote replicas) and its
  child's state (which :meth:`RayInfra.check` answers from without another round trip).

Resources and placement (:mod:`corral.infra._ray_resources`): ``cpus`` -> ``num_cpus``
(0.01 when not given), ``memory`` -> ``memory`` bytes, ``accelerators: GPU:N`` or a GPU model ->
``num_gpus``, any other accelerator name -> a Ray custom resource (``accelerators: node-2:1``
pins to the node started with ``--resources '{"node-2": ...}'``), ``labels`` ->
``label_selector``. Among the nodes that can hold the request, the one with the fewest replicas
of the service is preferred (a soft node affinity: :meth:`RayInfra._choose_node`), so a service
survives the loss of one node.

The app's environment is the node's (minus ``CORRAL_*``) plus the spec's ``envs``, ``PORT``,
``CORRAL_REPLICA_ID``, ``CORRAL_SERVICE``, ``CORRAL_VERSION``, ``CORRAL_REPLICA_KEY`` and
``CORRAL_RAY_HOME_MARKER``. Not the local backend's ``CORRAL_HOME_MARKER``: the local leak sweep
stops every process on the daemon's machine that carries it without a *local* handle's key, so a
Ray node sharing the daemon's machine would lose its replicas at every daemon restart.

The handle's ``data``: ``actor_name``, ``namespace``, ``key`` (the replica key, also in the app's
environment), ``log`` and ``log_base`` (the daemon-side log and its size when the replica started,
so a restarted daemon resumes streaming where it stopped), then ``node_id``, ``ip``, ``port``,
``actor_pid`` and ``pid`` as they become known. ``launch`` calls ``on_started`` three times:
when the actor exists (name only: a crash after this leaks nothing, ``terminate`` needs just the
name), when its node and port are known (before anything of the app runs, so a recorded running
replica always has its endpoint), and with the app's pid.

Liveness: the app exited -> EXITED (with its exit code); the actor is gone (its node died, it was
killed, its worker crashed) -> LOST, so the controller replaces it as preempted rather than
counting an app failure; the cluster does not answer -> UNKNOWN.

Why every call to the cluster is bounded: a Ray driver blocks in GCS calls while the GCS is
unreachable, and by default *exits the whole process* after 60 s without it. The daemon must
outlive its cluster, so the connection is made with that exit disabled, every GCS call runs
through :func:`_bounded` (a timeout, and a cap on calls left hanging), and every ``ray.get``
has a timeout.

Limits: ``workdir`` (a version's copy in the corral home, see corral.versionfiles) must
exist at the same path on the nodes (the home on a shared filesystem, or one node); ``ports``
in the spec fixes the port on every node (two replicas on one node then collide); a child
that escapes the actor's process group and drops ``CORRAL_REPLICA_KEY`` from its environment
outlives an abruptly killed actor; ``labels`` need Ray >= 2.49; one Ray
connection per process, so one cluster per daemon.

Size: the rest is one class, :class:`RayInfra` (launch, terminate, check, sweep, each a few
short methods), kept whole because every part reads and writes the same record of actors this
process placed, launches in flight and the pump's latest answers; split, that state would be
passed between modules. What stands alone is elsewhere: bounded calls and the connection in
:mod:`corral.infra._ray_calls`, the log pump in :mod:`corral.infra._ray_pump`, resources and
options in :mod:`corral.infra._ray_resources`, and the daemon's side of the connection (made
in the background, so the daemon answers at once) in :mod:`corral.infra._ray_link`.
"""

from __future__ import annotations

import codecs
import contextlib
import logging
import random
import sys
import threading
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import ray
import ray.exceptions
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from corral import jobs
from corral.infra import _ray_actor
from corral.infra._ray_calls import (
    _ACTOR_DIED,
    _TRANSIENT,
    RayUnreachable,
    _bounded,
    _connect,
    _remote_code,
)
from corral.infra._ray_calls import (
    _connected as _connected,  # re-exported: tests reset the connection record
)
from corral.infra._ray_pump import _FRESH, _READ_CHUNK, _Pump
from corral.infra._ray_resources import RayPlacement, ray_options
from corral.infra.base import LaunchRequest, Liveness, ReplicaHandle

__all__ = ["BACKEND", "RayInfra", "RayUnreachable", "actor_name"]

BACKEND = "ray"
ENV_HOME_MARKER = _ray_actor.ENV_HOME_MARKER
ENV_REPLICA_KEY = _ray_actor.ENV_REPLICA_KEY

log = logging.getLogger("corral.infra.ray")


def actor_name(home_marker: str, service: str, seq: int) -> str:
    """The actor of one replica, named by the id users see (its number within the service):
    unique per corral home, found again after a daemon restart through its recorded handle."""
    return f"corral-{home_marker}-{service}-{seq}"


def replica_key(home_marker: str, service: str, replica_id: int) -> str:
    """Same value as the local backend's ``CORRAL_REPLICA_KEY``: one replica, any backend."""
    return f"{home_marker}/{service}/{replica_id}"


# -- the backend ----------------------------------------------------------------------------------


def _log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


class _Echo:
    """Setup's node-side output, decoded incrementally into the launch log (a multi-byte
    character split between two reads is not mangled)."""

    def __init__(self) -> None:
        self.offset = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def write(self, data: bytes, final: bool = False) -> None:
        self.offset += len(data)
        text = self._decoder.decode(data, final=final)
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()


class RayInfra:
    """Replicas as detached Ray actors on the cluster at ``address``. See the module docstring.

    The constructor connects (or raises RuntimeError within ``connect_timeout`` s).
    ``call_timeout`` bounds every call to the cluster; ``placement_timeout`` is how long a launch
    waits for the cluster to find room for an actor before failing; ``abort_grace`` is the
    TERM-to-KILL wait when a launch is abandoned and for leaks found by ``sweep``.
    """

    name = BACKEND

    def __init__(
        self,
        address: str,
        *,
        namespace: str = "corral",
        connect_timeout: float = 10.0,
        call_timeout: float = 10.0,
        placement_timeout: float = 300.0,
        poll_interval: float = 0.5,
        abort_grace: float = 5.0,
    ) -> None:
        self.address = address
        self.namespace = namespace
        self.call_timeout = call_timeout
        self.placement_timeout = placement_timeout
        self.abort_grace = abort_grace
        _connect(address, namespace, connect_timeout)
        self._pump = _Pump(poll_interval, call_timeout)
        self._inflight_lock = threading.Lock()
        self._inflight: set[str] = set()  # actor names of launches running in this process
        # actor name -> (service key, node id) of the replicas this process placed or adopted:
        # what _choose_node spreads a service's replicas by.
        self._placed: dict[str, tuple[str, str]] = {}

    # -- cluster helpers ----------------------------------------------------------------------

    def _lookup(self, name: str) -> Any | None:
        """The live actor called ``name`` in our namespace, or None when there is none."""

        def get() -> Any | None:
            try:
                return ray.get_actor(name, namespace=self.namespace)
            except ValueError:  # "Failed to look up actor": never existed, or dead
                return None

        return _bounded("get_actor", self.call_timeout, get)

    def _name_for(self, request: LaunchRequest) -> str:
        """The replica's actor name: by the id users see, unless another replica's actor holds
        that name (one started by a corral that named actors by the internal row id, still
        serving after an upgrade), which is never stopped for this one: then the internal id
        is appended."""
        name = actor_name(request.home_marker, request.service, request.shown_id)
        holder = self._lookup(name)
        key = replica_key(request.home_marker, request.service, request.replica_id)
        ours = _ray_actor.replica_dir(request.home_marker, key).name
        if holder is not None and self._dir_of(holder) not in (ours, None):
            return f"{name}.{request.replica_id}"
        return name

    def _dir_of(self, actor: Any) -> str | None:
        """The name of the node-local directory an actor serves, which names its replica by the
        internal id in every corral version (None: it does not answer)."""
        try:
            # ray.get ends by itself first: an overdue _bounded call would hold up the others.
            wait = self.call_timeout / 2
            ref = actor.info.remote()
            info = _bounded("info", self.call_timeout, lambda: ray.get(ref, timeout=wait))
        except Exception:  # a dead or wedged actor: it is stale whatever it served
            return None
        found = info.get("dir") if isinstance(info, dict) else None
        return Path(found).name if isinstance(found, str) else None

    def _kill(self, actor: Any) -> None:
        _bounded("kill", self.call_timeout, ray.kill, actor, no_restart=True)

    def _wait_gone(self, name: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            if self._lookup(name) is None:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def _node_alive(self) -> dict[str, bool]:
        nodes = _bounded("nodes", self.call_timeout, ray.nodes)
        return {str(n["NodeID"]): bool(n["Alive"]) for n in nodes}

    def _choose_node(self, service_key: str, name: str, options: dict[str, Any]) -> str | None:
        """The live node, among those that could ever hold this request, with the fewest
        replicas of this service (then of any service) that this process knows of.

        Why not Ray's SPREAD alone: it is best effort and was measured putting 3 replicas
        launched together on 2 of 3 nodes; a service whose replicas share a node loses them
        together. The choice is a *soft* affinity (Ray still places the actor elsewhere when
        that node is full or gone) judged on node totals, so it never makes a request
        unplaceable.
        """
        need: dict[str, float] = {
            "CPU": float(options.get("num_cpus") or 0),
            "GPU": float(options.get("num_gpus") or 0),
            "memory": float(options.get("memory") or 0),
        }
        need.update(options.get("resources") or {})
        if options.get("accelerator_type"):
            need[f"accelerator_type:{options['accelerator_type']}"] = 0.001
        selector: dict[str, str] = options.get("label_selector") or {}
        if any(v.startswith("!") or "(" in v for v in selector.values()):
            selector = {}  # an operator, not a value: Ray's label_selector alone decides
        candidates = []
        for node in _bounded("nodes", self.call_timeout, ray.nodes):
            if not node.get("Alive"):
                continue
            have: dict[str, float] = node.get("Resources") or {}
            labels: dict[str, str] = node.get("Labels") or {}
            if have.get("CPU", 0.0) <= 0:
                continue  # a node without CPUs (--num-cpus=0 head) is kept free of work
            if all(have.get(k, 0.0) >= v for k, v in need.items() if v > 0) and all(
                labels.get(k) == v for k, v in selector.items()
            ):
                candidates.append(str(node["NodeID"]))
        if not candidates:
            return None
        with self._inflight_lock:
            per_service = dict.fromkeys(candidates, 0)
            per_node = dict.fromkeys(candidates, 0)
            for svc, node_id in self._placed.values():
                if node_id in per_node:
                    per_node[node_id] += 1
                    if svc == service_key:
                        per_service[node_id] += 1
            best = min(candidates, key=lambda n: (per_service[n], per_node[n], random.random()))
            self._placed[name] = (service_key, best)  # counted before the actor even exists
        return best

    # -- launch -------------------------------------------------------------------------------

    def launch(self, request: LaunchRequest) -> ReplicaHandle:
        """Create the replica's actor, record it, run setup (output streamed into the launch
        log), start ``run`` and return the handle without waiting for readiness.

        Meant to run in a JobPool job whose route is the launch log. Raises
        :class:`jobs.CommandFailed` when setup fails, :class:`jobs.Cancelled` when the job is
        cancelled, RuntimeError/ValueError for what the cluster refuses; in every case the actor
        (and so the app) is gone before it returns.
        """
        name = self._name_for(request)
        with self._inflight_lock:
            self._inflight.add(name)
        try:
            return self._launch(request, name)
        finally:
            with self._inflight_lock:
                self._inflight.discard(name)

    def _launch(self, request: LaunchRequest, name: str) -> ReplicaHandle:
        placement = ray_options(request.resources)  # a bad spec fails before anything exists
        key = replica_key(request.home_marker, request.service, request.replica_id)
        self._announce(request, name, placement)
        stale = self._lookup(name)
        if stale is not None:
            # A replica's id is never reused within its service, so this is the actor of an
            # earlier, interrupted launch of this very replica (or one an earlier service of
            # this name left behind): nothing else will ever start or stop it.
            print(f"[corral] actor {name} is left from an interrupted launch; removing it")
            self._stop_actor(name, stale, self.abort_grace)
        jobs.checkpoint()

        log_path = Path(request.log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        data: dict[str, Any] = {
            "actor_name": name,
            "namespace": self.namespace,
            "key": key,
            "log": str(log_path),
            "log_base": _log_size(log_path),
        }
        # Recorded BEFORE the actor is created: the name is all terminate() needs, and an
        # actor whose creation call timed out but went through later is still found by it.
        request.on_started(ReplicaHandle(BACKEND, "", dict(data)))
        actor: Any = None
        try:
            actor = self._create_actor(request, name, key, dict(placement.options))
            return self._start(request, name, actor, data)
        except BaseException as exc:
            what = "cancelled" if isinstance(exc, jobs.Cancelled) else f"failed ({exc!r})"
            print(f"[corral] launch {what}; removing actor {name}", flush=True)
            self._abort(name, actor)
            raise

    def _announce(self, request: LaunchRequest, name: str, placement: RayPlacement) -> None:
        shown = {k: v for k, v in placement.options.items() if k != "scheduling_strategy"}
        print(
            f"[corral] launching replica {request.service}/{request.shown_id} "
            f"(version {request.version}) on Ray at {self.address} as actor {name} "
            f"(namespace {self.namespace}); resources {shown or 'none requested'}",
            flush=True,
        )
        for note in placement.notes:
            print(f"[corral] note: {note}", flush=True)

    def _create_actor(
        self, request: LaunchRequest, name: str, key: str, options: dict[str, Any]
    ) -> Any:
        """The replica's detached actor, on the node with the fewest replicas of the service
        when one is preferred (a soft affinity: any node that fits will do)."""
        actor_cls, _ = _remote_code()
        target = self._choose_node(f"{request.home_marker}/{request.service}", name, options)
        if target is not None:
            print(f"[corral] preferring node {target[:12]} (fewest replicas of this service)")
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                target, soft=True, _spill_on_unavailable=True
            )
        return _bounded(
            "create actor",
            self.call_timeout,
            lambda: actor_cls.options(
                name=name,
                namespace=self.namespace,
                lifetime="detached",
                max_restarts=0,
                max_task_retries=0,
                max_concurrency=8,
                **options,
            ).remote(key, request.home_marker),
        )

    def _start(
        self, request: LaunchRequest, name: str, actor: Any, data: dict[str, Any]
    ) -> ReplicaHandle:
        info = self._wait_placed(actor, name)
        port = ray.get(actor.reserve_port.remote(request.port), timeout=self.call_timeout)
        data.update(node_id=info["node_id"], ip=info["ip"], port=port, actor_pid=info["actor_pid"])
        self._place(name, data)
        endpoint = f"http://{info['ip']}:{port}"
        # Before anything of the app runs: a recorded, running replica always has its endpoint.
        request.on_started(ReplicaHandle(BACKEND, endpoint, dict(data)))
        print(
            f"[corral] actor {name} placed on node {info['node_id'][:12]} ({info['ip']}), "
            f"actor pid {info['actor_pid']}, port {port}",
            flush=True,
        )
        corral_env = {
            "PORT": str(port),
            "CORRAL_REPLICA_ID": str(request.shown_id),
            "CORRAL_SERVICE": request.service,
            "CORRAL_VERSION": str(request.version),
            ENV_HOME_MARKER: request.home_marker,
            ENV_REPLICA_KEY: data["key"],
        }
        # corral's variables win over the spec's: PORT is what the daemon probes, and the
        # marker and key are what stop() and sweep() trust.
        env = {str(k): str(v) for k, v in request.envs.items()} | corral_env
        names = ", ".join(sorted(set(request.envs) | set(corral_env)))
        # Keys only: values may be secrets, and this log is shown to anyone who asks for it.
        print(f"[corral] environment: the node's (minus CORRAL_*) + {names}", flush=True)
        workdir = str(request.workdir) if request.workdir is not None else None
        jobs.checkpoint()
        if request.setup and request.setup.strip():
            print(f"[corral] setup: {request.setup}", flush=True)
            code = self._run_setup(actor, request.setup, env, workdir, request.setup_timeout)
            if code != 0:
                raise jobs.SetupFailed(code)
            print("[corral] setup done", flush=True)
        jobs.checkpoint()
        print(f"[corral] run: {request.run}", flush=True)
        pid = ray.get(actor.start.remote(request.run, env, workdir), timeout=self.call_timeout)
        data["pid"] = pid
        handle = ReplicaHandle(BACKEND, endpoint, dict(data))
        self._pump.follow(name, actor, Path(data["log"]), 0)
        request.on_started(handle)
        print(
            f"[corral] started pid {pid} on node {info['ip']} port {port}; its output is "
            f"streamed to {data['log']}",
            flush=True,
        )
        jobs.checkpoint()
        return handle

    def _place(self, name: str, data: Mapping[str, Any]) -> None:
        """Note where a replica runs (see _choose_node)."""
        key, node_id = data.get("key"), data.get("node_id")
        if isinstance(key, str) and isinstance(node_id, str):
            with self._inflight_lock:
                self._placed[name] = (key.rsplit("/", 1)[0], node_id)

    def _unplace(self, name: str) -> None:
        with self._inflight_lock:
            self._placed.pop(name, None)

    def _wait_placed(self, actor: Any, name: str) -> dict[str, Any]:
        """Wait (cancellably) until the cluster has placed the actor and it answers."""
        ref = actor.info.remote()
        started = time.monotonic()
        next_note = started + 10.0
        while True:
            ready, _ = ray.wait([ref], timeout=0.25)
            if ready:
                info: dict[str, Any] = ray.get(ref, timeout=self.call_timeout)
                return info
            jobs.checkpoint()
            now = time.monotonic()
            if now - started > self.placement_timeout:
                raise RuntimeError(
                    f"the Ray cluster found no node for actor {name} within "
                    f"{self.placement_timeout:g}s (resources or labels no node has?)"
                )
            if now >= next_note:
                print(f"[corral] waiting for the cluster to place actor {name}...", flush=True)
                next_note = now + 30.0

    def _run_setup(
        self,
        actor: Any,
        command: str,
        env: dict[str, str],
        workdir: str | None,
        timeout: float | None = None,
    ) -> int:
        """Run setup on the node, echoing its output into the launch log as it comes. Past
        ``timeout`` (service.setup_timeout_seconds) it fails, as on the local backend, and the
        launch's abort removes the actor with setup: a hung setup held its launch slot forever."""
        ref = actor.run_setup.remote(command, env, workdir)
        echo = _Echo()
        deadline = None if timeout is None else time.monotonic() + timeout

        def pull(final: bool = False) -> None:
            while True:
                data = ray.get(
                    actor.read.remote("setup", echo.offset, _READ_CHUNK), timeout=self.call_timeout
                )
                echo.write(data, final=final and len(data) < _READ_CHUNK)
                if len(data) < _READ_CHUNK:
                    return

        while True:
            ready, _ = ray.wait([ref], timeout=0.3)
            pull(final=bool(ready))
            if ready:
                code: int = ray.get(ref, timeout=self.call_timeout)
                return code
            jobs.checkpoint()
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(
                    f"setup did not finish within {timeout:g}s "
                    "(service.setup_timeout_seconds); it was stopped"
                )

    def _abort(self, name: str, actor: Any | None) -> None:
        """Remove the actor of an abandoned launch (looked up by name when its creation did not
        return). Never raises: it runs while another error is on its way out, and that error is
        the one to report; the recorded handle lets the controller's teardown try again."""
        try:
            if actor is None:
                actor = self._lookup(name)
            if actor is not None:
                self._stop_actor(name, actor, self.abort_grace)
            self._unplace(name)
        except Exception as exc:
            print(f"[corral] removing actor {name} failed: {exc!r}", flush=True)

    def _stop_actor(self, name: str, actor: Any, grace: float) -> None:
        """Stop the app (TERM, KILL after ``grace``), keep the rest of its output, remove the
        actor and make sure it is gone. Raises when it is not."""
        try:
            left: list[str] = ray.get(actor.stop.remote(grace), timeout=grace + self.call_timeout)
            for line in left:
                print(f"[corral] on the node: {line}; killing the actor ends its group", flush=True)
        except ray.exceptions.GetTimeoutError:
            print(f"[corral] actor {name} did not stop its app in time; killing it", flush=True)
        except ray.exceptions.RayActorError:
            pass  # already dead or dying: ray.kill below makes sure
        self._pump.drain(name, self.call_timeout)
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(actor.cleanup.remote(), timeout=self.call_timeout)
        self._kill(actor)
        if not self._wait_gone(name, self.call_timeout):
            raise RuntimeError(f"Ray actor {name} still exists after ray.kill")
        self._pump.forget(name)
        self._unplace(name)

    # -- terminate / check / exit_code ---------------------------------------------------------

    @staticmethod
    def _data(handle: ReplicaHandle) -> Mapping[str, Any]:
        if handle.backend != BACKEND:
            raise ValueError(f"not a {BACKEND} replica handle: backend={handle.backend!r}")
        name = handle.data.get("actor_name")
        if not isinstance(name, str) or not name.startswith("corral-"):
            raise ValueError(f"malformed {BACKEND} replica handle {dict(handle.data)!r}")
        return handle.data

    def terminate(self, handle: ReplicaHandle, grace: float) -> None:
        """Stop the app (TERM, KILL after ``grace`` s), copy the rest of its output, kill the
        actor. Idempotent: an actor that is already gone is success (its app died with it; a
        stray that kept the replica's key is stopped by a task on its node). Raises when the
        cluster does not answer or the actor survives."""
        data = self._data(handle)
        name = str(data["actor_name"])
        entry = self._pump.get(name)
        actor = self._lookup(name) if entry is None or entry.dead is None else None
        if actor is None:
            print(f"[corral] actor {name} is already gone", flush=True)
            self._pump.forget(name)
            self._unplace(name)
            self._reap_node(data)
            return
        print(f"[corral] stopping actor {name}: TERM, KILL after {grace:g}s", flush=True)
        self._stop_actor(name, actor, grace)
        print(f"[corral] actor {name} removed", flush=True)

    def _reap_node(self, data: Mapping[str, Any]) -> None:
        """After an actor died on a node that is still up, stop what kept its replica key there
        (a child that left the actor's process group). Best effort, bounded."""
        node_id, key = data.get("node_id"), data.get("key")
        if not isinstance(node_id, str) or not isinstance(key, str):
            return
        try:
            if not self._node_alive().get(node_id, False):
                return
            _, reaper = _remote_code()
            marker = key.split("/", 1)[0]
            ref = reaper.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
            ).remote(marker, [], key)
            for line in ray.get(ref, timeout=self.call_timeout * 3):
                print(f"[corral] stopped a process the actor left: {line}", flush=True)
        except Exception as exc:
            print(f"[corral] could not look for leftovers on node {node_id[:12]}: {exc!r}")

    def check(self, handle: ReplicaHandle) -> Liveness:
        """ALIVE while the app runs; EXITED once it ended; LOST when the actor is gone (node
        died, actor killed); UNKNOWN when the cluster does not answer. Usually answered from the
        pump's latest poll; a replica this process does not follow yet (a restarted daemon's) is
        asked directly and then followed, its output resuming where the daemon-side log ends."""
        data = self._data(handle)
        name = str(data["actor_name"])
        entry = self._pump.get(name)
        if entry is not None:
            if entry.dead is not None:
                return Liveness.LOST
            if entry.code is not None:
                return Liveness.EXITED
            if entry.started and time.monotonic() - entry.updated < _FRESH:
                return Liveness.ALIVE
            actor = entry.actor
        else:
            try:
                actor = self._lookup(name)
            except RayUnreachable:
                return Liveness.UNKNOWN
            if actor is None:
                return Liveness.LOST
        try:
            answer = ray.get(actor.poll.remote(0, 0), timeout=min(self.call_timeout, 5.0))
        except _TRANSIENT:
            return Liveness.UNKNOWN
        except _ACTOR_DIED as exc:
            if entry is not None:
                self._pump.mark_dead(entry, exc)
            return Liveness.LOST
        except Exception as exc:  # never into the controller (it adopts on its event loop)
            log.warning("checking Ray actor %s failed: %r", name, exc)
            return Liveness.UNKNOWN
        if not answer["started"]:
            with self._inflight_lock:
                launching = name in self._inflight
            if launching:
                return Liveness.ALIVE
            # A launch that died with a previous daemon: nothing will ever start (or stop) this
            # actor, and the controller relaunches the replica without its handle.
            with contextlib.suppress(Exception):
                self._stop_actor(name, actor, 0.0)
            return Liveness.EXITED
        if entry is None:
            self._place(name, data)
            log_path = Path(str(data.get("log") or ""))
            base = int(data.get("log_base") or 0)
            entry = self._pump.follow(name, actor, log_path, _log_size(log_path) - base)
        entry.code = answer["code"]
        entry.started = True
        entry.updated = time.monotonic()
        return Liveness.ALIVE if answer["code"] is None else Liveness.EXITED

    def exit_code(self, handle: ReplicaHandle) -> int | None:
        """The app's exit code as the pump last saw it (negative: killed by that signal); None
        while it runs or when it is not known. Never calls the cluster: it runs on the daemon's
        event loop, right after :meth:`check` said EXITED."""
        entry = self._pump.get(str(self._data(handle)["actor_name"]))
        return entry.code if entry is not None else None

    # -- sweep ----------------------------------------------------------------------------------

    def sweep(
        self,
        home_marker: str,
        known: Collection[ReplicaHandle],
        recorded: Collection[str] | None = None,
    ) -> list[str]:
        """Remove actors of this corral home that no known handle names (a launch interrupted
        between creating the actor and recording it), then, on every live node, processes of
        this home whose replica key no known handle holds. Returns one line per thing removed.

        With ``recorded``, an actor whose replica the state file does not know is spared and
        reported (not provably a leftover). Processes on the nodes are still judged by the
        known keys alone (the node-side reaper does not get the recorded ones)."""
        known_names: set[str] = set()
        known_keys: set[str] = set()
        for handle in known:
            if handle.backend != BACKEND:
                continue
            name = handle.data.get("actor_name")
            if isinstance(name, str):
                known_names.add(name)
            key = handle.data.get("key")
            if isinstance(key, str):
                known_keys.add(key)
        with self._inflight_lock:
            known_names |= self._inflight
        known_names |= self._pump.names()
        report: list[str] = []
        for name in self._home_actors(home_marker):
            if name in known_names:
                continue
            if recorded is not None and (own := self._actor_key(name, home_marker)) not in recorded:
                report.append(f"spared Ray actor {name}: no replica of the state file is its own")
                known_names.add(name)
                known_keys.add(own)  # its processes are spared too: they carry its key
                continue
            report.extend(self._remove(name, self.abort_grace))
        # Keys of live actors are spared too: their children carry them.
        keys = sorted(known_keys | {_key_of(n, home_marker) for n in known_names})
        report.extend(self._reap_everywhere(home_marker, keys))
        return report

    def end_home(self, home_marker: str, grace: float) -> list[str]:
        """The home is gone (its daemon saw it deleted): every actor of it removed and every
        process of it on the nodes stopped, sparing none (unlike :meth:`sweep`: no daemon will
        ever adopt them, and ``corral doctor`` cannot see a cluster). One line per thing."""
        report: list[str] = []
        for name in self._home_actors(home_marker):
            self._pump.forget(name)  # its log was in the home: nothing more is written there
            report.extend(self._remove(name, grace))
        report.extend(self._reap_everywhere(home_marker, []))
        return report

    def _home_actors(self, home_marker: str) -> list[str]:
        """The names of the live named actors of this corral home in our namespace."""
        prefix = f"corral-{home_marker}-"
        listed = _bounded(
            "list_named_actors", self.call_timeout, ray.util.list_named_actors, all_namespaces=True
        )
        return [
            str(item["name"])
            for item in listed
            if item["namespace"] == self.namespace and str(item["name"]).startswith(prefix)
        ]

    def _remove(self, name: str, grace: float) -> list[str]:
        """Stop the actor called ``name`` and its app; a line saying so (none: already gone)."""
        actor = self._lookup(name)
        if actor is None:
            return []
        try:
            self._stop_actor(name, actor, grace)
        except Exception as exc:
            return [f"Ray actor {name}: could not remove it: {exc!r}"]
        return [f"Ray actor {name} (namespace {self.namespace})"]

    def _actor_key(self, name: str, home_marker: str) -> str:
        """The replica key of a live actor of this home. Not from its name, which carries the
        id users see, but from the node-local directory it serves, named (as the key is) by the
        internal id; from the name only when the actor does not answer."""
        actor = self._lookup(name)
        served = self._dir_of(actor) if actor is not None else None
        service, _, replica = (served or "").rpartition("-")
        if service and replica.isdigit():
            return replica_key(home_marker, service, int(replica))
        return _key_of(name, home_marker)

    def _reap_everywhere(self, home_marker: str, keep: list[str]) -> list[str]:
        """Run the stray reaper on every live node at once; one line per process it stopped
        (or per node it could not ask). A node that died meanwhile took its processes along."""
        try:
            nodes = [n for n, alive in self._node_alive().items() if alive]
            _, reaper = _remote_code()
        except Exception as exc:
            return [f"looking for leftover processes on the Ray nodes failed: {exc!r}"]
        refs = [
            reaper.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
            ).remote(home_marker, keep)
            for node in nodes
        ]
        lines: list[str] = []
        deadline = time.monotonic() + self.call_timeout * 2
        for node, ref in zip(nodes, refs, strict=True):
            try:
                found = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except ray.exceptions.TaskUnschedulableError:
                continue  # the node went away after it was listed
            except Exception as exc:
                lines.append(f"could not look for leftover processes on node {node[:12]}: {exc!r}")
                continue
            lines.extend(f"process on Ray node {node[:12]}: {line}" for line in found)
        return lines


def _key_of(name: str, home_marker: str) -> str:
    """The replica key of an actor name: ``corral-<marker>-<service>-<id>`` -> ``m/s/id``."""
    rest = name[len(f"corral-{home_marker}-") :]
    service, _, replica = rest.rpartition("-")
    return replica_key(home_marker, service, int(replica)) if replica.isdigit() else ""
