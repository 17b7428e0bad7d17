"""The daemon: the control plane of one corral home, hosting every service's controller.

Why one process: a service costs a controller task and a few rows, not two processes and a
worker per launch. The daemon owns the event loop (API, controllers, probes), the JobPool
(launch/teardown threads) and the state file. Traffic does not run here: the balancer workers
(:mod:`corral.dataplane`) are processes of their own that outlive the daemon; the daemon starts
or adopts them and pushes them the routing table. Its files in the home:

* ``daemon.lock``: an ``flock`` held for the daemon's life: two daemons on one home are impossible.
* ``daemon.json``: pid, API host, port and scheme (and the TLS certificate's path, which a local
  client verifies the API against), written once the API listens (clients wait for it).
* ``token``: the API's bearer token, mode 0600; never passed to replicas.
* ``home_id``: a stable random id put in every replica's environment so a crashed daemon's
  half-recorded launches can be found and killed (the leak sweep at start).
* ``state.db``: services, versions, replicas, events, balancer workers.
* ``dataplane.sock`` (0600): the channel to the balancer workers; ``dataplane/worker-N.log``.
* ``daemon.stopped``: written when the daemon stops on purpose, so the workers do not start it
  again (they do, within seconds, after a crash or a SIGKILL).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from corral import admission, deploy, deploy_files, logfiles, versionfiles
from corral.balancer.metrics import render
from corral.controller import (
    ControllerDeps,
    ServiceController,
)
from corral.errors import (
    Conflict,
    InvalidRequest,
    NoSuchReplica,
    NoSuchService,
    NoSuchVersion,
    ServiceExists,
    ServiceShuttingDown,
)
from corral.ports import reserved_port
from corral.spec import (
    ServiceSpec,
    SpecError,
    parse_spec,
    redact_secrets,
    validate_name,
)
from corral.state import EventRow, ServiceRow, StateError, Store, VersionRow
from corral.views import keyed_by_replica_id

log = logging.getLogger("corral.daemon")


@dataclass(frozen=True)
class UpdateRequest:
    """What an update asks for: a new spec (its files' source, base_dir, envs, secrets), a
    version to roll back to (``from_version``), or a new spec over ``files_of``'s files."""

    spec_text: str | None = None
    mode: str = "rolling"
    source: str | None = None
    base_dir: str | None = None
    from_version: int | None = None
    files_of: int | None = None  # and its values: a dashboard scale keeps what runs, secrets too
    envs: Mapping[str, str] = field(default_factory=dict)
    secrets: Mapping[str, str] = field(default_factory=dict)


class Daemon:
    """The services of one home, and the operations the API offers on them."""

    def __init__(self, home: Path, store: Store, deps: ControllerDeps) -> None:
        self.home = home
        self.store = store
        self.deps = deps
        self.controllers: dict[str, ServiceController] = {}
        self.started_at = time.time()
        # Whether local replicas are confined away from the home, and how (or why not).
        self.confinement: dict[str, Any] = {"confined": False, "detail": "unknown"}
        self.stop_requested = asyncio.Event()
        # `corral daemon stop --all`: the balancer workers stop too (else they keep serving).
        self.stop_workers = False
        # Why the home is no longer this daemon's (deleted, replaced), once that is seen.
        self.home_lost: str | None = None
        self._deploy_locks: dict[str, asyncio.Lock] = {}

    async def start_controllers(self) -> None:
        """Every stored service's controller, once the files a killed daemon made for a
        version it never stored are gone (a cut `up` left its secrets for no service)."""
        try:
            swept = await asyncio.to_thread(deploy_files.sweep_leftovers, self.home, self.store)
        except (OSError, StateError) as exc:
            log.warning("version files a killed daemon left were not swept: %s", exc)
        else:
            for what in swept:
                log.warning("removed the files of version %s, never stored", what)
        for svc in self.store.services():
            await self._start_controller(svc.name)

    async def _start_controller(
        self, name: str, spec: ServiceSpec | None = None
    ) -> ServiceController:
        controller = ServiceController(name, self.deps, on_removed=self._removed)
        if spec is not None:
            controller.remember(1, spec)  # parsed off the loop by the API already
        self.controllers[name] = controller
        await controller.start()
        return controller

    def _removed(self, name: str) -> None:
        self.controllers.pop(name, None)

    async def stop_controllers(self) -> None:
        for controller in list(self.controllers.values()):
            await controller.stop()

    # -- operations ---------------------------------------------------------------------------

    async def create(
        self,
        spec_text: str,
        *,
        name: str | None,
        source: str | None,
        base_dir: str | None,
        envs: Mapping[str, str] | None = None,
        secrets: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        envs, secrets = envs or {}, secrets or {}
        spec = await self._check_off_loop(spec_text, source, name, base_dir, envs)
        assert spec.name is not None
        admission.check_inputs(spec, source=source, base_dir=base_dir, envs=envs, secrets=secrets)
        svc_name = spec.name
        stored_text = await asyncio.to_thread(redact_secrets, spec_text)
        stored = spec  # as the controller keeps it: secret values live only in the values file
        if spec.secrets:
            stored = await asyncio.to_thread(
                parse_spec, stored_text, source=source or "<request>", name=name, envs=envs
            )
        # Held from its pick until its route holds it (ports.hold_port): no other bind takes it.
        with reserved_port() as lb_port:
            async with self._deploy_lock(svc_name):
                if svc_name in self.controllers or self.store.service(svc_name) is not None:
                    self._live_row(svc_name)  # one going away: "shutting down", `update` won't do
                    raise ServiceExists(f"service {svc_name!r} already exists")
                # The version's files exist before its row does: a replica never finds them missing.
                await deploy_files.prepare(
                    self.home,
                    svc_name,
                    1,
                    spec,
                    base_dir=base_dir,
                    envs=envs,
                    secrets=secrets,
                    source=source,
                )
                # Before the row: a daemon killed between the two left the new service writing
                # on in the earlier one's logs (its replica 1's file shared by both).
                await self._fresh_logs(svc_name)
                try:
                    async with deploy_files.storing(self.home, svc_name, 1):
                        self.store.create_service(
                            svc_name, stored_text, source=source, base_dir=base_dir, lb_port=lb_port
                        )
                except KeyError:
                    raise ServiceExists(f"service {svc_name!r} already exists") from None
            controller = await self._start_controller(svc_name, stored)
        if controller.balancer is not None and not await controller.balancer.wait_serving():
            log.warning("service %s: not every balancer worker confirmed its port", spec.name)
        return controller.snapshot()

    async def _fresh_logs(self, name: str) -> None:
        """A new service's logs start empty, even where a service of the same name ran before
        (its logs move to ``logs.previous``): replica 1 of each is its own."""
        try:
            await asyncio.to_thread(logfiles.fresh, self.home / "services" / name / "logs")
        except OSError as exc:
            log.warning("service %s: earlier logs of this name not set aside: %s", name, exc)

    async def update(self, name: str, request: UpdateRequest) -> dict[str, Any]:
        """Store a new version of a service and let its controller roll it out. A rollback
        (``from_version``) re-deploys a stored version's spec as a new one, so the history only
        grows and every rollout is in the event log; it and a scale (``files_of``) reuse that
        version's files (workdir copy, values)."""
        async with self._deploy_lock(name):
            return await self._update(name, request)

    async def _update(self, name: str, request: UpdateRequest) -> dict[str, Any]:
        controller = self.controller(name)
        self._live_row(name)
        spec_text, source, base_dir = self._resolved(name, request)
        envs, secrets = request.envs, request.secrets
        reuse = request.from_version or request.files_of  # versions count from 1
        # The values its replicas run with: a rollback's or a scale's are the reused version's.
        fill = versionfiles.version_envs(self.home, name, reuse) if reuse else envs
        spec = await self._check_off_loop(spec_text, source, name, base_dir, fill)
        if request.from_version is None and request.files_of is None:
            admission.check_inputs(
                spec, source=source, base_dir=base_dir, envs=envs, secrets=secrets
            )
        # The service may have been taken down or updated while the spec was being checked.
        svc = self._live_row(name)
        if request.files_of not in (None, svc.current_version):  # it would undo what ran since
            raise Conflict(f"service {name!r} was updated meanwhile: scale it again")
        current = controller.spec(svc.current_version)
        admission.check_same_infra(current, spec)
        admission.check_update_room(name, request.mode, spec, self.deps.capacity)
        next_version = max(v.version for v in self.store.versions(name)) + 1
        if reuse:
            await deploy_files.reuse(self.home, name, reuse, next_version)
        else:
            await deploy_files.prepare(
                self.home,
                name,
                next_version,
                spec,
                base_dir=base_dir,
                envs=envs,
                secrets=secrets,
                source=source,
            )
        # Off the loop, as every parse: the largest spec takes up to a second to read.
        stored_text = await asyncio.to_thread(redact_secrets, spec_text)
        stored_spec = await asyncio.to_thread(
            parse_spec, stored_text, source=source or "<request>", name=name, envs=fill
        )
        async with deploy_files.storing(self.home, name, next_version):
            adopt = self._adoptable(name, svc.current_version, next_version, base_dir, stored_spec)
            self._live_row(name)
            version = self.store.add_version(
                name,
                stored_text,
                source=source,
                base_dir=base_dir,
                mode=request.mode,
                adopt_live=adopt is not None,
                adopt_from=adopt,
            )
        # Remembered before the next await: once the row is current, the controller's next step
        # (a timer may run it at any await) asks for this spec and must not parse it on the loop.
        controller.remember(version, stored_spec)  # secrets: only in the version's values
        if version != next_version:  # nothing else adds versions; never seen
            log.error("service %s: version %d stored as %d", name, next_version, version)
        await asyncio.to_thread(deploy_files.prune, self.home, self.store, name)
        controller.updated()
        return controller.snapshot()

    def _live_row(self, name: str) -> ServiceRow:
        """The service's row, while it is not going away (else ServiceShuttingDown)."""
        svc = self.store.service(name)
        if svc is None or svc.intent == "shutting_down" or name not in self.controllers:
            raise ServiceShuttingDown(f"service {name!r} is shutting down")
        return svc

    def _resolved(self, name: str, request: UpdateRequest) -> tuple[str, str | None, str | None]:
        """The spec text, source and base_dir an update deploys: its own, or a stored
        version's for a rollback."""
        if request.mode not in ("rolling", "blue_green"):
            raise InvalidRequest(f"mode must be rolling or blue_green, not {request.mode!r}")
        if request.from_version is None:
            if request.spec_text is None:
                raise InvalidRequest(
                    "field 'spec' (the service YAML) or 'from_version' is required"
                )
            return request.spec_text, request.source, request.base_dir
        if request.spec_text is not None:
            raise InvalidRequest("give either a spec or a version to roll back to, not both")
        old = self.store.version(name, request.from_version)
        if old is None:
            raise NoSuchVersion(f"service {name!r} has no version {request.from_version}")
        if request.envs or request.secrets:
            raise InvalidRequest("a rollback reuses the version's values: no envs/secrets")
        return old.spec_yaml, old.source, old.base_dir

    def _deploy_lock(self, name: str) -> asyncio.Lock:
        """One create/update of a service at a time: the next version's number is taken, and
        its directory made, before the version is stored."""
        return self._deploy_locks.setdefault(name, asyncio.Lock())

    def _adoptable(
        self, name: str, current: int, new: int, base_dir: str | None, new_spec: ServiceSpec
    ) -> int | None:
        """The version whose live replicas version ``new`` keeps, relabelled
        (:func:`deploy.same_replicas`): the current one, else one whose replicas still serve
        (a rollback to it after an update that never got ready, or its file applied again):
        relaunching the same replicas would cost the fleet a restart (an LLM's model load)."""
        serving = {
            r.version
            for r in self.store.replicas(name)
            if r.ready and r.teardown_state is None and r.version != current
        }
        for version in [current, *sorted(serving, reverse=True)]:
            row = self.store.version(name, version)
            spec = self.controller(name).spec(version)
            if row is not None and deploy.same_replicas(
                self.home, name, (version, row.base_dir, spec), (new, base_dir, new_spec)
            ):
                return version
        return None

    async def _check_off_loop(
        self,
        spec_text: str,
        source: str | None,
        name: str | None,
        base_dir: str | None,
        envs: Mapping[str, str],
    ) -> ServiceSpec:
        """:func:`corral.admission.check_spec` on a thread: the largest spec the parser accepts
        takes up to a second to read, and the event loop it would block also carries every
        balancer's traffic."""
        return await asyncio.to_thread(
            admission.check_spec,
            spec_text,
            source=source,
            name=name,
            infras=self.deps.infras,
            capacity=self.deps.capacity,
            base_dir=base_dir,
            envs=envs,
        )

    def controller(self, name: str) -> ServiceController:
        try:
            validate_name(name)
        except SpecError as exc:
            raise InvalidRequest(f"bad service name {name!r}: {exc.issues[0].message}") from None
        controller = self.controllers.get(name)
        if controller is None:
            raise NoSuchService(f"no service named {name!r}")
        return controller

    def down(self, name: str, *, purge: bool) -> dict[str, Any]:
        """Take the service down: asked again (a re-sent `down`), it keeps what was asked
        (:meth:`Store.mark_down`), and answers as the first time."""
        controller = self.controller(name)
        try:
            self.store.mark_down(name, purge=purge)
        except KeyError:  # its row is gone: the service finished `down` a moment ago
            raise NoSuchService(f"no service named {name!r}") from None
        controller.wake()
        return controller.snapshot()

    def terminate_replica(self, name: str, seq: int, *, purge: bool) -> str:
        """``corral down NAME --replica-id N`` (see ServiceController.terminate_replica)."""
        controller = self.controller(name)
        svc = self.store.service(name)
        if svc is None or svc.intent == "shutting_down":
            raise ServiceShuttingDown(f"service {name!r} is shutting down")
        return controller.terminate_replica(seq, purge=purge)

    # -- what the API shows ---------------------------------------------------------------------

    def service(self, name: str) -> dict[str, Any]:
        controller = self.controller(name)
        try:
            return controller.snapshot()
        except KeyError:  # its row is gone: the service finished `down` a moment ago
            raise NoSuchService(f"no service named {name!r}") from None

    def has_service(self, name: str) -> bool:
        return name in self.controllers

    def events(self, name: str, after: int) -> list[dict[str, Any]]:
        """The service's events after id ``after``, each naming its replica by the id status
        shows (``replica_id``, and ``replica`` as before; the internal key stays inside)."""
        self.controller(name)
        return [e.__dict__ for e in self.recent_events(name, limit=200, after=after)]

    def describe(self) -> dict[str, Any]:
        capacity = self.deps.capacity
        return {
            "home": str(self.home),
            "started_at": self.started_at,
            "services": len(self.controllers),
            "jobs": self.deps.pool.stats(),
            "balancer_workers": self.deps.dataplane.workers(),
            "confinement": self.confinement,
            "inventory": capacity.view() if capacity is not None else None,
        }

    def metrics(self) -> bytes:
        """Prometheus text: every service's balancer (requests, errors, latency, in-flight
        per replica, retries) summed over the balancer workers' latest reports, and the
        machine's devices (corral_gpu_held / corral_gpu_free). A series' ``replica`` label is
        the replica's id within its service (what `status`, logs, events and `down
        --replica-id` say), not the internal key the balancers count by."""
        body = render(keyed_by_replica_id(self.balancer_stats(), self.store.replicas()))
        if self.deps.capacity is not None:
            body += self.deps.capacity.metrics()
        return body

    def balancer_stats(self) -> dict[str, dict[str, Any]]:
        """Every service's balancer counters, summed over the workers' latest reports."""
        return self.deps.dataplane.stats()

    def recent_events(self, name: str, limit: int, after: int = 0) -> list[EventRow]:
        """The service's last events as users see them: ``replica_id`` is the replica's id
        within the service (what status, logs and the dashboard show)."""
        rows = self.store.events(name, after=after, limit=limit)
        return [replace(e, replica_id=e.replica) for e in rows]

    def current_version(self, name: str) -> tuple[ServiceSpec, VersionRow]:
        """The spec and row of the version the service runs, while it is not going away."""
        controller = self.controller(name)
        svc = self._live_row(name)
        row = self.store.version(name, svc.current_version)
        if row is None:  # never seen: a service's rows go together
            raise Conflict(f"service {name!r} has no version {svc.current_version}")
        return controller.spec(svc.current_version), row

    def request_stop(self, *, workers: bool) -> bool:
        """Stop the daemon; with ``workers``, or when no service is left, the balancer workers
        too (else they keep serving every service). Returns whether the workers will stop."""
        # With no service left the workers have nothing to serve: they go too, or they would
        # idle on until the home is deleted.
        idle = not self.controllers
        self.stop_workers = self.stop_workers or workers or idle
        self.stop_requested.set()
        return self.stop_workers

    async def restart_workers(self) -> Any:
        """Each balancer worker replaced by a new process, new one first (an upgrade of corral
        reaches the data plane this way, with no moment where a port has no listener)."""
        return await self.deps.dataplane.restart_workers()

    def log_finished(self, name: str, replica: int | None) -> bool:
        """A followed log ends when what writes it is gone: the service, or the replica
        ``replica`` (its id within the service; removed, or torn down: a failed replica stays
        listed but nothing writes its logs)."""
        if name not in self.controllers:
            return True
        if replica is None:
            return False
        row = self.store.replica_by_seq(name, replica)
        return row is None or row.teardown_state == "succeeded"

    def services(self) -> list[dict[str, Any]]:
        out = []
        for controller in list(self.controllers.values()):
            with contextlib.suppress(KeyError):
                out.append(controller.snapshot())
        return out

    def log_path(self, name: str, kind: str, replica: int | None) -> Path:
        """A log of service ``name``; ``replica`` is the id users see (its number within the
        service), which also names its files."""
        controller = self.controller(name)
        if kind == "controller":
            return controller.logs / "controller.log"
        if replica is None:
            raise InvalidRequest(f"log kind {kind!r} needs a replica id")
        if kind == "launch":
            path = controller.launch_log(replica)
        elif kind == "replica":
            path = controller.replica_log(replica)
        else:
            raise InvalidRequest(f"unknown log kind {kind!r}: use replica, launch or controller")
        if self.store.replica_by_seq(name, replica) is None and not path.exists():
            # Without this a followed log of a replica that never existed ends at once, empty,
            # and `corral logs NAME 999` exits 0 as if that were a log.
            raise NoSuchReplica(f"service {name!r} has no replica {replica}")
        return path
