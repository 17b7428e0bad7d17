"""A balancer worker: one OS process that serves every service's port from its last table.

Run by the daemon as ``python -m corral.dataplane.worker --home HOME --slot N``, in a session of
its own, so that a daemon SIGKILL, stop or upgrade leaves it serving. Several workers bind each
service's port with SO_REUSEPORT and the kernel spreads connections between them; a worker that
dies takes only its own connections with it while the others keep the port.

What it does, and why each part is here rather than in the daemon:

* Keeps one :class:`corral.balancer.LoadBalancer` per service. A table that changes only the
  ready set is applied in place (the very next request sees it); one that changes the listener's
  settings (policy, timeouts, TLS) starts a new listener on the same port first, then retires
  the old one, which finishes its in-flight requests: no moment without a listener.
* With no daemon it keeps serving its last table (a replica that refuses connections is passed
  over: a refusal uses up no attempt), and reconnects every ``RECONNECT_INTERVAL``.
* Reports every ``REPORT_INTERVAL`` (at once when a replica that left the ready set has drained,
  and last as it stops) request times, in-flight counts, counters and bind errors.
* Brings a crashed daemon back: when no daemon holds the home's lock for ``RESPAWN_AFTER``
  seconds (plus a stagger per slot, so two workers rarely race; the daemon's lock settles any
  race) and the last daemon did not stop on purpose (``daemon.stopped``), it starts the command
  the daemon last said it was started with. A replica that dies while the daemon is down is
  then still replaced within seconds.
* Ends with its home (:mod:`corral.ownership`): when the home is deleted or replaced, or its
  state file is gone, it stops listening and exits; with no daemon connected it first ends
  the home's replicas, as no daemon ever will. It never starts a daemon for a home that is
  gone. A worker with no route and no daemon for ``IDLE_EXIT`` seconds exits too.
* Holds its slot (``dataplane/slot-N.lock``, flock) for its life: a second worker for it exits
  at once, but a successor started by ``restart-workers`` (``--successor``) serves beside its
  predecessor until that one is told to exit, and takes the lock when it is released.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final

from corral.balancer import LoadBalancer, speedups
from corral.dataplane import engine_shares, engines
from corral.dataplane.carried import Carried
from corral.dataplane.daemon_restart import start_daemon
from corral.dataplane.listeners import make_balancer
from corral.dataplane.locks import claim_respawn, daemon_holds_lock, take_slot
from corral.dataplane.protocol import (
    MAX_MESSAGE,
    STOPPED_MARKER,
    Route,
    bucket_times,
    decode,
    encode,
    socket_path,
)
from corral.limits import raise_open_files, undumpable
from corral.ownership import CHECK_INTERVAL as HOME_CHECK_INTERVAL
from corral.ownership import HomeWatch

log = logging.getLogger("corral.worker")

REPORT_INTERVAL: Final = 0.25
RECONNECT_INTERVAL: Final = 0.2
RESPAWN_AFTER: Final = 1.0
RESPAWN_STAGGER: Final = 0.5
# After starting a daemon, wait this long before starting another (it may be slow to come up).
RESPAWN_BACKOFF: Final = 10.0
SEND_TIMEOUT: Final = 5.0
BIND_RETRY: Final = 1.0
# An exiting worker leaves idle keep-alive connections open this long for one more request.
IDLE_GRACE: Final = 3.0
# A worker with no route and no daemon for this long exits ($CORRAL_WORKER_IDLE_EXIT).
IDLE_EXIT: Final = 60.0
# Replicas of a deleted home get this long after SIGTERM before SIGKILL.
ORPHAN_GRACE: Final = 5.0


@dataclass
class _Service:
    key: str
    lb: LoadBalancer
    ready: dict[int, str] = field(default_factory=dict)
    engine_path: str | None = None  # where its replicas' engines publish their metrics
    engines: dict[int, Any] = field(default_factory=dict)  # what they said last


class Worker:
    def __init__(
        self,
        home: Path,
        slot: int,
        *,
        watch: HomeWatch | None = None,
        idle_exit: float = IDLE_EXIT,
        slot_lock: IO[str] | None = None,
    ) -> None:
        self.home = home
        self.slot = slot
        self.watch = watch
        self.idle_exit = idle_exit
        self._slot_lock = slot_lock
        self.services: dict[str, _Service] = {}
        self.retiring: list[tuple[str, LoadBalancer]] = []
        self.carried = Carried()  # the counters of balancers a route change retired
        self.errors: dict[str, str] = {}
        # Routes whose listener could not be set up (port taken, TLS files unreadable): tried
        # again every BIND_RETRY seconds, so a port freed later is taken without a daemon.
        self.unbound: dict[str, Route] = {}
        self.seq = 0
        self.fleet = 1  # balancer workers of the home: each counts a share of a limit
        self.respawn: Mapping[str, Any] | None = None
        self.stop = asyncio.Event()
        self._writer: asyncio.StreamWriter | None = None
        self._cursor: dict[int, int] = {}  # id(lb) -> its requests reported so far
        self._leftover: dict[str, list[float]] = {}  # unreported times of retired balancers
        self._history = False
        self._soon = asyncio.Event()  # a report is wanted now, not at the next interval
        self._disconnected_since = time.monotonic()
        self._last_spawn = -RESPAWN_BACKOFF
        self._children: list[subprocess.Popen[bytes]] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop.set)
        tasks = [
            asyncio.create_task(self._connect_loop()),
            asyncio.create_task(self._report_loop()),
            asyncio.create_task(self._supervise_loop()),
            asyncio.create_task(self._engines_loop()),
        ]
        log.info("balancer worker %d (pid %d) started", self.slot, os.getpid())
        await self.stop.wait()
        log.info("balancer worker %d stopping", self.slot)
        for task in tasks[2:]:  # the channel and the reports go on through the drain
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.gather(
            # A new worker serves the ports: one more request a keep-alive client, held ones go.
            *(svc.lb.stop(idle_grace=IDLE_GRACE, hand_over=True) for svc in self.services.values()),
            *list(self._tasks),  # retiring balancers (stopping already): their requests end
            return_exceptions=True,
        )
        await self._report()  # what it counted since the last (the drain too): none is lost
        for task in tasks[:2]:
            task.cancel()

    # -- the channel --------------------------------------------------------------------------

    async def _connect_loop(self) -> None:
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(
                    socket_path(self.home), limit=MAX_MESSAGE
                )
            except OSError:
                await asyncio.sleep(RECONNECT_INTERVAL)
                continue
            try:
                writer.write(
                    encode(
                        {
                            "t": "hello",
                            "slot": self.slot,
                            "pid": os.getpid(),
                            "created": _created(),
                            "seq": self.seq,
                            "accelerated": speedups.ACCELERATED,
                        }
                    )
                )
                # A daemon answered: the next crash may be answered at once again (the back-off
                # only guards against a daemon that dies before it ever answers).
                self._last_spawn = -RESPAWN_BACKOFF
                log.info("connected to the daemon")
                while True:
                    line = await reader.readuntil(b"\n")
                    self._writer = writer  # no report before its hello: its history has them
                    await self._handle(decode(line))
            except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                pass
            finally:
                if self._writer is writer:
                    self._writer = None
                    self._disconnected_since = time.monotonic()
                    log.info("lost the daemon; serving the last table")
                writer.close()
            await asyncio.sleep(RECONNECT_INTERVAL)

    async def _handle(self, message: dict[str, Any]) -> None:
        kind = message["t"]
        if kind == "hello":
            respawn = message.get("respawn")
            self.respawn = respawn if isinstance(respawn, Mapping) else None
            self._history = bool(message.get("history"))
        elif kind == "table":
            services = message.get("services")
            self.fleet = int(message.get("workers") or 1)
            if isinstance(services, Mapping):
                if not self.stop.is_set():  # stopping, its listeners are closed: none opens
                    await self._apply(services)
                self.seq = int(message.get("seq") or 0)
            await self._report()
        elif kind == "exit":
            log.info("asked to exit by the daemon")
            self.stop.set()

    async def _send(self, message: Mapping[str, Any]) -> None:
        writer = self._writer
        if writer is None:
            return
        writer.write(encode(message))
        try:
            async with asyncio.timeout(SEND_TIMEOUT):
                await writer.drain()
        except (TimeoutError, OSError):
            writer.close()  # the read loop sees it and reconnects

    # -- applying a table ---------------------------------------------------------------------

    async def _apply(self, table: Mapping[str, Any]) -> None:
        for name, data in table.items():
            try:
                route = Route.from_json(data)
            except (KeyError, TypeError, ValueError) as exc:
                self.errors[name] = f"unreadable route: {exc}"
                continue
            await self._apply_route(str(name), route)
        for name in [n for n in self.unbound if n not in table]:
            del self.unbound[name]
            self.errors.pop(name, None)
        for name in [n for n in self.services if n not in table]:
            self._retire(name, self.services.pop(name).lb)
            self.errors.pop(name, None)
            engine_shares.forget(engine_shares.Share.of(self.home, name, self.slot, self.fleet))
        # Let the retiring listeners close before the report that says this table is applied
        # (a `corral down` waits for that report to mean "the port is closed").
        await asyncio.sleep(0)

    async def _apply_route(self, name: str, route: Route) -> None:
        svc = self.services.get(name)
        key = route.listener_key()
        if svc is None or svc.key != key:
            ready = dict(route.ready) if route.ready is not None else (svc.ready if svc else {})
            try:
                lb = make_balancer(name, route, self._drained, self.home, self.slot, self.fleet)
                # Before it listens: with SO_REUSEPORT the kernel sends it connections the moment
                # it does, and a request must not meet an empty ready set (a 503) meanwhile.
                lb.set_ready(ready)
                await lb.start()
            except (OSError, ssl.SSLError, ValueError, TypeError) as exc:
                error = f"cannot listen on {route.host}:{route.port}: {exc}"
                if self.errors.get(name) != error:
                    log.error("service %s: %s (retrying every %gs)", name, error, BIND_RETRY)
                self.errors[name] = error
                self.unbound[name] = route
                if svc is not None and route.ready is not None:
                    # The old listener keeps serving meanwhile: with the current replicas.
                    svc.ready = dict(route.ready)
                    svc.lb.set_ready(svc.ready)
                return
            if self.unbound.pop(name, None) is not None:
                log.info("service %s: listening on %s:%d now", name, route.host, route.port)
            self.errors.pop(name, None)
            old = svc
            svc = self.services[name] = _Service(key=key, lb=lb, ready=ready)
            if old is not None:
                self._retire(name, old.lb, heir=lb)
        if route.ready is not None:
            svc.ready = dict(route.ready)
            svc.lb.describe_replicas(route.weights, route.ids)
        svc.lb.set_ready(svc.ready)
        for retired_name, retired in self.retiring:  # a request it holds for a first replica
            if retired_name == name:
                retired.set_ready(svc.ready)
        path = route.config.get("engine_metrics_path")
        svc.engine_path = str(path) if path else None

    def _retire(self, name: str, lb: LoadBalancer, heir: LoadBalancer | None = None) -> None:
        """Stop a listener in the background (handing over to ``heir``, its successor after a
        route change); its requests finish (and stay counted in the reports: drains wait)."""
        entry = (name, lb)
        self.retiring.append(entry)
        if heir is not None:
            lb.leave_boards()  # now, before the ready set it is told next

        async def retire() -> None:
            try:
                grace = IDLE_GRACE if heir is not None else 0.0
                await lb.stop(idle_grace=grace, hand_over=heir is not None, heir=heir)
            finally:
                self.retiring.remove(entry)
                seen = self._cursor.pop(id(lb), 0)
                if name in self.services:  # a route change: its successor goes on counting
                    self.carried.add(name, lb.stats())
                    self._leftover.setdefault(name, []).extend(lb.timestamps_since(seen)[0])
                elif not any(n == name for n, _ in self.retiring):
                    self.carried.drop(name)  # the service was taken down

        task = asyncio.create_task(retire())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- reports ------------------------------------------------------------------------------

    def _drained(self, replica_id: int) -> None:
        self._soon.set()

    async def _report_loop(self) -> None:
        """A report every REPORT_INTERVAL, and one at once when something asks (``_soon``):
        it waits on the event, where it used to wake 20 times a second to look at a flag."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(REPORT_INTERVAL):
                    await self._soon.wait()
            await asyncio.sleep(0)  # what asks in the same moment goes in the same report
            self._soon.clear()
            await self._report()

    async def _report(self) -> None:
        if self._writer is None:
            return
        history, self._history = self._history, False
        leftover, self._leftover = self._leftover, {}
        services: dict[str, Any] = {}
        names = set(self.services) | {name for name, _ in self.retiring} | set(self.errors)
        for name in names:
            lbs = [lb for n, lb in self.retiring if n == name]
            svc = self.services.get(name)
            if svc is not None:
                lbs.append(svc.lb)
            times: list[float] = leftover.get(name, [])
            for lb in lbs:
                # A daemon that asks for history gets all it keeps (TIMESTAMP_HORIZON, 600 s).
                seen = 0 if history else self._cursor.get(id(lb), 0)
                got, self._cursor[id(lb)] = lb.timestamps_since(seen)
                times.extend(got)
            times.sort()
            services[name] = {
                "stats": self.carried.summed(name, [lb.stats() for lb in lbs]) if lbs else None,
                "times": bucket_times(times),
                "port": svc.lb.port if svc is not None else None,
                "inodes": svc.lb.listener_inodes() if svc is not None else [],
                "engines": {str(k): v for k, v in svc.engines.items()} if svc else {},
                "error": self.errors.get(name),
            }
        await self._send({"t": "report", "seq": self.seq, "services": services})

    async def _engines_loop(self) -> None:
        """Every engines.INTERVAL: the replicas' own load, where their route says to read it,
        each engine read by one of the home's workers for all (corral.dataplane.engine_shares)."""
        while True:
            await asyncio.sleep(engines.INTERVAL)
            await self._read_engines()

    async def _read_engines(self) -> None:
        """One turn of :meth:`_engines_loop`. A service with no ready replica (all replaced,
        scaled to zero) or no metrics path any more keeps no readings: what its last engines
        said must not stand in `status` and ``/metrics`` for replicas that are gone."""
        for name, svc in list(self.services.items()):
            if svc.engine_path and svc.ready:
                share = engine_shares.Share.of(self.home, name, self.slot, self.fleet)
                read = engine_shares.refresh(svc.lb, svc.ready, svc.engine_path, svc.engines, share)
                svc.engines = await read
                if name not in self.services:  # it went meanwhile: so do its readings
                    engine_shares.forget(share)
            elif svc.engines:
                svc.engines = {}
                engines.give(svc.lb, {})

    # -- bringing a crashed daemon back -------------------------------------------------------

    async def _supervise_loop(self) -> None:
        next_bind = next_home_check = 0.0
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            if now >= next_home_check:
                next_home_check = now + HOME_CHECK_INTERVAL  # a few stat calls
                if await self._home_lost():
                    return
            if self._slot_lock is None:
                self._slot_lock = take_slot(self.home, self.slot)
            if self._idle_too_long(now):
                log.info("no route and no daemon for %gs: exiting", self.idle_exit)
                self.stop.set()
                return
            if self.unbound and time.monotonic() >= next_bind:
                next_bind = time.monotonic() + BIND_RETRY
                for name, route in list(self.unbound.items()):
                    await self._apply_route(name, route)
                if not self.unbound:
                    self._soon.set()
            self._children = [c for c in self._children if c.poll() is None]
            if self._writer is not None or self.respawn is None:
                continue
            now = time.monotonic()
            quiet = now - self._disconnected_since
            if quiet < RESPAWN_AFTER + RESPAWN_STAGGER * self.slot:
                continue
            if now - self._last_spawn < RESPAWN_BACKOFF:
                continue
            if (self.home / STOPPED_MARKER).exists() or daemon_holds_lock(self.home):
                continue
            if self.watch is not None and self.watch.gone() is not None:
                continue  # never a daemon for a home that is gone (the next check ends us)
            if not claim_respawn(self.home, RESPAWN_BACKOFF):
                continue  # another worker started one a moment ago
            self._last_spawn = now
            child = start_daemon(self.home, self.respawn)
            if child is not None:
                self._children.append(child)
                log.warning("no daemon for %.1fs: started one (pid %d)", RESPAWN_AFTER, child.pid)

    async def _home_lost(self) -> bool:
        """True (and the worker stopping) when its home is gone. With no daemon connected the
        home's replicas are ended first: no daemon will come back to do it."""
        reason = self.watch.gone() if self.watch is not None else None
        if reason is None:
            return False
        log.warning("%s: this balancer worker exits", reason)
        marker = self.watch.home_id if self.watch is not None else None
        if self._writer is None and marker is not None:
            from corral.infra.base import leave_scratch
            from corral.infra.local_scan import end_home

            for line in await asyncio.to_thread(end_home, marker, ORPHAN_GRACE):
                log.warning("home gone: %s", line)
            if not self.home.exists():  # deleted, not replaced: nothing will run there again
                await asyncio.to_thread(leave_scratch, marker, True)
        self.stop.set()
        return True

    def _idle_too_long(self, now: float) -> bool:
        if self._writer is not None or self.services or self.unbound or self.retiring:
            return False
        return now - self._disconnected_since >= self.idle_exit


def _created() -> float:
    import psutil

    return float(psutil.Process().create_time())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="corral-balancer-worker", description=__doc__)
    parser.add_argument(
        "--home", type=Path, default=None, help="corral home (default: $CORRAL_HOME)"
    )
    parser.add_argument("--slot", required=True, type=int)
    parser.add_argument(
        "--home-id", default=None, help="the home's id: names the owner on the command line"
    )
    parser.add_argument(
        "--successor",
        action="store_true",
        help="started by restart-workers: serve beside the slot's old worker until it exits",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s worker-{args.slot} %(name)s: %(message)s",
    )
    soft, hard = raise_open_files()  # every client connection costs a descriptor here
    undumpable()  # its environment names the home: not for replicas to read
    log.info("open files: soft limit %d (hard %d)", soft, hard)
    home = args.home or (Path(os.environ["CORRAL_HOME"]) if os.environ.get("CORRAL_HOME") else None)
    if home is None:
        parser.error("no home: pass --home or set CORRAL_HOME")
    home = home.resolve()
    try:
        watch = HomeWatch(home)
    except OSError as exc:
        log.error("no home at %s (%s): exiting", home, exc)
        sys.exit(1)
    lock = take_slot(home, args.slot)
    if lock is None and not args.successor:
        log.error("another balancer worker holds slot %d of %s: exiting", args.slot, home)
        sys.exit(0)
    idle_exit = float(os.environ.get("CORRAL_WORKER_IDLE_EXIT") or IDLE_EXIT)
    worker = Worker(home, args.slot, watch=watch, idle_exit=idle_exit, slot_lock=lock)
    import uvloop  # a dependency: the balancer's fast path is written for its transports

    uvloop.run(worker.run())


if __name__ == "__main__":
    main()
