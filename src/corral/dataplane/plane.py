"""The daemon's side of the data plane: workers kept alive, tables pushed, reports gathered.

:class:`DataPlane` listens on the home's Unix socket, starts the balancer workers or adopts
those a previous daemon left (by pid and creation time, in SQLite: never a second set),
restarts one that died, pushes the routing table to every worker when it changes, and keeps
what they report. :class:`ServiceRoute` is one service's view of it: what the controller used
on an in-process balancer (``set_ready``, ``wait_drained``, ``arrivals``).

Nothing is pushed before :meth:`DataPlane.open`: a restarted daemon first lets its controllers
re-adopt their replicas, and until then the workers keep serving the table they had (a route
whose ready set is not known yet is sent as "keep yours", see ``protocol.Route``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import psutil

from corral.balancer.load_board import clear_hand_over
from corral.dataplane.carried import Carried
from corral.dataplane.listeners import remove_shared
from corral.dataplane.processes import WORKER_STOP_TIMEOUT, find_process, start_worker
from corral.dataplane.protocol import (
    MAX_MESSAGE,
    Route,
    clock_seq,
    decode,
    encode,
    note_respawn,
    socket_path,
)
from corral.dataplane.replace import replace_worker
from corral.dataplane.route import Arrivals, ServiceRoute, recent_arrivals
from corral.dataplane.shared_ports import PortWatch
from corral.dataplane.slots import SlotBook
from corral.procfs import running as _running
from corral.state import Store

__all__ = ["DEFAULT_WORKERS", "DataPlane", "ServiceRoute"]

log = logging.getLogger("corral.dataplane")

DEFAULT_WORKERS: Final = min(os.cpu_count() or 1, 4)
# How often worker processes are checked (a dead one is restarted within about this long).
CHECK_INTERVAL: Final = 0.25


@dataclass
class _Conn:
    """One connected worker and its latest report."""

    slot: int
    pid: int
    writer: asyncio.StreamWriter
    seq: int = 0
    heard: float = field(default_factory=time.monotonic)  # its last report
    accelerated: str = "unknown"  # its fast path's build, as its hello said (daemon status)
    reports: dict[str, dict[str, Any]] = field(default_factory=dict)
    created: float = 0.0  # its process's start time (with pid: which process it is)


class DataPlane:
    """Balancer workers of one home, seen from the daemon; see the module docstring."""

    def __init__(
        self,
        home: Path,
        store: Store,
        *,
        workers: int = DEFAULT_WORKERS,
        respawn: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.home = home
        self.store = store
        self.size = workers
        self.respawn = respawn
        self._env = dict(env if env is not None else os.environ)
        self.routes: dict[str, ServiceRoute] = {}
        self._carried = Carried(  # of gone workers; those that no longer run, merged
            home / "dataplane" / "carried.json", alive=lambda s: find_process(*s) is not None
        )
        self.slots = SlotBook(store)
        self.ports = PortWatch()
        self._conns: dict[int, _Conn] = {}  # by pid
        self._times: dict[str, dict[int, int]] = defaultdict(dict)  # service -> bucket -> n
        self._known_pids: set[int] = set()  # workers already heard from (history sent once)
        self._seq = clock_seq()
        self._sent_seq = 0
        self._open = False
        self._push_scheduled = False
        self._changed = asyncio.Condition()
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        self._restarting = asyncio.Lock()
        self._server: asyncio.AbstractServer | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._notifies: set[asyncio.Future[None]] = set()
        self._bind_errors: dict[str, dict[int, str]] = defaultdict(dict)
        self.on_bind_error: Callable[[str, str], None] | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        path = socket_path(self.home)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._server = await asyncio.start_unix_server(self._serve, path=path, limit=MAX_MESSAGE)
        os.chmod(path, 0o600)
        with contextlib.suppress(OSError):
            (self.home / "dataplane").mkdir(exist_ok=True)
            note_respawn(self.home, self.respawn is not None)  # for the CLI to read
        self._ensure_workers()
        self._monitor = asyncio.create_task(self._monitor_loop(), name="corral-dataplane")

    def open(self) -> None:
        """Start pushing tables (the controllers re-adopted); times of routeless services go."""
        self._open = True
        self._times = defaultdict(dict, {n: t for n, t in self._times.items() if n in self.routes})
        self.changed()
        self._schedule_notify()  # drains wait for this (ServiceRoute.wait_drained)

    async def stop(self, *, workers: bool = False) -> None:
        """Leave the workers serving their last table, or with ``workers`` stop them too."""
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        if workers:
            await self._stop_workers()
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns.values()):
            conn.writer.close()
        # Closing ends their handlers (EOF); cancelled, asyncio would log each as an error.
        handlers = list(self._handlers)
        if handlers:
            await asyncio.wait(handlers, timeout=2.0)

    async def _stop_workers(self) -> None:
        rows = self.slots.rows() or {}
        for conn in list(self._conns.values()):
            with contextlib.suppress(OSError):
                conn.writer.write(encode({"t": "exit"}))
        procs: list[psutil.Process] = []
        for row in rows.values():
            proc = find_process(row.pid, row.created)
            if proc is not None:
                procs.append(proc)
                if row.pid not in self._conns:
                    with contextlib.suppress(psutil.Error):
                        proc.terminate()
        deadline = time.monotonic() + WORKER_STOP_TIMEOUT
        while time.monotonic() < deadline and any(_running(p) for p in procs):
            self._reap()
            await asyncio.sleep(0.05)
        for proc in procs:
            if _running(proc):
                log.warning("balancer worker pid %d did not stop; killing it", proc.pid)
                with contextlib.suppress(psutil.Error):
                    proc.kill()
        self._reap()
        for slot in rows:
            self.slots.delete(slot)

    # -- workers ------------------------------------------------------------------------------

    def _ensure_workers(self) -> None:
        """Adopt live recorded workers, start the missing ones, stop the extra ones."""
        self._reap()
        rows = self.slots.rows()
        if rows is None:
            return  # not known: a slot is never judged empty on a read that failed
        for slot, extra in rows.items():
            if slot >= self.size:
                proc = find_process(extra.pid, extra.created)
                if proc is not None:
                    with contextlib.suppress(psutil.Error):
                        proc.terminate()
                self.slots.delete(slot)
        now = time.monotonic()
        for slot in range(self.size):
            row = rows.get(slot)
            if row is not None and find_process(row.pid, row.created) is not None:
                continue
            said_hello = row is not None and row.pid in self._known_pids
            if not self.slots.may_start(slot, said_hello, now):
                continue  # it keeps dying at once: do not start one 4 times a second
            if row is not None:
                log.warning("balancer worker %d (pid %d) is gone; starting another", slot, row.pid)
            self._spawn(slot)

    def _spawn(self, slot: int, *, successor: bool = False) -> int | None:
        if not successor:  # the slot's last process is gone, and its hand-over counts with it
            clear_hand_over(self.home / "dataplane", slot, self.size)
        child = start_worker(self.home, slot, self._env, successor=successor)
        if child is None:
            return None
        self._children[child.pid] = child
        try:
            self.slots.set(slot, child.pid, psutil.Process(child.pid).create_time())
        except psutil.Error as exc:
            log.warning("balancer worker %d (pid %d) is gone already: %s", slot, child.pid, exc)
        log.info("started balancer worker %d (pid %d)", slot, child.pid)
        return child.pid

    def _reap(self) -> None:
        for pid, child in list(self._children.items()):
            if child.poll() is not None:
                del self._children[pid]

    async def _monitor_loop(self) -> None:
        while True:
            await asyncio.sleep(CHECK_INTERVAL)
            try:
                self._ensure_workers()
                heard = {conn.pid: conn.heard for conn in self._conns.values()}
                self.slots.end_frozen(heard, time.monotonic())
                await self._check_ports()
            except Exception:
                log.exception("checking balancer workers failed")

    async def _check_ports(self) -> None:
        """A listener on a service's port that is none of its workers' (shared_ports)."""
        if len(self._conns) < self.size or not self.ports.due(time.monotonic()):
            return  # a worker not connected yet has not reported the sockets it holds
        reports = [r for conn in self._conns.values() for r in conn.reports.values()]
        routes = {name: (r.route.host, r.route.port) for name, r in self.routes.items()}
        for name in await asyncio.to_thread(self.ports.check, routes, reports):
            if self.on_bind_error is not None:
                self.on_bind_error(name, self.ports.problems[name])

    async def restart_workers(self, timeout: float = 15.0) -> list[dict[str, int]]:
        """Replace every worker with a new process, one slot at a time, new one first
        (:mod:`corral.dataplane.replace`): how an upgrade of corral reaches the data plane
        without a moment where a port has no listener. One restart at a time: two at once
        each replaced the worker the other had just started, and left one unrecorded."""
        async with self._restarting:
            done = []
            for slot, old in sorted((self.slots.rows() or {}).items()):
                new = self._spawn(slot, successor=True)
                if new is not None:
                    await replace_worker(self, slot, old, new, timeout)
                    done.append({"slot": slot, "old_pid": old.pid, "new_pid": new})
            return done

    # -- the channel --------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        conn: _Conn | None = None
        try:
            hello = decode(await reader.readuntil(b"\n"))
            if hello["t"] != "hello":
                return
            conn = self._adopt(hello, writer)
            if conn is None:
                writer.write(encode({"t": "exit"}))
                return
            history = conn.pid not in self._known_pids
            self._known_pids.add(conn.pid)
            writer.write(encode({"t": "hello", "history": history, "respawn": self._respawn()}))
            if self._open:
                writer.write(encode(self._table()))
            while True:
                self._on_report(conn, decode(await reader.readuntil(b"\n")))
        except (
            OSError,
            ValueError,
            KeyError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
        ):
            pass
        finally:
            if conn is not None and self._conns.get(conn.pid) is conn:
                del self._conns[conn.pid]
                # Its counts stay in the sums (until this same process reports again).
                self._carried.gone(conn.reports, self.routes, (conn.pid, conn.created))
                await self._notify()
            writer.close()
            if task is not None:
                self._handlers.discard(task)

    def _adopt(self, hello: Mapping[str, Any], writer: asyncio.StreamWriter) -> _Conn | None:
        """A worker said hello: accept it if its slot's record names it, or if the slot's
        recorded worker is gone (a worker started but never recorded); else it is a second
        worker for a slot, and is told to exit."""
        slot, pid, created = int(hello["slot"]), int(hello["pid"]), float(hello["created"])
        rows = self.slots.rows()
        if rows is None:  # unknown yet: it reconnects and is judged on the next hello
            raise ValueError("worker slots unreadable")
        if slot >= self.size:
            return None
        row = rows.get(slot)
        if row is None or (row.pid, row.created) != (pid, created):
            if row is not None and find_process(row.pid, row.created) is not None:
                log.warning(
                    "balancer worker pid %d claims slot %d, held by pid %d", pid, slot, row.pid
                )
                return None
            self.slots.set(slot, pid, created)
        conn = self._conns[pid] = _Conn(slot, pid, writer, int(hello.get("seq") or 0))
        conn.accelerated = str(hello.get("accelerated") or "unknown")  # older workers: none
        conn.created = created
        return conn

    def _respawn(self) -> dict[str, Any] | None:
        if self.respawn is None:
            return None
        return {**self.respawn, "env": {**self._env, "CORRAL_HOME": str(self.home)}}

    def _on_report(self, conn: _Conn, message: Mapping[str, Any]) -> None:
        if message["t"] != "report":
            return
        conn.seq = int(message.get("seq") or 0)
        conn.heard = time.monotonic()
        services = message.get("services") or {}
        reports: dict[str, dict[str, Any]] = {}
        for name, report in services.items():
            if not isinstance(report, Mapping):
                continue
            reports[str(name)] = dict(report)
            if self._open and name not in self.routes:
                continue  # a listener retiring after its service left (before: history, kept)
            times = self._times[str(name)]
            for bucket, count in report.get("times") or ():
                times[int(bucket)] = times.get(int(bucket), 0) + int(count)
            self._note_bind(str(name), conn.slot, report.get("error"))
        if not conn.reports:
            # A reconnected worker counts on: what was carried of it is in this report, now.
            self._carried.back((conn.pid, conn.created))
        conn.reports = reports
        self._schedule_notify()

    def _note_bind(self, name: str, slot: int, error: Any) -> None:
        errors = self._bind_errors[name]
        if error is None:
            errors.pop(slot, None)
            return
        if errors.get(slot) != error:
            errors[slot] = str(error)
            if self.on_bind_error is not None:
                self.on_bind_error(name, f"balancer worker {slot}: {error}")

    def _schedule_notify(self) -> None:
        task = asyncio.ensure_future(self._notify())
        self._notifies.add(task)
        task.add_done_callback(self._notifies.discard)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def wait_until(self, predicate: Callable[[], bool], timeout: float | None) -> bool:
        """Wait until ``predicate`` holds, re-checked on every report and lost worker; False if
        ``timeout`` passes first."""
        try:
            async with asyncio.timeout(timeout):
                async with self._changed:
                    await self._changed.wait_for(predicate)
        except TimeoutError:
            return False
        return True

    # -- the table ----------------------------------------------------------------------------

    def route(self, name: str, route: Route) -> ServiceRoute:
        existing = self.routes.get(name)
        if existing is not None:
            existing.configure(route)
            return existing
        service = self.routes[name] = ServiceRoute(self, name, route)
        self.changed()
        return service

    def remove(self, name: str) -> int:
        """Take a service out of the table; the seq of the table without it."""
        if self.routes.pop(name, None) is None:
            return 0
        self._times.pop(name, None)
        self._bind_errors.pop(name, None)
        self._carried.drop(name)
        remove_shared(self.home, name)  # a later service of that name starts afresh
        return self.changed()

    def current_seq(self) -> int:
        return self._seq

    def all_applied(self, seq: int) -> bool:
        """Every worker slot is connected and has applied table ``seq``."""
        return len(self._conns) >= self.size and self.applied(seq)

    def applied(self, seq: int) -> bool:
        """Table ``seq`` (or a later one) went out, and every connected worker applied it."""
        return self._sent_seq >= seq and all(conn.seq >= seq for conn in self._conns.values())

    def is_open(self) -> bool:
        return self._open

    def changed(self) -> int:
        """Something in the table changed: push it soon (once per loop turn however many
        changes), and return the seq that table will carry."""
        if not self._push_scheduled:
            self._seq = max(self._seq + 1, clock_seq())
            self._push_scheduled = True
            asyncio.get_running_loop().call_soon(self._push)
        return self._seq

    def _table(self) -> dict[str, Any]:
        return {
            "t": "table",
            "seq": self._seq,
            "workers": self.size,
            "services": {name: r.route.to_json() for name, r in self.routes.items()},
        }

    def _push(self) -> None:
        self._push_scheduled = False
        if not self._open:
            return
        data = encode(self._table())
        self._sent_seq = self._seq
        for conn in list(self._conns.values()):
            try:
                conn.writer.write(data)
            except OSError:
                conn.writer.close()

    # -- what the workers report --------------------------------------------------------------

    def drained(self, name: str, replica_id: int, seq: int) -> bool:
        """Every worker slot (not only the connected ones: one reconnecting still routes by
        its old table) applied table ``seq`` and has no request in flight to the replica."""
        key = str(replica_id)
        if not self.applied(seq) or {c.slot for c in self._conns.values()} < set(range(self.size)):
            return False
        for conn in self._conns.values():
            stats = (conn.reports.get(name) or {}).get("stats") or {}
            replica = (stats.get("replicas") or {}).get(key) or {}
            if int(replica.get("in_flight", 0)) > 0:
                return False
        return True

    def reported(self, name: str) -> bool:  # by every slot (a restarted daemon: its history)
        return {c.slot for c in self._conns.values() if name in c.reports} >= set(range(self.size))

    def arrivals(self, name: str, window: float) -> Arrivals:
        return recent_arrivals(self._times.get(name), window)

    def stats(self, only: str | None = None) -> dict[str, dict[str, Any]]:
        """Every service's counters (or ``only`` that one's), summed over its workers, those
        gone included (dataplane.carried), with what its engines said last (to any worker)."""
        reports = {(conn.pid, conn.created): conn.reports for conn in self._conns.values()}
        return self._carried.gathered(reports, self.routes, only)

    def bind_errors(self, name: str) -> list[str]:
        """Why the service's endpoint is not (only) served by its workers: ports they could
        not bind, a foreign listener on the port."""
        errors = [
            f"worker {slot}: {e}" for slot, e in sorted(self._bind_errors.get(name, {}).items())
        ]
        shared = self.ports.problems.get(name)
        return errors + ([shared] if shared else [])

    def workers(self) -> list[dict[str, Any]]:
        return self.slots.view({pid: (c.seq, c.accelerated) for pid, c in self._conns.items()})
