"""Waiting for the daemon on a person's behalf (`up`, `update`, `down`): progress with the
time elapsed, and what Ctrl-C leaves running."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from corral import cliview
from corral.cli_common import client_error_text, fail, out, say, stuck_replicas
from corral.cli_nodaemon import await_respawn
from corral.client import Client, ClientError, DaemonUnreachable

FAILED_SERVICE = {"FAILED", "CONTROLLER_FAILED", "FAILED_CLEANUP"}
LIVE = {"PENDING", "PROVISIONING", "STARTING", "READY", "NOT_READY"}
# While waiting, a line saying what is awaited at least this often (seconds) when nothing changes.
PROGRESS_EVERY = 15.0
# How long a waiting command waits for the workers to bring a crashed daemon back (seconds):
# longer than a one-shot command's RESPAWN_WAIT, as the wait was asked for, and a daemon's
# start on a loaded machine takes more than 5 s.
RESPAWN_PATIENCE = 30.0

_fail = fail
_client_error_text = client_error_text


def keeps_running(client: Client, name: str, what: str) -> str:
    """What Ctrl-C left running (the service and the daemon) and how to stop it."""
    info = None
    with contextlib.suppress(ClientError, KeyboardInterrupt):
        info = client.request("GET", "/v1/daemon")
    daemon = f" (pid {info['pid']})" if isinstance(info, dict) and info.get("pid") else ""
    return (
        f"service {name} keeps running in the corral daemon{daemon}: {what}. "
        f"`corral status {name}` shows it; `corral down {name}` stops it"
        " (`corral daemon stop` stops only the daemon: services keep serving)."
    )


def _respawned(exc: ClientError, client: Client) -> bool:
    """Whether ``exc`` came from a daemon that crashed and that its workers have started
    again (waited for as `status` does): the waiting command asks again. Failing it instead
    told a script its deploy or teardown failed while the service went on."""
    return isinstance(exc, DaemonUnreachable) and await_respawn(client, say, RESPAWN_PATIENCE)


def _polled(
    client: Client, name: str, timeout: float | None, late: Callable[[dict[str, Any]], str]
) -> Iterator[dict[str, Any]]:
    """Service ``name`` as the daemon shows it, every 0.25 s, until the caller stops asking.
    A client error, or the deadline passing (``late`` says what was still awaited), ends the
    command with an error (not a daemon restarted meanwhile: :func:`_respawned`); the
    service itself keeps going either way."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            service = client.service(name)
        except ClientError as exc:
            # Asked again after a respawn, within the deadline and at the same pace: a daemon
            # that answers its health but not this request must not make the wait endless.
            if _respawned(exc, client) and (deadline is None or time.monotonic() <= deadline):
                time.sleep(0.25)
                continue
            if exc.status == 404:
                # This command created or updated it: someone (another shell, the dashboard)
                # took it down since; "no service named ..." alone read as a mistyped name.
                _fail(f"service {name!r} was taken down while this command waited for it")
            _fail(_client_error_text(exc))
        yield service
        if deadline is not None and time.monotonic() > deadline:
            _fail(late(service))
        time.sleep(0.25)


class _Progress:
    """Prints what changed while waiting, each line with the time since the wait began, and a
    line saying what is still awaited when nothing changed for PROGRESS_EVERY seconds."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.said = self.started
        self.seen: dict[int, str] = {}

    def stamp(self) -> str:
        return f"[{cliview.age(time.monotonic() - self.started):>4}]"

    def replicas(self, service: dict[str, Any]) -> None:
        changed = False
        for r in service["replicas"]:
            # A PENDING replica that does not fit says why (docs/gpus.md), once per reason.
            reason = r.get("failure") or r.get("waiting")
            if self.seen.get(r["id"]) != f"{r['status']} {reason}":
                self.seen[r["id"]] = f"{r['status']} {reason}"
                detail = f" ({reason})" if reason else ""
                out.print(
                    f"  {self.stamp()} replica {r['id']} (v{r['version']}): {r['status']}{detail}",
                    soft_wrap=True,
                )
                changed = True
        now = time.monotonic()
        if changed:
            self.said = now
        elif now - self.said >= PROGRESS_EVERY:
            self.said = now
            waiting = [
                f"replica {r['id']} {cliview.status_text(r)}"
                for r in service["replicas"]
                if r["status"] in LIVE and r["status"] != "READY"
            ]
            what = ", ".join(waiting) or service["status"]
            out.print(f"  {self.stamp()} still waiting: {what}", soft_wrap=True)


def wait_ready(client: Client, name: str, timeout: float | None) -> None:
    progress = _Progress()

    def late(service: dict[str, Any]) -> str:
        status = service["status"]
        return f"service {name} not READY after {timeout:g}s (status {status}); it keeps trying"

    for service in _polled(client, name, timeout, late):
        progress.replicas(service)
        status = service["status"]
        if status == "READY":
            out.print(
                f"[green]service {name} is READY[/green] at {service['endpoint']} "
                f"(after {cliview.age(time.monotonic() - progress.started)})",
                soft_wrap=True,
            )
            return
        if status == "NO_REPLICA" and service.get("target") == 0:
            out.print(zero_text(name, service), soft_wrap=True)
            return
        if status in FAILED_SERVICE:
            _fail(failed_text(name, service))


def zero_text(name: str, service: dict[str, Any]) -> str:
    """What `up` says of a service up with no replica: its steady state, not a step on the way
    to READY. Scale to zero (min_replicas: 0) waits for traffic; a fixed size of 0 serves
    nothing until an update gives it replicas, and must not promise one."""
    if (service.get("policy") or {}).get("max_replicas") == 0:
        return (
            f"[green]service {name} is up with no replica[/green] (replicas: 0): it answers "
            f"503 until `corral update {name} FILE` gives it replicas"
        )
    return (
        f"[green]service {name} is up with no replica[/green] (min_replicas: 0): "
        f"the first request to {service['endpoint']} starts one"
    )


def failed_text(name: str, service: dict[str, Any]) -> str:
    """Why ``corral up`` gave up on a failed service, from its API view."""
    failed = [r for r in service["replicas"] if r.get("failure")]
    hint = ""
    if failed and "corral logs" not in (service.get("failure") or ""):
        # The app's own output tells why it exited; the launch log, why it never started.
        last = failed[-1]
        launch = " --launch" if last["status"] == "FAILED_PROVISION" else ""
        hint = f"; see `corral logs {name} {last['id']}{launch}`"
    # A controller that runs while its workers cannot serve its port has no failure of its
    # own: what the workers said is the reason (it was an empty one).
    reason = service.get("failure") or "; ".join(service.get("balancer_errors") or ())
    return f"service {name} is {service['status']}: {reason}{hint}"


class _Swaps:
    """Says when a rolling update on a full machine retires an old replica before its
    successor starts (no spare capacity; docs/gpus.md): the event log has it, and it lasts too
    short a moment for a replica's status to show it."""

    def __init__(self, client: Client, name: str, version: int) -> None:
        self.client, self.name = client, name
        self.after: int | None = None
        self.update = f"-> {version},"  # the service.update event of this version

    def say(self, progress: _Progress) -> None:
        try:
            events = self.client.events(self.name, self.after or 0)
        except ClientError:
            return  # only a progress line: the service's own state decides the outcome
        if self.after is None:  # from this version's update on
            starts = [e["id"] for e in events if self.update in (e.get("reason") or "")]
            events = [e for e in events if starts and e["id"] >= starts[-1]]
        for e in events:
            self.after = max(self.after or 0, int(e["id"]))
            if e["action"] == "update.no_room":
                out.print(f"  {progress.stamp()} {e['reason']}", soft_wrap=True)


def wait_rollout(client: Client, name: str, version: int, timeout: float | None) -> None:
    """Wait until only the new version runs, at its target, or it is refused."""
    progress = _Progress()

    def late(service: dict[str, Any]) -> str:
        return f"version {version} not fully rolled out after {timeout:g}s; it keeps going"

    swaps = _Swaps(client, name, version)
    for service in _polled(client, name, timeout, late):
        progress.replicas(service)
        swaps.say(progress)
        current = service.get("version")
        if isinstance(current, int) and current > version:
            # Another update (or a rollback) came after this one: its replicas are retired,
            # so "only the new version runs" never comes, and without --timeout we waited
            # for good.
            _fail(
                f"version {version} was superseded by version {current} (a later update); "
                f"`corral status {name}` shows what runs"
            )
        live = [r for r in service["replicas"] if r["status"] in LIVE]
        ready_new = [r for r in live if r["version"] == version and r["status"] == "READY"]
        others = [r for r in live if r["version"] != version]
        failure = service.get("last_update_failure") or service.get("failure") or ""
        if f"version {version} never became ready" in failure:
            on = f"; {cliview.serving_text(service)}" if cliview.traffic_versions(service) else ""
            _fail(f"version {version} not promoted: {failure}{on}")
        target = service.get("target")
        if target is not None and not others and len(ready_new) >= target:
            out.print(
                f"[green]service {name}: version {version} serves all traffic[/green] "
                f"(after {cliview.age(time.monotonic() - progress.started)})"
            )
            return


def wait_down(
    client: Client,
    targets: list[str],
    *,
    purge: bool,
    timeout: float,
    stuck: dict[str, str] | None = None,
) -> None:
    """Until each target is gone. A teardown that failed is said with its replicas (and
    waiting goes on for the other targets); with ``purge``, what was forgotten so is named:
    it may still run (``stuck``: as seen before the down was asked, since a purge forgets them
    at once)."""
    deadline = time.monotonic() + timeout
    pending = set(targets)
    failed: list[str] = []
    stuck = {n: text for n, text in (stuck or {}).items() if text}  # failed their teardown
    while pending and time.monotonic() < deadline:
        for n in list(pending):
            try:
                s = client.service(n)
            except ClientError as exc:
                if exc.status == 404:
                    pending.discard(n)
                    forgot = f"; forgot {stuck[n]}: they may still run" if n in stuck else ""
                    out.print(f"service {n}: down{forgot}")
                    continue
                if _respawned(exc, client):
                    continue
                _fail(_client_error_text(exc))
            else:
                if purge and (seen := stuck_replicas(s)):
                    stuck[n] = seen
                elif s["status"] == "FAILED_CLEANUP" and not purge:
                    pending.discard(n)
                    failed.append(
                        f"service {n}: teardown failed for "
                        f"{stuck_replicas(s) or 'a replica'}; "
                        f"see `corral status -v {n}`, or `corral down {n} --purge` to forget them"
                    )
        time.sleep(0.2)
    if failed:
        _fail("\n".join(failed))
    if pending:
        _fail(f"still shutting down after {timeout:g}s: {', '.join(sorted(pending))}")
