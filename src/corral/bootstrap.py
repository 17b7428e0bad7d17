"""The daemon process: what `corral daemon run` does before and around the control plane.

Why a module of its own: it is the top of the house. It takes the home's lock, checks the state
file, reads the machine's inventory, builds the backends, sweeps what a crashed daemon left,
starts or adopts the balancer workers, builds :class:`~corral.daemon.Daemon` and then the HTTP
API (:mod:`corral.api`) over it, and writes ``daemon.json`` once the API listens. The daemon and
the API below it never import this module, so the layers point one way: bootstrap -> api ->
daemon -> controller.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from aiohttp import web

from corral import capture, daemon_port, ownership
from corral.api import make_runner
from corral.backup import BACKUP_INTERVAL, StateFileRefused, check_state_file
from corral.capacity import Capacity
from corral.controller import (
    LAUNCHES_PER_SERVICE,
    ControllerDeps,
    handle_from_row,
)
from corral.daemon import Daemon
from corral.daemon_env import (
    DaemonError,
    check_read_elsewhere,
    env_bytes,
    env_count,
    env_seconds,
)
from corral.dataplane.locks import take_daemon_lock
from corral.dataplane.plane import DEFAULT_WORKERS, DataPlane
from corral.dataplane.protocol import STOPPED_MARKER
from corral.home import ensure_token, is_loopback, read_info
from corral.infra._ray_link import RayLink, ray_installed
from corral.infra.base import EndsHome, Infra, ReplicaHandle, leave_scratch
from corral.infra.inventory import Inventory, InventoryError, load_inventory
from corral.infra.local import LocalInfra, replica_key
from corral.infra.local_scan import end_home
from corral.jobs import JobPool
from corral.limits import raise_open_files, undumpable
from corral.logcap import cap_home_logs
from corral.state import StateError, Store

# DaemonError is re-exported: the CLI and the tests catch it from here.
__all__ = ["DaemonError", "DaemonRunning", "serve", "server_tls_context"]

log = logging.getLogger("corral.daemon")


class DaemonRunning(DaemonError):
    """Another daemon holds the home's lock (it may still be starting)."""


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


def _home_gone(daemon: Daemon, reason: str) -> None:
    """Its home is gone: stop, and take the replicas and workers along (see _shut_down)."""
    log.warning("%s: ending its replicas and balancer workers, then stopping", reason)
    daemon.home_lost = reason
    daemon.stop_workers = True
    daemon.stop_requested.set()


def _lock(home: Path) -> IO[str]:
    f = take_daemon_lock(home)  # held for the daemon's life
    if f is None:
        info = read_info(home)
        pid = info.get("pid") if info else "?"
        raise DaemonRunning(f"another corral daemon (pid {pid}) already runs on {home}") from None
    return f


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

    Ray: set ``RAY_ADDRESS`` (or ``CORRAL_RAY_ADDRESS``, which wins) and install Ray
    (``pip install -e '.[ray]'``). It connects in the background (:mod:`corral.infra._ray_link`):
    the API answers meanwhile and replicas on Ray wait, the reason shown (a cluster that does not
    answer too, and the log says so). Without Ray installed, a spec on Ray gets a 400 at ``up``.
    """
    address = os.environ.get("CORRAL_RAY_ADDRESS") or os.environ.get("RAY_ADDRESS")
    if not address:
        return {}
    if not ray_installed():
        hint = "in corral's checkout: pip install -e '.[ray]'"  # not on PyPI: not corral[ray]
        log.error(f"RAY_ADDRESS is set but Ray is missing ({hint})")
        return {}
    return {"ray": RayLink(address)}


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
    ``ssl_context`` (see :func:`server_tls_context`) makes the API speak HTTPS, required for a
    ``host`` that is not loopback (the token would cross the network in clear); ``tls_cert``,
    its certificate file, goes in ``daemon.json`` so a client here can verify exactly it."""
    knobs = _knobs()  # first: a bad setting stops the daemon before it touches anything
    lock, token = _open_home(home, host, tls=ssl_context is not None)
    home_marker = _home_id(home)
    inventory = await _inventory(lock)
    store = Store(home / "state.db")
    watch = ownership.own(home, home_marker)
    pool = JobPool(max_workers=8, limits={"launch": 16, "teardown": 16})
    infras = dict(infras) if infras is not None else _default_backends()
    capacity = Capacity(store, inventory)
    confinement = await _prepare_backends(home, home_marker, infras, store, capacity)
    dataplane = await _start_dataplane(home, store, knobs.pop("workers"))
    async with _probe_session() as http:
        deps = _controller_deps(
            store=store,
            pool=pool,
            infras=infras,
            home=home,
            home_marker=home_marker,
            http=http,
            dataplane=dataplane,
            capacity=capacity,
            knobs=knobs,
        )
        daemon = Daemon(home, store, deps)
        daemon.confinement = confinement
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, daemon.stop_requested.set)
        await daemon.start_controllers()
        chores = [
            asyncio.create_task(_backup_loop(store, home), name="corral-backup"),
            asyncio.create_task(
                ownership.watch(watch, lambda why: _home_gone(daemon, why)), name="corral-home"
            ),
            asyncio.create_task(cap_home_logs(home, deps.log_max_bytes), name="corral-logcap"),
        ]
        dataplane.open()  # the re-adopted ready sets go to the workers in one table
        runner = make_runner(daemon, token)
        await runner.setup()
        try:
            await _serve_api(runner, home, host, port, ssl_context, tls_cert)
            await _until_stopped(daemon, home)
        finally:
            await _shut_down(daemon, runner, chores)
            lock.close()


async def _inventory(lock: IO[str]) -> Inventory:
    """The machine's GPUs, CPUs and memory (NVML or a declared file, off the loop); a bad one
    stops the daemon before anything runs."""
    try:
        inventory = await asyncio.to_thread(load_inventory)
    except InventoryError as exc:
        lock.close()
        raise DaemonError(str(exc)) from None
    log.info("inventory: %s", inventory.describe())
    return inventory


async def _until_stopped(daemon: Daemon, home: Path) -> None:
    await daemon.stop_requested.wait()
    # On purpose (a signal or `corral daemon stop`): the workers must not restart it. (Not
    # into a home that is gone: the path may be another home's now.)
    if daemon.home_lost is None:
        with contextlib.suppress(OSError):
            (home / STOPPED_MARKER).write_text(f"{time.time()}\n")


async def _prepare_backends(
    home: Path, home_marker: str, infras: Mapping[str, Infra], store: Store, capacity: Capacity
) -> dict[str, Any]:
    """Before any controller runs: a cluster's connection started in the background (swept
    once connected, before it may launch; then every controller looks again), the local
    sandbox tried meanwhile (its verdict is returned, for ``/v1/daemon``), leftovers of a
    killed daemon swept, the state file backed up."""
    loop = asyncio.get_running_loop()
    for link in infras.values():
        if isinstance(link, RayLink):
            link.start(
                on_connected=lambda infra: _sweep(home_marker, {infra.name: infra}, store),
                on_ready=lambda: loop.call_soon_threadsafe(capacity.freed),
            )
    local = infras.get("local")
    confinement: dict[str, Any] = {"confined": False, "detail": "no local backend"}
    if isinstance(local, LocalInfra):
        confinement = await asyncio.to_thread(_guard_local, local, home, home_marker)
    _sweep(home_marker, {n: i for n, i in infras.items() if not isinstance(i, RayLink)}, store)
    _backup(store, home)
    return confinement


def _default_backends() -> dict[str, Infra]:
    """Local processes always; a cluster backend when this daemon is configured for one."""
    return {"local": LocalInfra(), **_cluster_backends()}


def _controller_deps(
    *,
    store: Store,
    pool: JobPool,
    infras: dict[str, Infra],
    home: Path,
    home_marker: str,
    http: aiohttp.ClientSession,
    dataplane: DataPlane,
    capacity: Capacity,
    knobs: dict[str, Any],
) -> ControllerDeps:
    """What every controller shares, with the knobs the daemon's environment set (``_knobs``)."""
    return ControllerDeps(
        store=store,
        pool=pool,
        infras=infras,
        home=home,
        home_marker=home_marker,
        http=http,
        dataplane=dataplane,
        capacity=capacity,
        **knobs,
    )


def _knobs() -> dict[str, Any]:
    """Every setting of the daemon's environment (tests shorten them), read first: a bad one
    stops the daemon, named, before it takes the home or starts a balancer worker (which would
    outlive it). ``workers`` is the data plane's; the rest are ``ControllerDeps`` fields."""
    check_read_elsewhere()
    return {
        "decision_interval": env_seconds("CORRAL_DECISION_INTERVAL", 5.0),
        "qps_window": env_seconds("CORRAL_QPS_WINDOW", 60.0),
        "teardown_timeout": env_seconds("CORRAL_TEARDOWN_TIMEOUT", 120.0),
        "log_max_bytes": env_bytes("CORRAL_LOG_MAX_BYTES"),
        "launches_per_service": env_count("CORRAL_LAUNCHES_PER_SERVICE", LAUNCHES_PER_SERVICE),
        "workers": env_count("CORRAL_BALANCER_WORKERS", DEFAULT_WORKERS),
    }


def _probe_session() -> aiohttp.ClientSession:
    """The probes' HTTP session. No pool cap: aiohttp's default of 100 connections let one
    service with 100+ slow probes starve every other service's; each controller caps its own
    (PROBES_PER_SERVICE) instead."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    return aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))


def _open_home(home: Path, host: str, *, tls: bool) -> tuple[IO[str], str]:
    """Take the home: its lock, a state file that is corral's, the process's limits, the
    token. Returns the lock, held for the daemon's life, and the token."""
    if not is_loopback(host) and not tls:
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
    with contextlib.suppress(FileNotFoundError):
        (home / STOPPED_MARKER).unlink()
    token, notes = ensure_token(home)
    for note in notes:
        log.warning("API token: %s", note)
    return lock, token


async def _start_dataplane(home: Path, store: Store, workers: int) -> DataPlane:
    """Adopt the running balancer workers, or start ``workers`` of them; a port one cannot bind
    becomes an event of its service."""
    dataplane = DataPlane(home, store, workers=workers, respawn=_respawn_command())

    def bind_failed(name: str, text: str) -> None:
        log.error("service %s: %s", name, text)
        with contextlib.suppress(Exception):
            store.event(name, "balancer.bind_failed", text)

    dataplane.on_bind_error = bind_failed
    await dataplane.start()
    return dataplane


async def _serve_api(
    runner: web.AppRunner,
    home: Path,
    host: str,
    port: int,
    ssl_context: ssl.SSLContext | None,
    tls_cert: Path | None,
) -> None:
    """Listen, then say where in ``daemon.json`` (written whole, then renamed into place, so a
    client never reads half of it)."""
    actual, moved = await daemon_port.listen(runner, home, host, port, ssl_context)
    info = {
        "pid": os.getpid(),
        "host": host,
        "port": actual,
        "scheme": "https" if ssl_context is not None else "http",
        "tls_cert": str(tls_cert) if ssl_context is not None and tls_cert else None,
        "started_at": time.time(),
        "port_moved": moved,  # the remembered port was taken: why, and where it went
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


def _end_home_elsewhere(infras: Mapping[str, Infra], home_marker: str) -> list[str]:
    """A gone home's replicas that no local scan reaches (a Ray cluster's detached actors):
    this daemon is the last one that can find them."""
    lines: list[str] = []
    for infra in infras.values():
        if isinstance(infra, EndsHome):
            try:
                lines.extend(infra.end_home(home_marker, 5.0))
            except Exception as exc:
                lines.append(f"ending its replicas on {infra.name} failed: {exc!r}")
    return lines


async def _shut_down(
    daemon: Daemon, runner: web.AppRunner, chores: list[asyncio.Task[None]]
) -> None:
    """The API first (no new requests), then the controllers, then the data plane: unless
    asked, its workers keep serving for the next daemon. Then the jobs still running get up
    to 15 s, and the state file is closed."""
    deps = daemon.deps
    home = deps.home
    if daemon.stop_workers:
        log.info("corral daemon stopping, balancer workers too")
    else:
        log.info(
            "corral daemon stopping: balancer workers keep serving, replicas keep "
            "running; the next daemon adopts both"
        )
    lost = daemon.home_lost is not None
    if not lost:  # a home that is gone may be another home's directory now: touch nothing
        with contextlib.suppress(FileNotFoundError):
            (home / "daemon.json").unlink()
    await runner.cleanup()
    for chore in chores:  # the backup loop, the home's watch, the log cap
        chore.cancel()
    await daemon.stop_controllers()
    await deps.dataplane.stop(workers=daemon.stop_workers)
    if lost:
        # Nothing will ever adopt them: ended as a teardown ends them.
        for line in await asyncio.to_thread(end_home, deps.home_marker, 5.0):
            log.warning("home gone: %s", line)
        for line in await asyncio.to_thread(_end_home_elsewhere, deps.infras, deps.home_marker):
            log.warning("home gone: %s", line)
        ownership.unregister(deps.home_marker)
    else:
        _backup(deps.store, home)
    local = deps.infras.get("local")
    if isinstance(local, LocalInfra):
        local.release(deps.home_marker)
    await asyncio.to_thread(leave_scratch, deps.home_marker, lost)
    await asyncio.to_thread(deps.pool.shutdown, timeout=15.0)
    deps.store.close()
