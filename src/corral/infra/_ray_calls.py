"""Calls from the daemon to a Ray cluster that may stop answering: bounded, and one connection.

Split from :mod:`corral.infra.ray` (the backend) because this is the part that protects the
daemon from its cluster: every GCS call runs through :func:`_bounded`, and :func:`_connect` makes
the one Ray connection of the process with Ray's exit-on-GCS-loss disabled (see the backend's
module docstring for why). The remote code (the actor class, the stray reaper) is registered
here too, once per process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import ray
import ray.exceptions

from corral import capture
from corral.infra import _ray_actor

T = TypeVar("T")

# Calls to the cluster left hanging (GCS gone) before new ones fail at once instead of piling up.
_MAX_HANGING = 8
# The driver gives up on the GCS (and, by Ray's default, exits the process) after this long.
_RECONNECT_ENV = (
    "RAY_gcs_rpc_server_reconnect_timeout_s"  # Ray's spelling: system config, lowercase
)
_RECONNECT_TIMEOUT_S = str(10 * 365 * 24 * 3600)


# Ray >= 2.9 is supported; the finer exceptions came later (RayActorError was their parent).
_ACTOR_DIED: type[BaseException] = getattr(
    ray.exceptions, "ActorDiedError", ray.exceptions.RayActorError
)
# An actor that cannot answer right now (its worker is restarting or unreachable): ask again.
_TRANSIENT: tuple[type[BaseException], ...] = (
    ray.exceptions.GetTimeoutError,
    *[getattr(ray.exceptions, n) for n in ["ActorUnavailableError"] if hasattr(ray.exceptions, n)],
)


class RayUnreachable(RuntimeError):
    """The Ray cluster did not answer in time."""


# -- bounded calls --------------------------------------------------------------------------------

_hanging = threading.BoundedSemaphore(_MAX_HANGING)
_overdue_lock = threading.Lock()
_overdue = 0  # calls still running after their caller gave up on them


def _bounded(what: str, timeout: float, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on a helper thread, waited for at most ``timeout`` s.

    Raises :class:`RayUnreachable` on timeout (the call goes on in the background and its result
    is dropped). While such an overdue call still hangs, or ``_MAX_HANGING`` calls run, new calls
    fail at once: a dead GCS costs one timeout and a few threads, not a timeout per replica (the
    controller checks every replica at start, on its event loop) nor a growing pile of threads.
    """
    global _overdue
    if _overdue:
        raise RayUnreachable(f"{what}: an earlier call to the Ray cluster still has no answer")
    if not _hanging.acquire(blocking=False):
        raise RayUnreachable(f"{what}: {_MAX_HANGING} earlier calls to the cluster still hang")
    box: dict[str, Any] = {}
    done = threading.Event()
    gave_up = threading.Event()

    def run() -> None:
        global _overdue
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:
            box["error"] = exc
        finally:
            with _overdue_lock:
                done.set()
                if gave_up.is_set():
                    _overdue -= 1
            _hanging.release()

    # In its caller's route: what Ray prints during a launch or teardown goes to that log.
    capture.Thread(target=run, name=f"corral-ray-{what}", daemon=True).start()
    if not done.wait(timeout):
        with _overdue_lock:
            if not done.is_set():
                gave_up.set()
                _overdue += 1
        if gave_up.is_set():
            raise RayUnreachable(f"{what}: the Ray cluster did not answer within {timeout:g}s")
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value


# -- connection -----------------------------------------------------------------------------------

_connect_lock = threading.Lock()
_connected: set[str] = set()  # the address of this process's one Ray connection


def _gcs_host_port(address: str) -> tuple[str, int] | None:
    """``host:port`` of a GCS (or Ray Client) address, None for ``auto`` and the like."""
    rest = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


class _QuietSigtermWarning(logging.Filter):
    """Drops Ray's "SIGTERM handler is not set" warning: ray.init runs on a helper thread (so it
    can be given up on), and the daemon handles SIGTERM itself; the warning would only alarm."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


@contextlib.contextmanager
def _driver_outlives_gcs() -> Iterator[None]:
    """Ray's GCS reconnect timeout set for one ``ray.init`` (it reads it once, at init), and
    put back after: the daemon's driver never exits because its cluster went away."""
    saved = os.environ.get(_RECONNECT_ENV)
    os.environ[_RECONNECT_ENV] = _RECONNECT_TIMEOUT_S
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(_RECONNECT_ENV, None)
        else:
            os.environ[_RECONNECT_ENV] = saved


def _reset() -> None:
    """After a failed ``ray.init``: Ray may be half set up, and the daemon tries again."""
    with contextlib.suppress(Exception):
        ray.shutdown()


def _connect(address: str, namespace: str, timeout: float) -> None:
    """Connect this process to the cluster once (Ray allows one connection per process), within
    ``timeout`` s, or raise RuntimeError saying why."""
    with _connect_lock:
        if ray.is_initialized():
            # Every call names its namespace, so one connection serves any number of them.
            if address in _connected:
                return
            raise RuntimeError(
                f"this process is already connected to a Ray cluster "
                f"({', '.join(_connected) or 'unknown'}); cannot also connect to {address}"
            )
        if address in ("local", ""):
            raise RuntimeError(
                "RAY_ADDRESS=local would start a private Ray cluster inside the daemon; "
                "point corral at a running cluster (host:port of its GCS, or 'auto')"
            )
        target = _gcs_host_port(address)
        deadline = time.monotonic() + timeout
        if target is not None:
            # A plain TCP probe first: a closed port or a silent host fails here in seconds
            # with a readable error, where ray.init would retry for a minute.
            try:
                with socket.create_connection(target, timeout=min(timeout, 5.0)):
                    pass
            except OSError as exc:
                raise RuntimeError(
                    f"Ray cluster at {address} did not answer: {exc.strerror or exc}"
                ) from None
        kwargs: dict[str, Any] = {
            "address": address,
            "namespace": namespace,
            "ignore_reinit_error": True,
            "log_to_driver": False,
            "logging_level": logging.WARNING,
        }
        if target is not None and target[0] in ("127.0.0.1", "localhost", "::1"):
            # A cluster on loopback: register the driver there too, not on the machine's
            # external address, which the cluster's processes may not listen on.
            kwargs["_node_ip_address"] = "127.0.0.1"
        # The driver must survive its cluster (see the module docstring). Read once, at init.
        logging.getLogger("ray._private.worker").addFilter(_QuietSigtermWarning())
        try:
            with _driver_outlives_gcs():
                _bounded("connect", max(0.1, deadline - time.monotonic()), ray.init, **kwargs)
        except RayUnreachable:
            raise RuntimeError(
                f"Ray cluster at {address} did not answer within {timeout:g}s"
            ) from None
        except Exception as exc:
            _reset()
            raise RuntimeError(f"cannot connect to the Ray cluster at {address}: {exc}") from exc
        _connected.clear()
        _connected.add(address)


_actor_class_lock = threading.Lock()
_actor_class: Any = None
_reaper: Any = None


def _remote_code() -> tuple[Any, Any]:
    """The actor class and the stray-reaper task, shipped by value (see _ray_actor's docstring)."""
    global _actor_class, _reaper
    with _actor_class_lock:
        if _actor_class is None:
            import ray.cloudpickle

            pickler: Any = ray.cloudpickle  # untyped
            pickler.register_pickle_by_value(_ray_actor)
            _actor_class = ray.remote(_ray_actor.ReplicaActor)
            _reaper = ray.remote(num_cpus=0, max_retries=0)(_ray_actor.reap_strays)
        return _actor_class, _reaper
