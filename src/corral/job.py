"""One job of the :class:`~corral.jobs.JobPool`: its states, its outcome, its cancellation.

Why cancellation is cooperative: a thread cannot be killed safely. A job calls
:func:`checkpoint` between steps, waits with :func:`sleep` (which wakes at once on cancel) and runs
commands with :func:`corral.jobcommand.run_command` (which kills the command's whole process group
on cancel). Blocking calls that ignore all three finish their step before the cancel is seen.

A :class:`Job` changes only through its own methods: the pool starts, runs, abandons and finishes
it through the underscored ones, which are meant for :mod:`corral.jobs` alone.
"""

from __future__ import annotations

import contextvars
import enum
import itertools
import logging
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from corral import capture, procfs

__all__ = [
    "Cancelled",
    "CommandFailed",
    "Job",
    "JobLogError",
    "JobState",
    "SetupFailed",
    "checkpoint",
    "current_job",
    "exit_text",
    "sleep",
]

log = logging.getLogger("corral.jobs")


class JobState(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


_FINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})


class Cancelled(Exception):
    """Raised inside a job at a cancellation point once the job was asked to stop."""


class JobLogError(OSError):
    """The job's log could not be opened, so the job did not run (see ``log_required``).

    Its message names the file and the reason, because it ends up as the failure a user reads
    in ``corral status`` (a bare ``OSError(30, 'Read-only file system')`` names neither).
    """


class CommandFailed(Exception):
    """A command run by :func:`run_command` exited non-zero."""

    def __init__(self, args: str | Sequence[str], returncode: int) -> None:
        shown = args if isinstance(args, str) else " ".join(args)
        super().__init__(f"command exited with code {returncode}: {shown}")
        self.returncode = returncode


def exit_text(code: int) -> str:
    """An exit status as a person reads it: ``code 3``, or ``signal 9 (SIGKILL)`` for a
    process a signal ended (Popen's negative code)."""
    if code >= 0:
        return f"code {code}"
    try:
        return f"signal {-code} ({signal.Signals(-code).name})"
    except ValueError:
        return f"signal {-code}"


class SetupFailed(CommandFailed):
    """A replica's ``setup`` failed: the user's command, said in one line, with no traceback
    (nothing in corral went wrong). A command not found or not executable (126, 127) is said
    so: every relaunch would meet it again (:func:`corral.plan.hopeless`)."""

    def __init__(self, returncode: int) -> None:
        why = {
            126: " (a command it runs cannot be executed)",
            127: " (a command it runs was not found)",
        }
        Exception.__init__(
            self,
            f"setup {'exited with' if returncode >= 0 else 'was ended by'} "
            f"{exit_text(returncode)}{why.get(returncode, '')}",
        )
        self.returncode = returncode

    def __repr__(self) -> str:
        return str(self)  # the failure status shows: meant for the user as it is


_ids = itertools.count(1)


class Job:
    """One unit of work submitted to a :class:`JobPool`.

    All state changes happen under ``self._lock`` and every reader gets plain values or copies,
    never live views (SkyServe's "dictionary changed size during iteration" came from handing
    out a live dict shared with worker threads).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        name: str,
        kind: str,
        log_path: Path | None,
        log_required: bool = True,
        group: str | None = None,
    ) -> None:
        self.id = next(_ids)
        self.name = name
        self.kind = kind
        # Whose job it is (a service's name): a group always gets one job running in its lane
        # (see JobPool._serve_starved).
        self.group = group
        self.log_path = log_path
        self.log_required = log_required
        # Why the job's log lost output (could not be opened, or writes failed: a full disk),
        # None while it is intact. Set by the worker before the job is done.
        self.log_error: str | None = None
        self._fn = fn
        self._args = args
        self._kwargs = kwargs
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._cancel = threading.Event()
        self._state = JobState.PENDING
        self._result: Any = None
        self._exception: BaseException | None = None
        self._callbacks: list[Callable[[Job], object]] = []
        self._pgids: set[int] = set()
        self.submitted_at = time.time()
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self._submitted_mono = time.monotonic()
        self._started_mono: float | None = None
        # The worker thread running the function, and whether the pool gave up on it (see
        # JobPool.abandon): an abandoned job is final for everyone, but its thread may still be
        # inside the function; `_returned` is set once no thread is (or will be).
        self._thread: threading.Thread | None = None
        self._abandoned = False
        self._returned = threading.Event()

    def __repr__(self) -> str:
        return f"<Job {self.id} {self.name} {self.state}>"

    @property
    def state(self) -> JobState:
        return self._state

    @property
    def queued_seconds(self) -> float | None:
        """Submit-to-start latency, once started."""
        if self._started_mono is None:
            return None
        return self._started_mono - self._submitted_mono

    @property
    def run_seconds(self) -> float | None:
        """How long the job has been running (or ran), None while it waits for a worker."""
        if self._started_mono is None:
            return None
        return time.monotonic() - self._started_mono

    def _give_up(
        self, error: BaseException
    ) -> tuple[bool, threading.Thread | None, list[int]] | None:
        """Fail at once with ``error`` and ask the call to cancel, for :meth:`JobPool.abandon`;
        None if the job had already finished. Says whether its call was running, on which
        thread, and the process groups it started (the pool signals those)."""
        with self._lock:
            if self._state in _FINAL:
                return None
            self._cancel.set()
            running = self._state is JobState.RUNNING
            self._state = JobState.FAILED
            self._exception = error
            self.ended_at = time.time()
            self._abandoned = running
            if not running:
                self._returned.set()  # never started: no thread to wait for
            return running, self._thread, list(self._pgids)

    @property
    def abandoned(self) -> bool:
        """The pool gave up waiting for this job (:meth:`JobPool.abandon`)."""
        return self._abandoned

    def returned(self) -> bool:
        """True once the job's function is not running on any thread: it returned, raised or
        never started. Differs from :meth:`done` only for an abandoned job whose call is stuck."""
        return self._returned.is_set()

    def done(self) -> bool:
        return self._done.is_set()

    def cancel_requested(self) -> bool:
        return self._cancel.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """True once the job reached a final state."""
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> Any:
        if not self._done.wait(timeout):
            raise TimeoutError(f"job {self.name} still {self._state}")
        if self._exception is not None:
            raise self._exception
        if self._state is JobState.CANCELLED:
            raise Cancelled(f"job {self.name} was cancelled")
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._done.wait(timeout):
            raise TimeoutError(f"job {self.name} still {self._state}")
        return self._exception

    def cancel(self) -> bool:
        """Ask the job to stop. A pending job never starts; a running one stops at its next
        cancellation point, and the commands it runs are killed. False if already finished."""
        with self._lock:
            if self._state in _FINAL:
                return False
            self._cancel.set()
            if self._state is not JobState.PENDING:
                pgids = list(self._pgids)
                finish = False
            else:
                pgids = []
                finish = True
                self._state = JobState.CANCELLED
                self.ended_at = time.time()
                self._returned.set()  # it never ran
        for pgid in pgids:
            procfs.signal_group(pgid, signal.SIGTERM)
        if finish:
            self._finish()
        return True

    def add_done_callback(self, fn: Callable[[Job], object]) -> None:
        """Call ``fn(job)`` when the job ends (at once if it already has), from the thread that
        ended it. Callbacks must not block; the controller uses them to wake its event loop."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        _call(fn, self)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "id": self.id,
                "name": self.name,
                "kind": self.kind,
                "state": str(self._state),
                "log": str(self.log_path) if self.log_path else None,
                "submitted_at": self.submitted_at,
                "started_at": self.started_at,
                "ended_at": self.ended_at,
                "error": repr(self._exception) if self._exception else None,
                "log_error": self.log_error,
            }

    # -- used by the pool, and by run_command (corral.jobcommand) ----------------------------

    def _start(self) -> bool:
        with self._lock:
            if self._state is not JobState.PENDING:
                return False
            self._state = JobState.RUNNING
            self.started_at = time.time()
            self._started_mono = time.monotonic()
            self._thread = threading.current_thread()
            return True

    def _set_outcome(self, state: JobState, result: Any, exc: BaseException | None) -> None:
        with self._lock:
            abandoned = self._abandoned
            self._returned.set()
            if not abandoned:
                self._state = state
                self._result = result
                self._exception = exc
                self.ended_at = time.time()
        if abandoned:
            # Already final (failed as abandoned) and reported: the late outcome is only logged.
            outcome = repr(exc) if exc else state
            log.warning("abandoned job %s returned after all: %s", self.name, outcome)
            return
        self._finish()

    def _finish(self) -> None:
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
            self._done.set()
        for fn in callbacks:
            _call(fn, self)

    def track_group(self, pgid: int) -> bool:
        """Record a process group this job started; False if the job is already cancelled."""
        with self._lock:
            self._pgids.add(pgid)
            return not self._cancel.is_set()

    def untrack_group(self, pgid: int) -> None:
        with self._lock:
            self._pgids.discard(pgid)

    def wait_cancel(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds; True as soon as the job is asked to stop."""
        return self._cancel.wait(timeout)

    def _groups(self) -> list[int]:
        with self._lock:
            return list(self._pgids)

    def _run(self) -> None:
        """Body of a worker: runs in a fresh context, inside the job's own log route.

        A log that cannot be opened (read-only or missing directory) fails the job with a
        :class:`JobLogError` naming the file, unless ``log_required`` is False: then the job
        runs with its output in the daemon's own log, because its work matters more than its
        output (a teardown must not leave a replica running for want of a log file). Writes
        that fail later (a full disk) never reach the job (:mod:`corral.capture` drops and
        reports them); either way the reason is kept in ``log_error``.
        """
        _current_job.set(self)
        route: capture.to | None = None
        if self.log_path is not None:
            route = capture.to(self.log_path)
            try:
                route.__enter__()
            except Exception as exc:
                route = None
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else repr(exc)
                self.log_error = f"cannot open its log {self.log_path}: {reason}"
                if self.log_required:
                    # The worker (maybe the lane's only one) lives on; the job fails, clearly.
                    log.error("job %s: %s; not run", self.name, self.log_error)
                    self._set_outcome(JobState.FAILED, None, JobLogError(self.log_error))
                    return
                log.error("job %s: %s; its output goes here instead", self.name, self.log_error)
        try:
            state, result, error = self._call()
        finally:
            if route is not None:
                route.__exit__(None, None, None)
                if route.error is not None:
                    self.log_error = f"writing its log {self.log_path} failed: {route.error}"
        self._set_outcome(state, result, error)

    def _call(self) -> tuple[JobState, Any, BaseException | None]:
        try:
            checkpoint()
            result = self._fn(*self._args, **self._kwargs)
        except Cancelled:
            print(f"[corral] job {self.name} cancelled", flush=True)
            return JobState.CANCELLED, None, None
        except SetupFailed as exc:  # the user's command: its own output says the rest
            print(f"[corral] {exc}", flush=True)
            return JobState.FAILED, None, exc
        except BaseException as exc:
            # Into THIS job's log, before the route is reset.
            traceback.print_exc()
            print(f"[corral] job {self.name} failed: {exc!r}", flush=True)
            return JobState.FAILED, None, exc
        return JobState.SUCCEEDED, result, None


def _call(fn: Callable[[Job], object], job: Job) -> None:
    try:
        fn(job)
    except Exception:
        log.exception("done-callback of job %s raised", job.name)


_current_job: contextvars.ContextVar[Job | None] = contextvars.ContextVar(
    "corral_current_job", default=None
)


def current_job() -> Job | None:
    """The job the calling thread is running, or None outside jobs."""
    return _current_job.get()


def checkpoint() -> None:
    """Raise :class:`Cancelled` if the current job was asked to stop (no-op outside jobs)."""
    job = _current_job.get()
    if job is not None and job._cancel.is_set():
        raise Cancelled(f"job {job.name} cancelled")


def sleep(seconds: float) -> None:
    """Sleep that wakes at once, raising :class:`Cancelled`, when the current job is cancelled."""
    job = _current_job.get()
    if job is None:
        time.sleep(max(0.0, seconds))
        return
    if job._cancel.wait(max(0.0, seconds)):
        raise Cancelled(f"job {job.name} cancelled")
