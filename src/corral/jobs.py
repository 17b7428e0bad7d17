"""The JobPool: launch and teardown jobs on threads, each with its own log and cancellation.

Why threads and not a process per job: a thread starts in ~0.1 ms and shares the daemon's memory
and state, where a process costs 3-90 ms to start (1-2 s once it imports a real dependency set)
and tens of MB each. What a process gave for free, separate stdout/stderr per job, comes from
:mod:`corral.capture`: every job runs inside ``capture.to(its log)``.

Why one lane per job kind: launches can be slow and many; if they shared one queue with
teardowns, a burst of launches would starve the teardowns that free resources. Each kind has its
own queue and its own worker limit.

A job itself (states, cancellation points) is :mod:`corral.job`; a command run from one is
:mod:`corral.jobcommand`. Their names are imported here too, so a job's code needs only
``from corral import jobs``.
"""

from __future__ import annotations

import contextvars
import logging
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corral import procfs
from corral.job import (
    Cancelled,
    CommandFailed,
    Job,
    JobLogError,
    JobState,
    SetupFailed,
    checkpoint,
    current_job,
    exit_text,
    sleep,
)
from corral.jobcommand import run_command

__all__ = [
    "Cancelled",
    "CommandFailed",
    "Job",
    "JobLogError",
    "JobPool",
    "JobState",
    "SetupFailed",
    "checkpoint",
    "current_job",
    "exit_text",
    "run_command",
    "sleep",
]

log = logging.getLogger("corral.jobs")


@dataclass
class _Lane:
    """The queue and workers of one job kind."""

    kind: str
    limit: int
    queue: deque[Job] = field(default_factory=deque)
    cond: threading.Condition = field(default_factory=threading.Condition)
    workers: list[threading.Thread] = field(default_factory=list)
    # Workers (and guests) whose job was abandoned while its call was stuck: they no longer
    # count toward the limit, and each exits as soon as its call returns.
    stuck: list[threading.Thread] = field(default_factory=list)
    # The jobs the workers run (abandoned ones leave it: they no longer hold a slot), the jobs
    # each group runs (by a worker or a guest), and the guests: threads past the limit, each
    # running one job of a group that had none running (see JobPool._serve_starved).
    running: set[int] = field(default_factory=set)
    active: dict[str, set[int]] = field(default_factory=dict)
    guests: list[threading.Thread] = field(default_factory=list)
    idle: int = 0
    closed: bool = False


class JobPool:
    """Worker threads for launch/teardown jobs, one lane (queue + limit) per job kind.

    ``max_workers`` is the limit of any kind not named in ``limits``. Worker threads start
    lazily, up to the limit, and are reused; every job still runs in a FRESH context, so a route
    or job variable set by one job can never leak into the next job on the same thread.
    """

    def __init__(self, max_workers: int = 8, limits: Mapping[str, int] | None = None) -> None:
        if max_workers < 1:
            raise ValueError("max_workers must be >= 1")
        self._default_limit = max_workers
        self._limits = dict(limits or {})
        for kind, n in self._limits.items():
            if n < 1:
                raise ValueError(f"limit of job kind {kind!r} must be >= 1")
        self._lanes: dict[str, _Lane] = {}
        self._jobs: dict[int, Job] = {}
        self._abandoned: dict[int, Job] = {}  # abandoned jobs whose call has not returned
        self._lock = threading.Lock()
        self._closed = False

    def submit(
        self,
        fn: Callable[..., Any],
        *args: Any,
        log: str | os.PathLike[str] | None = None,
        name: str | None = None,
        kind: str = "default",
        log_required: bool = True,
        group: str | None = None,
        **kwargs: Any,
    ) -> Job:
        """Queue ``fn(*args, **kwargs)``; its output goes to ``log`` (a path) when given.

        ``log_required=False``: run the job even when ``log`` cannot be opened (its output then
        goes to the process's own stderr); by default such a job fails (see :meth:`Job._run`).
        ``group`` (a service's name): the job's group always has one job running, even when
        the other groups' jobs hold every slot of the lane (see :meth:`_serve_starved`).
        """
        job = Job(
            fn,
            args,
            kwargs,
            name=name or str(getattr(fn, "__name__", "job")),
            kind=kind,
            log_path=Path(log) if log is not None else None,
            log_required=log_required,
            group=group,
        )
        job.add_done_callback(self._forget)
        # Queued (and its worker started) under the pool lock: a shutdown() running meanwhile
        # either refuses this job or sees it queued and its worker in the lane, never neither.
        with self._lock:
            if self._closed:
                raise RuntimeError("JobPool is shut down")
            lane = self._lanes.get(kind)
            if lane is None:
                lane = _Lane(kind, self._limits.get(kind, self._default_limit))
                self._lanes[kind] = lane
            self._jobs[job.id] = job
            with lane.cond:
                lane.queue.append(job)
                if not self._add_worker(lane):
                    lane.cond.notify()
                self._serve_starved(lane)
        return job

    def _add_worker(self, lane: _Lane) -> bool:
        """Start a worker when queued jobs outnumber idle workers and the lane has room (called
        with ``lane.cond`` held). True when one was started."""
        if lane.closed or lane.idle >= len(lane.queue) or len(lane.workers) >= lane.limit:
            return False
        worker = threading.Thread(
            target=self._work,
            args=(lane,),
            name=f"corral-{lane.kind}-{len(lane.workers) + len(lane.stuck) + 1}",
            daemon=True,
        )
        lane.workers.append(worker)
        worker.start()
        return True

    def _serve_starved(self, lane: _Lane) -> None:
        """While the workers run ``limit`` jobs, start a guest thread for the oldest queued job
        of each group that has none running (called with ``lane.cond`` held).

        Why: a job can hang for as long as its own time limit allows (a `setup` stuck for
        30 minutes); the lane's limit alone let two services whose setups hang hold every
        launch slot, and every other service's launches waited behind them. A guest runs
        past the limit, one per group, and at most ``limit`` guests run: twice the limit in
        all (besides threads stuck in an abandoned job's call, in ``lane.stuck``), so a
        daemon restarting 50 services never runs 50 setups at once on one machine.
        """
        if lane.closed or len(lane.running) < lane.limit:
            return
        for job in list(lane.queue):
            if len(lane.guests) >= lane.limit:
                return
            if job.group is None or lane.active.get(job.group) or job.done():
                continue
            lane.queue.remove(job)
            lane.active[job.group] = {job.id}
            guest = threading.Thread(
                target=self._guest,
                args=(lane, job),
                name=f"corral-{lane.kind}-guest-{job.group}",
                daemon=True,
            )
            lane.guests.append(guest)
            guest.start()

    def _guest(self, lane: _Lane, job: Job) -> None:
        """Run one job past the lane's limit (see :meth:`_serve_starved`), then exit."""
        try:
            if job._start():
                contextvars.Context().run(job._run)
        finally:
            with self._lock:
                self._abandoned.pop(job.id, None)
            me = threading.current_thread()
            with lane.cond:
                # Its job abandoned meanwhile, abandon() moved it to the stuck threads.
                (lane.guests if me in lane.guests else lane.stuck).remove(me)
                self._release(lane, job)
                self._serve_starved(lane)  # the group's next job, while the lane is full

    @staticmethod
    def _release(lane: _Lane, job: Job) -> None:
        """The job holds no slot of its lane or its group any more (``lane.cond`` held)."""
        lane.running.discard(job.id)
        if job.group is not None:
            active = lane.active.get(job.group, set())
            active.discard(job.id)
            if not active:
                lane.active.pop(job.group, None)

    def abandon(self, job: Job, error: BaseException) -> bool:
        """Give up on a job that does not finish: it fails at once with ``error`` (its done
        callbacks run now), it is asked to cancel, and its worker stops counting toward the
        lane's limit, so the jobs queued behind it run. False if it had already finished.

        Why: a thread cannot be killed, and a backend call that ignores cancellation (a stuck
        RPC, a process in uninterruptible sleep) would otherwise hold its lane slot forever;
        enough of them and no teardown of any service runs again. The stuck thread is left to
        return on its own (:meth:`Job.returned` says when); it then exits instead of taking
        more work, and its late outcome is only logged.
        """
        given_up = job._give_up(error)
        if given_up is None:
            return False
        running, thread, pgids = given_up
        for pgid in pgids:
            procfs.signal_group(pgid, signal.SIGTERM)
        if running and thread is not None:
            with self._lock:
                lane = self._lanes.get(job.kind)
                if not job.returned():
                    self._abandoned[job.id] = job
            if lane is not None:
                with lane.cond:
                    # A guest's thread is stuck the same way: counted as abandoned, and not
                    # waited for by shutdown() (its call may never return).
                    for threads in (lane.workers, lane.guests):
                        if thread in threads:
                            threads.remove(thread)
                            lane.stuck.append(thread)
                    self._release(lane, job)
                    self._add_worker(lane)
                    self._serve_starved(lane)
        log.error("job %s abandoned: %s", job.name, error)
        job._finish()
        return True

    def _forget(self, job: Job) -> None:
        with self._lock:
            self._jobs.pop(job.id, None)

    def _work(self, lane: _Lane) -> None:
        while True:
            with lane.cond:
                while not lane.queue and not lane.closed:
                    lane.idle += 1
                    lane.cond.wait()
                    lane.idle -= 1
                if not lane.queue:
                    return
                job = lane.queue.popleft()
                lane.running.add(job.id)
                if job.group is not None:
                    lane.active.setdefault(job.group, set()).add(job.id)
                self._serve_starved(lane)
            if job._start():
                contextvars.Context().run(job._run)
            with lane.cond:
                self._release(lane, job)
            if job.abandoned:
                # Its slot was handed to another worker when the job was abandoned: this
                # thread leaves, so the lane never holds more than its limit of workers.
                with self._lock:
                    self._abandoned.pop(job.id, None)
                me = threading.current_thread()
                with lane.cond:
                    if me in lane.stuck:
                        lane.stuck.remove(me)
                    elif me in lane.workers:  # returned before abandon() moved it
                        lane.workers.remove(me)
                        self._add_worker(lane)
                return

    def jobs(self) -> list[Job]:
        """Jobs not finished yet (a copy)."""
        with self._lock:
            return list(self._jobs.values())

    def stats(self) -> dict[str, dict[str, int]]:
        with self._lock:
            lanes = list(self._lanes.values())
        out: dict[str, dict[str, int]] = {}
        for lane in lanes:
            with lane.cond:
                out[lane.kind] = {
                    "limit": lane.limit,
                    "workers": len(lane.workers),
                    "idle": lane.idle,
                    "queued": len(lane.queue),
                    "abandoned": len(lane.stuck),
                    "guests": len(lane.guests),
                }
        return out

    def shutdown(
        self, *, cancel_pending: bool = True, cancel_running: bool = True, timeout: float = 30.0
    ) -> bool:
        """Stop the pool; True when every worker thread and every job's command is gone.

        Running jobs are cancelled (their commands killed) when ``cancel_running``; jobs still
        running at the deadline have their process groups killed so no child outlives the pool.
        """
        with self._lock:
            self._closed = True
            lanes = list(self._lanes.values())
            jobs = list(self._jobs.values())
            stuck = list(self._abandoned.values())
        for job in jobs:
            pending = job.state is JobState.PENDING
            if (pending and cancel_pending) or (not pending and cancel_running):
                job.cancel()
        for lane in lanes:
            with lane.cond:
                lane.closed = True
                lane.cond.notify_all()
        deadline = time.monotonic() + timeout
        for lane in lanes:
            with lane.cond:
                threads = lane.workers + lane.guests
            for worker in threads:
                worker.join(max(0.0, deadline - time.monotonic()))
        # Threads of abandoned jobs are not waited for (they are stuck: that is why they were
        # abandoned) but count as alive, and the commands they started are killed like any.
        alive = [
            w for lane in lanes for w in lane.workers + lane.guests + lane.stuck if w.is_alive()
        ]
        for job in jobs + stuck:
            for pgid in job._groups():
                procfs.terminate_process_group(pgid, grace=1.0)
        return not alive
