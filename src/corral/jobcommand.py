"""A shell command run from a job: in a process group of its own, killed whole on cancel.

Its output goes where the calling thread's output goes (:mod:`corral.capture`: the job's log).
Waiting polls the command with a backoff from 1 ms to 50 ms while listening for the job's
cancel, so a short command costs about a millisecond and a cancel is seen within 50 ms.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence

from corral import capture, procfs
from corral.job import Cancelled, CommandFailed, Job, checkpoint, current_job

__all__ = ["run_command"]


def run_command(
    args: str | Sequence[str],
    *,
    shell: bool = False,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    grace: float = 5.0,
    check: bool = True,
    preexec_fn: Callable[[], None] | None = None,
) -> int:
    """Run a command in its own process group with its output in the current route.

    On cancel of the current job (or on ``timeout``) the whole group gets TERM, then KILL after
    ``grace`` seconds, and :class:`Cancelled` (or ``subprocess.TimeoutExpired``) is raised.
    """
    checkpoint()
    job = current_job()
    proc = capture.spawn(
        args, shell=shell, cwd=cwd, env=env, start_new_session=True, preexec_fn=preexec_fn
    )
    pgid = proc.pid
    if job is not None and not job.track_group(pgid):
        procfs.terminate_process_group(pgid, grace, proc.poll)
        proc.wait()
        job.untrack_group(pgid)
        raise Cancelled(f"job {job.name} cancelled")
    try:
        code = _wait(proc, job, args, timeout, grace)
    finally:
        if job is not None:
            job.untrack_group(pgid)
        capture.end_line()
    if check and code != 0:
        raise CommandFailed(args, code)
    return code


def _wait(
    proc: capture.RoutedProcess,
    job: Job | None,
    args: str | Sequence[str],
    timeout: float | None,
    grace: float,
) -> int:
    """The command's exit code once it exits; its whole group is stopped first when the job
    is cancelled or ``timeout`` passes (raising :class:`Cancelled` or ``TimeoutExpired``)."""
    pgid = proc.pid
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 0.001
    while (code := proc.poll()) is None:
        if deadline is not None and time.monotonic() >= deadline:
            procfs.terminate_process_group(pgid, grace, proc.poll)
            proc.wait()
            raise subprocess.TimeoutExpired(args, timeout or 0.0)
        wait = delay if deadline is None else min(delay, max(0.0, deadline - time.monotonic()))
        if job is None:
            time.sleep(wait)
        elif job.wait_cancel(wait):
            procfs.terminate_process_group(pgid, grace, proc.poll)
            proc.wait()
            raise Cancelled(f"job {job.name} cancelled")
        delay = min(delay * 2, 0.05)
    if code != 0 and job is not None and job.cancel_requested():
        # cancel() TERMs the group itself, so the leader may have died of it before this loop
        # saw the cancel: that is a cancel, not a failed command, and members of the group
        # that ignore TERM still get KILLed after the grace period.
        procfs.terminate_process_group(pgid, grace, proc.poll)
        proc.wait()
        raise Cancelled(f"job {job.name} cancelled")
    proc.wait()  # joins the output pumps
    return code
