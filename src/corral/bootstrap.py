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
from aiohttp import web

from corral import capture, logfiles
from corral.api import make_runner
from corral.backup import BACKUP_INTERVAL, StateFileRefused, check_state_file
from corral.capacity import Capacity
from corral.controller import (
    LAUNCHES_PER_SERVICE,
    ControllerDeps,
    handle_from_row,
)
from corral.daemon import Daemon
from corral.dataplane.plane import DEFAULT_WORKERS, DataPlane
from corral.dataplane.protocol import STOPPED_MARKER
from corral.home import ensure_token, is_loopback, read_info
from corral.infra.base import Infra, ReplicaHandle
from corral.infra.inventory import InventoryError, load_inventory
from corral.infra.local import LocalInfra, replica_key
from corral.jobs import JobPool
from corral.limits import raise_open_files, undumpable
from corral.state import StateError, Store

log = logging.getLogger("corral.daemon")


class DaemonError(RuntimeError):
    """The daemon cannot start (another one runs, the home is unusable)."""


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
    ``ssl_context`` (see :func:`server_tls_context`) makes the API speak HTTPS, required for a
    ``host`` that is not loopback (the token would cross the network in clear); ``tls_cert``,
    its certificate file, goes in ``daemon.json`` so a client here can verify exactly it."""
    lock, token = _open_home(home, host, tls=ssl_context is not None)
    home_marker = _home_id(home)
    try:
        inventory = await asyncio.to_thread(load_inventory)
    except InventoryError as exc:
        lock.close()
        raise DaemonError(str(exc)) from None
    log.info("inventory: %s", inventory.describe())
    store = Store(home / "state.db")
    pool = JobPool(max_workers=8, limits={"launch": 16, "teardown": 16})
    infras = dict(infras) if infras is not None else _default_backends()
    confinement = await _prepare_backends(home, home_marker, infras, store)
    dataplane = await _start_dataplane(home, store)
    async with _probe_session() as http:
        deps = _controller_deps(
            store=store,
            pool=pool,
            infras=infras,
            home=home,
            home_marker=home_marker,
            http=http,
            dataplane=dataplane,
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
        runner = make_runner(daemon, token)
        await runner.setup()
        try:
            await _serve_api(runner, home, host, port, ssl_context, tls_cert)
            await daemon.stop_requested.wait()
            # On purpose (a signal or `corral daemon stop`): the workers must not restart it.
            with contextlib.suppress(OSError):
                (home / STOPPED_MARKER).write_text(f"{time.time()}\n")
        finally:
            await _shut_down(daemon, runner, backups)
            lock.close()


async def _prepare_backends(
    home: Path, home_marker: str, infras: Mapping[str, Infra], store: Store
) -> dict[str, Any]:
    """Before any controller runs: the local sandbox tried (its verdict is returned, for
    ``/v1/daemon``), leftovers of a killed daemon swept, the state file backed up."""
    local = infras.get("local")
    confinement: dict[str, Any] = {"confined": False, "detail": "no local backend"}
    if isinstance(local, LocalInfra):
        confinement = await asyncio.to_thread(_guard_local, local, home, home_marker)
    _sweep(home_marker, infras, store)
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
) -> ControllerDeps:
    """What every controller shares, with the knobs the daemon's environment may set (tests
    shorten them)."""
    return ControllerDeps(
        store=store,
        pool=pool,
        infras=infras,
        home=home,
        home_marker=home_marker,
        http=http,
        dataplane=dataplane,
        capacity=capacity,
        decision_interval=_env_float("CORRAL_DECISION_INTERVAL", 5.0),
        qps_window=_env_float("CORRAL_QPS_WINDOW", 60.0),
        teardown_timeout=_env_float("CORRAL_TEARDOWN_TIMEOUT", 120.0),
        log_max_bytes=_env_bytes("CORRAL_LOG_MAX_BYTES"),
        launches_per_service=_env_count("CORRAL_LAUNCHES_PER_SERVICE", LAUNCHES_PER_SERVICE),
    )


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


async def _start_dataplane(home: Path, store: Store) -> DataPlane:
    """Adopt the running balancer workers, or start them; a port one cannot bind becomes an
    event of its service."""
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


async def _shut_down(daemon: Daemon, runner: web.AppRunner, backups: asyncio.Task[None]) -> None:
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
    with contextlib.suppress(FileNotFoundError):
        (home / "daemon.json").unlink()
    await runner.cleanup()
    backups.cancel()
    await daemon.stop_controllers()
    await deps.dataplane.stop(workers=daemon.stop_workers)
    _backup(deps.store, home)
    local = deps.infras.get("local")
    if isinstance(local, LocalInfra):
        local.release(deps.home_marker)
    await asyncio.to_thread(deps.pool.shutdown, timeout=15.0)
    deps.store.close()
