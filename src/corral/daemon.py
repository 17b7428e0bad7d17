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
import errno
import fcntl
import json
import logging
import os
import secrets
import signal
import ssl
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import aiohttp

from corral import capture, deploy, logfiles, versionfiles
from corral.backup import BACKUP_INTERVAL, StateFileRefused, check_state_file
from corral.capacity import Capacity, fit_problem
from corral.controller import (
    LAUNCHES_PER_SERVICE,
    ControllerDeps,
    ReplicaRefused,
    ServiceController,
    free_port,
    handle_from_row,
)
from corral.dataplane.plane import DEFAULT_WORKERS, DataPlane
from corral.dataplane.protocol import STOPPED_MARKER
from corral.deploy import KEEP_VERSIONS
from corral.home import ensure_token, is_loopback, read_info
from corral.infra.base import Infra, ReplicaHandle
from corral.infra.inventory import InventoryError, load_inventory
from corral.infra.local import LocalInfra, replica_key
from corral.jobs import JobPool
from corral.limits import raise_open_files, undumpable
from corral.spec import (
    ServiceSpec,
    SpecError,
    local_port_problem,
    parse_spec,
    redact_secrets,
    validate_name,
)
from corral.state import StateError, Store

log = logging.getLogger("corral.daemon")


class DaemonError(RuntimeError):
    """The daemon cannot start (another one runs, the home is unusable)."""


class DaemonRunning(DaemonError):
    """Another daemon holds the home's lock (it may still be starting)."""


class RequestError(Exception):
    """A request the daemon refuses: carries the HTTP status and a message for the user."""

    def __init__(self, status: int, message: str, **details: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.details = details


def _spec_refused(exc: SpecError) -> RequestError:
    return RequestError(
        400,
        "invalid service spec",
        issues=[i.as_json() | {"loc": i.loc} for i in exc.issues],
        text=str(exc),
    )


def _check_inputs(
    spec: ServiceSpec,
    *,
    source: str | None,
    base_dir: str | None,
    envs: Mapping[str, str],
    secrets: Mapping[str, str],
) -> None:
    try:
        deploy.check(
            spec, source=source or "<request>", base_dir=base_dir, envs=envs, secrets=secrets
        )
    except SpecError as exc:
        raise _spec_refused(exc) from None


def server_tls_context(cert: Path, key: Path) -> ssl.SSLContext:
    """The API's TLS context from a PEM certificate (chain) and its key; TLS 1.2 at least.

    Raises :class:`DaemonError` saying which file is wrong, before anything listens.
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(certfile=str(cert), keyfile=str(key))
    except (OSError, ssl.SSLError) as exc:
        raise DaemonError(f"cannot use TLS certificate {cert} with key {key}: {exc}") from None
    return context


def _home_id(home: Path) -> str:
    path = home / "home_id"
    if not path.exists():
        path.write_text(secrets.token_hex(8) + "\n")
    return path.read_text().strip()


def _lock(home: Path) -> IO[str]:
    f = open(home / "daemon.lock", "a+")  # noqa: SIM115 - held for the daemon's life
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        info = read_info(home)
        pid = info.get("pid") if info else "?"
        raise DaemonRunning(f"another corral daemon (pid {pid}) already runs on {home}") from None
    return f


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
        self._deploy_locks: dict[str, asyncio.Lock] = {}

    async def start_controllers(self) -> None:
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
        spec = await self._check_off_loop(spec_text, source=source, name=name)
        assert spec.name is not None
        _check_inputs(spec, source=source, base_dir=base_dir, envs=envs, secrets=secrets)
        svc_name = spec.name
        stored_text = await asyncio.to_thread(redact_secrets, spec_text)
        # The controller keeps the spec as stored: secret values live only in the values file.
        stored = spec
        if spec.secrets:
            stored = await asyncio.to_thread(
                parse_spec, stored_text, source=source or "<request>", name=name
            )
        async with self._deploy_lock(svc_name):
            if svc_name in self.controllers or self.store.service(svc_name) is not None:
                raise RequestError(409, f"service {svc_name!r} already exists")
            # The version's files exist before its row does: a replica never finds them missing.
            await self._prepare(svc_name, 1, spec, base_dir, envs, secrets)
            try:
                self.store.create_service(
                    svc_name,
                    stored_text,
                    source=source,
                    base_dir=base_dir,
                    lb_port=free_port(),
                )
            except KeyError:
                raise RequestError(409, f"service {svc_name!r} already exists") from None
        controller = await self._start_controller(svc_name, stored)
        if controller.balancer is not None and not await controller.balancer.wait_serving():
            log.warning("service %s: not every balancer worker confirmed its port", spec.name)
        return controller.snapshot()

    async def update(
        self,
        name: str,
        spec_text: str | None,
        *,
        mode: str,
        source: str | None,
        base_dir: str | None,
        from_version: int | None,
        envs: Mapping[str, str] | None = None,
        secrets: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """Store a new version of a service and let its controller roll it out.

        ``from_version`` re-deploys a stored version's spec (a rollback) as a new version, so
        the history only grows and every rollout is in the event log; it reuses that
        version's files (workdir copy, values).
        """
        async with self._deploy_lock(name):
            return await self._update(
                name,
                spec_text,
                mode=mode,
                source=source,
                base_dir=base_dir,
                from_version=from_version,
                envs=envs or {},
                secrets=secrets or {},
            )

    async def _update(
        self,
        name: str,
        spec_text: str | None,
        *,
        mode: str,
        source: str | None,
        base_dir: str | None,
        from_version: int | None,
        envs: Mapping[str, str],
        secrets: Mapping[str, str],
    ) -> dict[str, Any]:
        controller = self.controller(name)
        svc = self.store.service(name)
        if svc is None or svc.intent == "shutting_down":
            raise RequestError(409, f"service {name!r} is shutting down")
        if mode not in ("rolling", "blue_green"):
            raise RequestError(400, f"mode must be rolling or blue_green, not {mode!r}")
        if from_version is not None:
            if spec_text is not None:
                raise RequestError(400, "give either a spec or a version to roll back to, not both")
            old = self.store.version(name, from_version)
            if old is None:
                raise RequestError(404, f"service {name!r} has no version {from_version}")
            if envs or secrets:
                raise RequestError(400, "a rollback reuses the version's values: no envs/secrets")
            spec_text, source, base_dir = old.spec_yaml, old.source, old.base_dir
        if spec_text is None:
            raise RequestError(400, "field 'spec' (the service YAML) or 'from_version' is required")
        spec = await self._check_off_loop(spec_text, source=source, name=name)
        if from_version is None:
            _check_inputs(spec, source=source, base_dir=base_dir, envs=envs, secrets=secrets)
        # The service may have been taken down or updated while the spec was being checked.
        svc = self.store.service(name)
        if svc is None or svc.intent == "shutting_down" or name not in self.controllers:
            raise RequestError(409, f"service {name!r} is shutting down")
        current = controller.spec(svc.current_version)
        if spec.infra != current.infra:
            raise RequestError(
                400,
                f"an update cannot move a service from infra "
                f"{current.infra!r} to {spec.infra!r}; bring up a new service",
            )
        self._check_blue_green_room(name, mode, spec)
        next_version = max(v.version for v in self.store.versions(name)) + 1
        if from_version is not None:
            await self._reuse_files(name, from_version, next_version)
        else:
            await self._prepare(name, next_version, spec, base_dir, envs, secrets)
        # Off the loop, as every parse: the largest spec takes up to a second to read.
        stored_text = await asyncio.to_thread(redact_secrets, spec_text)
        stored_spec = await asyncio.to_thread(
            parse_spec, stored_text, source=source or "<request>", name=name
        )
        same_replicas = self._same_replicas(
            name, svc.current_version, next_version, base_dir, current, stored_spec
        )
        svc = self.store.service(name)
        if svc is None or svc.intent == "shutting_down" or name not in self.controllers:
            raise RequestError(409, f"service {name!r} is shutting down")
        version = self.store.add_version(
            name, stored_text, source=source, base_dir=base_dir, mode=mode, adopt_live=same_replicas
        )
        if version != next_version:  # nothing else adds versions; never seen
            log.error("service %s: version %d stored as %d", name, next_version, version)
        await asyncio.to_thread(self._prune_files, name)
        controller.remember(version, stored_spec)  # secrets: only in the version's values
        controller.updated()
        return controller.snapshot()

    def _check_blue_green_room(self, name: str, mode: str, spec: ServiceSpec) -> None:
        """Refuse a blue-green update that could never switch: on a machine too full for the
        new version's first replicas beside the old ones (docs/gpus.md), they would wait for
        ever while the old ones wait for them. A rolling update replaces one at a time there."""
        capacity = self.deps.capacity
        if mode != "blue_green" or spec.infra != "local" or capacity is None:
            return
        policy = spec.service.replica_policy
        needed = max(1, policy.min_replicas)
        problem = capacity.room_beside(spec.resources.model_dump(exclude_none=True), needed)
        if problem:
            raise RequestError(
                409,
                f"a blue-green update of {name!r} needs room for {needed} replica(s) of the new "
                f"version beside the old ones, and this machine has none: {problem}. Use "
                "--mode rolling, which replaces one replica at a time on a full machine",
            )

    def _deploy_lock(self, name: str) -> asyncio.Lock:
        """One create/update of a service at a time: the next version's number is taken, and
        its directory made, before the version is stored."""
        return self._deploy_locks.setdefault(name, asyncio.Lock())

    async def _prepare(
        self,
        name: str,
        version: int,
        spec: ServiceSpec,
        base_dir: str | None,
        envs: Mapping[str, str],
        secrets: Mapping[str, str],
    ) -> None:
        try:
            files = await asyncio.to_thread(
                deploy.prepare,
                self.home,
                name,
                version,
                spec,
                base_dir=base_dir,
                envs=envs,
                secrets=secrets,
            )
        except OSError as exc:
            # The home's disk full or read-only is the daemon's trouble (retry later); anything
            # else (an unreadable file of the workdir) is the request's.
            home_trouble = {errno.ENOSPC: "disk is full", errno.EDQUOT: "disk is full"}
            home_trouble[errno.EROFS] = "home is read-only"
            trouble = home_trouble.get(exc.errno or 0)
            if trouble is not None:
                raise RequestError(
                    503,
                    f"service {name}: the version's files cannot be written: the {trouble} "
                    f"({exc}); nothing was changed, retry",
                ) from None
            raise RequestError(
                400, f"service {name}: cannot copy the workdir of version {version}: {exc}"
            ) from None
        if spec.workdir:
            log.info(
                "service %s: version %d: workdir copied (%d files, %d bytes)",
                name,
                version,
                files.files,
                files.bytes,
            )

    async def _reuse_files(self, name: str, old: int, new: int) -> None:
        """A rollback's files: version ``old``'s, shared."""
        cloned = await asyncio.to_thread(versionfiles.clone_version, self.home, name, old, new)
        if not cloned and versionfiles.has_files(self.home, name):
            raise RequestError(
                409,
                f"the files of version {old} were removed (the last {KEEP_VERSIONS} versions "
                "are kept): deploy it from its spec file with `corral update`",
            )

    def _same_replicas(
        self,
        name: str,
        current: int,
        new: int,
        base_dir: str | None,
        current_spec: ServiceSpec,
        new_spec: ServiceSpec,
    ) -> bool:
        """Whether version ``new`` differs from ``current`` only in the `service:` section
        (policy, probe): then the running replicas are kept, relabelled. The same files
        (workdir copy, env and secret values) are part of "the same"."""
        row = self.store.version(name, current)
        fingerprint = versionfiles.fingerprint
        return (
            row is not None
            and row.base_dir == base_dir
            and fingerprint(self.home, name, new) == fingerprint(self.home, name, current)
            and new_spec.model_dump(exclude={"service"})
            == current_spec.model_dump(exclude={"service"})
        )

    def _prune_files(self, name: str) -> None:
        """Drop the files of versions no replica runs and past the rollback window."""
        versions = [v.version for v in self.store.versions(name)]
        keep = set(versions[-KEEP_VERSIONS:]) | {r.version for r in self.store.replicas(name)}
        if versionfiles.prune_versions(self.home, name, keep):
            versionfiles.collect_garbage(self.home)

    async def _check_off_loop(
        self, spec_text: str, *, source: str | None, name: str | None
    ) -> ServiceSpec:
        """:meth:`_check` on a thread: the largest spec the parser accepts takes up to a second
        to read, and the event loop it would block also carries every balancer's traffic."""
        return await asyncio.to_thread(self._check, spec_text, source=source, name=name)

    def _check(self, spec_text: str, *, source: str | None, name: str | None) -> ServiceSpec:
        """Validate a spec as this daemon will run it (the API is the trust boundary)."""
        try:
            spec = parse_spec(spec_text, source=source or "<request>", name=name)
        except SpecError as exc:
            raise _spec_refused(exc) from None
        if not spec.name:
            raise RequestError(400, "the service needs a name: set `name:` in the spec or pass -n")
        if spec.infra not in self.deps.infras:
            raise RequestError(
                400,
                f"infra {spec.infra!r} is not available in this daemon "
                f"(available: {', '.join(sorted(self.deps.infras))})",
            )
        if spec.infra == "local":
            problem = local_port_problem(spec)
            capacity = self.deps.capacity
            if not problem and capacity is not None:
                resources = spec.resources.model_dump(exclude_none=True)
                problem = fit_problem(resources, capacity.inventory)
            if problem:
                raise RequestError(400, problem)
        return spec

    def controller(self, name: str) -> ServiceController:
        try:
            validate_name(name)
        except SpecError as exc:
            raise RequestError(400, f"bad service name {name!r}: {exc.issues[0].message}") from None
        controller = self.controllers.get(name)
        if controller is None:
            raise RequestError(404, f"no service named {name!r}")
        return controller

    def down(self, name: str, *, purge: bool) -> dict[str, Any]:
        controller = self.controller(name)
        self.store.update_service(name, intent="shutting_down", purge=int(purge))
        self.store.event(name, "service.down", "purge" if purge else None, actor="api")
        controller.wake()
        return controller.snapshot()

    def terminate_replica(self, name: str, seq: int, *, purge: bool) -> str:
        """``corral down NAME --replica-id N`` (see ServiceController.terminate_replica)."""
        controller = self.controller(name)
        svc = self.store.service(name)
        if svc is None or svc.intent == "shutting_down":
            raise RequestError(409, f"service {name!r} is shutting down")
        try:
            return controller.terminate_replica(seq, purge=purge)
        except ReplicaRefused as exc:
            raise RequestError(exc.status, exc.message) from None

    def replica_uid(self, name: str, seq: int) -> int:
        """The internal id of replica ``seq`` (its number within the service, as shown)."""
        self.controller(name)
        row = self.store.replica_by_seq(name, seq)
        if row is None:
            raise RequestError(404, f"service {name!r} has no replica {seq}")
        return row.id

    def services(self) -> list[dict[str, Any]]:
        out = []
        for controller in list(self.controllers.values()):
            with contextlib.suppress(KeyError):
                out.append(controller.snapshot())
        return out

    def log_path(self, name: str, kind: str, replica: int | None) -> Path:
        controller = self.controller(name)
        if kind == "controller":
            return controller.logs / "controller.log"
        if replica is None:
            raise RequestError(400, f"log kind {kind!r} needs a replica id")
        if kind == "launch":
            path = controller.launch_log(replica)
        elif kind == "replica":
            path = controller.replica_log(replica)
        else:
            raise RequestError(400, f"unknown log kind {kind!r}: use replica, launch or controller")
        row = self.store.replica(replica)
        if (row is None or row.service != name) and not path.exists():
            # Without this a followed log of a replica that never existed ends at once, empty,
            # and `corral logs NAME 999` exits 0 as if that were a log.
            raise RequestError(404, f"service {name!r} has no replica {replica}")
        return path


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        number = float(value)
    except ValueError:
        raise DaemonError(f"${name} must be a number of seconds, not {value!r}") from None
    if not 0 < number < 3600:
        raise DaemonError(f"${name} must be between 0 and 3600 seconds, not {number}")
    return number


def _env_bytes(name: str) -> int:
    """A size cap from the environment (``CORRAL_LOG_MAX_BYTES``: bytes, or 64M / 1G; 0 turns
    the cap off); a bad value stops the daemon with a message rather than run uncapped."""
    try:
        return logfiles.parse_max_bytes(os.environ.get(name))
    except ValueError as exc:
        raise DaemonError(f"${name}: {exc}") from None


def _env_count(name: str, default: int, top: int = 64) -> int:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        number = int(value)
    except ValueError:
        raise DaemonError(f"${name} must be a whole number, not {value!r}") from None
    if not 1 <= number <= top:
        raise DaemonError(f"${name} must be between 1 and {top}, not {number}")
    return number


def _respawn_command() -> dict[str, Any] | None:
    """How the balancer workers start this daemon again after a crash: this very command
    (``CORRAL_DAEMON_RESPAWN=0`` turns that off, e.g. under a supervisor of one's own)."""
    if os.environ.get("CORRAL_DAEMON_RESPAWN", "1") == "0":
        return None
    return {"argv": [sys.executable, *sys.orig_argv[1:]], "cwd": os.getcwd()}


def _backup(store: Store, home: Path) -> None:
    try:
        store.backup(home)
    except StateError as exc:
        log.warning("%s", exc)


async def _backup_loop(store: Store, home: Path) -> None:
    """The rolling backup: every BACKUP_INTERVAL seconds, when anything changed."""
    last = store.changes()
    while True:
        await asyncio.sleep(BACKUP_INTERVAL)
        now = store.changes()
        if now != last:
            await asyncio.to_thread(_backup, store, home)
            last = now


def _cluster_backends() -> dict[str, Infra]:
    """Backends for clusters the user pointed corral at (optional dependencies).

    Ray: set ``RAY_ADDRESS`` (or ``CORRAL_RAY_ADDRESS``, which wins) and install
    ``corral[ray]``. A cluster that does not answer is reported in the daemon log and the
    backend is left out: a spec asking for it then gets a clear 400 at ``corral up``.
    """
    address = os.environ.get("CORRAL_RAY_ADDRESS") or os.environ.get("RAY_ADDRESS")
    if not address:
        return {}
    try:
        from corral.infra.ray import RayInfra
    except ImportError as exc:
        log.error("RAY_ADDRESS is set but Ray is missing (pip install 'corral[ray]'): %s", exc)
        return {}
    try:
        return {"ray": RayInfra(address)}
    except Exception as exc:
        log.error("Ray cluster at %s is not usable: %s", address, exc)
        return {}


def _configure_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def _guard_local(local: LocalInfra, home: Path, home_marker: str) -> dict[str, Any]:
    """Set up what keeps local replicas in their place (a cgroup each, the sandbox away from
    the home), say loudly what this machine does not allow, and return the sandbox's state."""
    weak = local.containment(home_marker)
    if weak:
        log.warning(
            "replicas get no cgroup of their own (%s): teardown stops their process "
            "groups and every process carrying their replica key, but a process that "
            "leaves its group and clears its environment would survive it",
            weak,
        )
    detail = local.confine(home)
    if local.confinement is None:
        log.warning(
            "REPLICAS ARE NOT CONFINED (%s): any replica can read this home, its API token "
            "included, and so control every service",
            detail,
        )
    else:
        log.info("confinement: %s", detail)
    return {"confined": local.confinement is not None, "detail": detail}


def _sweep(home_marker: str, infras: Mapping[str, Infra], store: Store) -> None:
    known: dict[str, list[ReplicaHandle]] = {name: [] for name in infras}
    recorded: set[str] = set()
    for row in store.replicas():
        recorded.add(replica_key(home_marker, row.service, row.id))
        handle = handle_from_row(row)
        if handle is not None and handle.backend in known:
            known[handle.backend].append(handle)
    for name, infra in infras.items():
        try:
            killed = infra.sweep(home_marker, known[name], recorded)
        except Exception:
            log.exception("leak sweep of backend %s failed", name)
            continue
        for what in killed:
            if what.startswith("spared "):
                log.warning("leak sweep: %s", what)
            else:
                log.warning("leak sweep: killed %s (started but never recorded)", what)


async def serve(
    home: Path,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    infras: Mapping[str, Infra] | None = None,
    ssl_context: ssl.SSLContext | None = None,
    tls_cert: Path | None = None,
) -> None:
    """Run the daemon until SIGTERM/SIGINT or an API stop request.

    ``infras`` replaces the backends the daemon would build (local, plus Ray when configured):
    the seam through which the chaos tests run a real daemon over a backend that fails on cue.

    ``ssl_context`` (see :func:`server_tls_context`) makes the API speak HTTPS; it is required
    for any ``host`` that is not loopback, because the token would otherwise cross the network
    in clear. ``tls_cert`` is that context's certificate file, recorded in ``daemon.json`` so a
    client on this machine can verify the API against exactly it.
    """
    if not is_loopback(host) and ssl_context is None:
        raise DaemonError(
            f"refusing to serve the API on {host} (not loopback) without TLS: "
            "pass --tls-cert and --tls-key, or bind to 127.0.0.1"
        )
    home.mkdir(parents=True, exist_ok=True)
    home.chmod(0o700)
    capture.install()
    _configure_logging()
    lock = _lock(home)
    try:
        check_state_file(home)
    except StateFileRefused as exc:
        lock.close()
        raise DaemonError(str(exc)) from None
    soft, hard = raise_open_files()
    undumpable()
    log.info("open files: soft limit %d (hard %d)", soft, hard)
    if not is_loopback(host):
        log.warning(
            "API listening on %s (TLS): anyone who can reach it and has the token controls "
            "every service of this home and runs commands as this user",
            host,
        )
    token, notes = ensure_token(home)
    for note in notes:
        log.warning("API token: %s", note)
    home_marker = _home_id(home)
    with contextlib.suppress(FileNotFoundError):
        (home / STOPPED_MARKER).unlink()
    try:
        inventory = await asyncio.to_thread(load_inventory)
    except InventoryError as exc:
        lock.close()
        raise DaemonError(str(exc)) from None
    log.info("inventory: %s", inventory.describe())
    store = Store(home / "state.db")
    pool = JobPool(max_workers=8, limits={"launch": 16, "teardown": 16})
    if infras is None:
        infras = {"local": LocalInfra(), **_cluster_backends()}
    infras = dict(infras)
    local = infras.get("local")
    confinement = {"confined": False, "detail": "no local backend"}
    if isinstance(local, LocalInfra):
        confinement = await asyncio.to_thread(_guard_local, local, home, home_marker)
    _sweep(home_marker, infras, store)
    _backup(store, home)
    dataplane = DataPlane(
        home,
        store,
        workers=_env_count("CORRAL_BALANCER_WORKERS", DEFAULT_WORKERS),
        respawn=_respawn_command(),
    )

    def bind_failed(name: str, text: str) -> None:
        log.error("service %s: %s", name, text)
        with contextlib.suppress(Exception):
            store.event(name, "balancer.bind_failed", text)

    dataplane.on_bind_error = bind_failed
    await dataplane.start()
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    # No pool cap: aiohttp's default of 100 connections let one service with 100+ slow probes
    # starve every other service's; each controller caps its own (PROBES_PER_SERVICE) instead.
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        deps = ControllerDeps(
            store=store,
            pool=pool,
            infras=infras,
            home=home,
            home_marker=home_marker,
            http=http,
            dataplane=dataplane,
            decision_interval=_env_float("CORRAL_DECISION_INTERVAL", 5.0),
            qps_window=_env_float("CORRAL_QPS_WINDOW", 60.0),
            teardown_timeout=_env_float("CORRAL_TEARDOWN_TIMEOUT", 120.0),
            log_max_bytes=_env_bytes("CORRAL_LOG_MAX_BYTES"),
            launches_per_service=_env_count("CORRAL_LAUNCHES_PER_SERVICE", LAUNCHES_PER_SERVICE),
            capacity=Capacity(store, inventory),
        )
        daemon = Daemon(home, store, deps)
        daemon.confinement = confinement
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, daemon.stop_requested.set)
        await daemon.start_controllers()
        backups = asyncio.create_task(_backup_loop(store, home), name="corral-backup")
        dataplane.open()  # the re-adopted ready sets go to the workers in one table
        from aiohttp import web

        from corral.api import make_runner  # the API layer sits above the daemon

        runner = make_runner(daemon, token)
        await runner.setup()
        site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
        await site.start()
        actual = runner.addresses[0][1]
        info = {
            "pid": os.getpid(),
            "host": host,
            "port": actual,
            "scheme": "https" if ssl_context is not None else "http",
            "tls_cert": str(tls_cert) if ssl_context is not None and tls_cert else None,
            "started_at": time.time(),
        }
        tmp = home / "daemon.json.tmp"
        tmp.write_text(json.dumps(info))
        tmp.replace(home / "daemon.json")
        log.info(
            "corral daemon pid %d serving %s on %s://%s:%d",
            os.getpid(),
            home,
            info["scheme"],
            host,
            actual,
        )
        try:
            await daemon.stop_requested.wait()
            # On purpose (a signal or `corral daemon stop`): the workers must not restart it.
            with contextlib.suppress(OSError):
                (home / STOPPED_MARKER).write_text(f"{time.time()}\n")
        finally:
            if daemon.stop_workers:
                log.info("corral daemon stopping, balancer workers too")
            else:
                log.info(
                    "corral daemon stopping: balancer workers keep serving, replicas keep "
                    "running; the next daemon adopts both"
                )
            with contextlib.suppress(FileNotFoundError):
                (home / "daemon.json").unlink()
            await runner.cleanup()
            backups.cancel()
            await daemon.stop_controllers()
            await dataplane.stop(workers=daemon.stop_workers)
            _backup(store, home)
            if isinstance(local, LocalInfra):
                local.release(home_marker)
            await asyncio.to_thread(pool.shutdown, timeout=15.0)
            store.close()
            lock.close()
