"""Tests of corral.jobs: the JobPool, job states, logs, cancellation, lanes and shutdown.

Every wait has a deadline (``Event.wait(timeout)`` or a polling loop with one); jobs that block
do so cancellably, so a failing test still shuts its pool down quickly. Child processes carry a
unique marker in their command line and are killed by PID at teardown if a test left any.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from corral import capture, jobs
from corral.jobs import Cancelled, CommandFailed, Job, JobPool, JobState

pytestmark = pytest.mark.timeout(60)

DEADLINE = 10.0

# A process group with a grandchild: sh is the leader, one sleep runs in the background and one
# in the foreground. "$0" (the marker) makes the leader findable in the process table.
GROUP_SCRIPT = "sleep 60 & sleep 60; wait"
STUBBORN_SCRIPT = "trap '' TERM; sleep 60 & sleep 60; wait"


# -- helpers ----------------------------------------------------------------------------------


def wait_for(pred: Callable[[], bool], timeout: float = DEADLINE) -> bool:
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        if pred():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


def block_until(event: threading.Event, timeout: float = DEADLINE) -> None:
    """Inside a job: wait for ``event`` but stay cancellable (raises Cancelled on cancel)."""
    deadline = time.monotonic() + timeout
    while not event.wait(0.005):
        jobs.checkpoint()
        if time.monotonic() >= deadline:
            raise TimeoutError("test event never set")


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def dead(proc: psutil.Process) -> bool:
    """Gone, or a zombie (dead, merely not reaped yet by whoever inherited it)."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _pgid(proc: psutil.Process) -> int | None:
    try:
        return os.getpgid(proc.pid)
    except (ProcessLookupError, PermissionError):
        return None


def group_members(pgid: int) -> list[psutil.Process]:
    """Live descendants of this process that belong to process group ``pgid``."""
    return [
        p for p in psutil.Process().children(recursive=True) if _pgid(p) == pgid and not dead(p)
    ]


def leader_with(marker: str) -> psutil.Process | None:
    for p in psutil.Process().children(recursive=True):
        try:
            if marker in p.cmdline() and not dead(p):
                return p
        except psutil.Error:
            continue
    return None


# Processes seen per marker, killed at teardown if a failing test left them running.
_seen: dict[str, list[psutil.Process]] = {}


def wait_for_group(marker: str, size: int) -> list[psutil.Process]:
    """The members of the group led by the process carrying ``marker``, once it has ``size``."""
    found: list[psutil.Process] = []

    def ready() -> bool:
        nonlocal found
        leader = leader_with(marker)
        found = group_members(leader.pid) if leader is not None else []
        return len(found) == size

    ok = wait_for(ready)
    _seen.setdefault(marker, []).extend(found)
    assert ok, f"process group {marker} never had {size} members: {found}"
    return found


def corral_threads(exclude: set[threading.Thread]) -> list[threading.Thread]:
    return [
        t
        for t in threading.enumerate()
        if t not in exclude and t.name.startswith("corral-") and t.is_alive()
    ]


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture
def marker() -> Iterator[str]:
    """A unique tag for the command lines of this test's children; leftovers killed by PID."""
    tag = f"corral-test-{uuid.uuid4().hex}"
    yield tag
    leader = leader_with(tag)
    leftovers = [*_seen.pop(tag, []), *(group_members(leader.pid) if leader else [])]
    for p in leftovers:
        if not dead(p):
            with contextlib.suppress(psutil.Error):
                p.kill()  # psutil refuses if the PID was reused meanwhile


@pytest.fixture
def pools() -> Iterator[Callable[..., JobPool]]:
    """Make pools that are shut down (and checked) at teardown."""
    made: list[JobPool] = []

    def make(max_workers: int = 8, limits: dict[str, int] | None = None) -> JobPool:
        pool = JobPool(max_workers=max_workers, limits=limits)
        made.append(pool)
        return pool

    yield make
    for pool in made:
        assert pool.shutdown(timeout=DEADLINE), "pool left a worker thread behind"


@pytest.fixture
def routed_logger() -> Iterator[logging.Logger]:
    """A logger whose handler writes to the capture router (so into each job's own log)."""
    capture.install()
    assert capture.installed()
    logger = logging.getLogger(f"corral.test.{uuid.uuid4().hex}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler = logging.StreamHandler(sys.stderr)  # the router, installed just above
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    yield logger
    logger.removeHandler(handler)


# -- construction ---------------------------------------------------------------------------


def test_invalid_limits_rejected() -> None:
    with pytest.raises(ValueError):
        JobPool(max_workers=0)
    with pytest.raises(ValueError):
        JobPool(max_workers=2, limits={"launch": 0})


# -- states, results, exceptions, logs --------------------------------------------------------


def test_success_states_result_times_and_current_job(
    pools: Callable[..., JobPool], tmp_path: Path
) -> None:
    pool = pools(2)
    inside: dict[str, Any] = {}
    release = threading.Event()

    def work(a: int, b: int, *, scale: int) -> int:
        me = jobs.current_job()
        inside["job"] = me
        inside["state"] = me.state if me else None
        inside["route"] = capture.current()
        print("working")
        block_until(release)
        return (a + b) * scale

    log = tmp_path / "ok.log"
    job = pool.submit(work, 1, 2, scale=10, log=log, name="adder", kind="launch")
    assert isinstance(job, Job)
    assert (job.name, job.kind, job.log_path) == ("adder", "launch", log)
    assert wait_for(lambda: job.state is JobState.RUNNING)
    assert not job.done()
    assert not job.wait(0.01)
    with pytest.raises(TimeoutError):
        job.result(timeout=0.01)
    with pytest.raises(TimeoutError):
        job.exception(timeout=0.01)
    assert job.ended_at is None
    release.set()

    assert job.wait(DEADLINE)
    assert job.done()
    assert job.state is JobState.SUCCEEDED
    assert job.result() == 30
    assert job.exception() is None
    assert inside["job"] is job
    assert inside["state"] is JobState.RUNNING
    assert inside["route"] is not None and Path(inside["route"].name) == log
    assert job.started_at is not None and job.ended_at is not None
    assert job.submitted_at <= job.started_at <= job.ended_at
    assert job.queued_seconds is not None and job.queued_seconds >= 0
    assert lines(log) == ["working"]
    assert jobs.current_job() is None  # not leaked into the submitting thread
    assert job.cancel() is False  # already finished
    assert job.state is JobState.SUCCEEDED


def test_default_name_is_function_name(pools: Callable[..., JobPool]) -> None:
    def some_step() -> None:
        pass

    job = pools(1).submit(some_step)
    assert job.name == "some_step"
    assert job.kind == "default"
    assert job.wait(DEADLINE) and job.state is JobState.SUCCEEDED


def _explode(tag: str) -> None:
    raise ValueError(f"boom-{tag}")


def test_failure_traceback_goes_to_own_log_only(
    pools: Callable[..., JobPool], tmp_path: Path
) -> None:
    pool = pools(8)
    n = 8
    barrier = threading.Barrier(n, timeout=DEADLINE)

    def step(i: int) -> str:
        barrier.wait()  # all running at once, so the failures happen while others write
        print(f"job {i} says hi")
        if i % 2:
            _explode(f"job{i}")
        print(f"job {i} done")
        return f"r{i}"

    submitted = [pool.submit(step, i, log=tmp_path / f"{i}.log", name=f"j{i}") for i in range(n)]
    for job in submitted:
        assert job.wait(DEADLINE)

    for i, job in enumerate(submitted):
        text = (tmp_path / f"{i}.log").read_text()
        assert f"job {i} says hi" in text
        for other in range(n):
            if other != i:
                assert f"job {other} " not in text
                assert f"boom-job{other}" not in text
        if i % 2:
            assert job.state is JobState.FAILED
            exc = job.exception()
            assert isinstance(exc, ValueError) and str(exc) == f"boom-job{i}"
            with pytest.raises(ValueError, match=f"boom-job{i}"):
                job.result()
            assert "Traceback (most recent call last)" in text
            assert "in _explode" in text
            assert f"ValueError: boom-job{i}" in text
            assert f"[corral] job j{i} failed" in text
            assert f"job {i} done" not in text
            snap = job.snapshot()
            assert snap["state"] == "failed"
            assert f"boom-job{i}" in snap["error"]
        else:
            assert job.state is JobState.SUCCEEDED
            assert job.result() == f"r{i}"
            assert "Traceback" not in text and "boom" not in text
            assert f"job {i} done" in text


def test_base_exception_in_job_is_a_failure_not_a_dead_worker(
    pools: Callable[..., JobPool], tmp_path: Path
) -> None:
    pool = pools(1)

    def leave() -> None:
        raise SystemExit(3)

    bad = pool.submit(leave, log=tmp_path / "exit.log")
    good = pool.submit(lambda: "still working")
    assert bad.wait(DEADLINE) and good.wait(DEADLINE)
    assert bad.state is JobState.FAILED
    assert isinstance(bad.exception(), SystemExit)
    assert good.result() == "still working"
    assert "SystemExit" in (tmp_path / "exit.log").read_text()


def test_unopenable_log_fails_the_job_and_keeps_the_worker(
    pools: Callable[..., JobPool], tmp_path: Path
) -> None:
    """A log that cannot be opened must fail that job, not kill the lane's only worker."""
    pool = pools(1)
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    called = threading.Event()

    bad = pool.submit(called.set, log=not_a_dir / "sub" / "job.log", name="bad-log")
    good = pool.submit(lambda: 42, log=tmp_path / "good.log")
    assert bad.wait(DEADLINE), f"job with an unopenable log never finished: {bad}"
    assert bad.state is JobState.FAILED
    assert isinstance(bad.exception(), OSError)
    assert not called.is_set()
    assert good.result(timeout=DEADLINE) == 42


def test_many_concurrent_jobs_each_log_has_exactly_its_own_lines(
    pools: Callable[..., JobPool], tmp_path: Path, routed_logger: logging.Logger
) -> None:
    n, per_job, sub_lines = 64, 200, 20
    pool = pools(n)
    barrier = threading.Barrier(n, timeout=20)
    sub = 'i=0; while [ "$i" -lt "$2" ]; do echo "job$1 sub $i"; i=$((i+1)); done'

    def expected(i: int) -> list[str]:
        out = []
        for k in range(per_job):
            kind = ("log", "err", "out", "out")[k % 4]
            out.append(f"job{i} {kind} {k}")
        out += [f"job{i} sub {k}" for k in range(sub_lines)]
        out.append(f"job{i} end")
        return out

    def chatty(i: int) -> None:
        barrier.wait()  # all 64 write at the same time
        for k in range(per_job):
            if k % 4 == 0:
                routed_logger.info("job%d log %d", i, k)
            elif k % 4 == 1:
                print(f"job{i} err {k}", file=sys.stderr)
            else:
                print(f"job{i} out {k}")
        jobs.run_command(["sh", "-c", sub, "sh", str(i), str(sub_lines)])
        print(f"job{i} end")

    submitted = [pool.submit(chatty, i, log=tmp_path / f"job{i}.log") for i in range(n)]
    for job in submitted:
        job.result(timeout=30)
    for i in range(n):
        assert lines(tmp_path / f"job{i}.log") == expected(i), f"log of job{i} differs"


def test_context_does_not_leak_to_next_job_on_same_worker(
    pools: Callable[..., JobPool], tmp_path: Path
) -> None:
    var: contextvars.ContextVar[str] = contextvars.ContextVar("corral_test_var", default="unset")
    pool = pools(1)  # one worker: both jobs run on the same thread
    leaked_log = tmp_path / "leaked.log"

    def dirty() -> tuple[int, Any]:
        var.set("set by the first job")
        stream = capture.to(leaked_log).__enter__()  # a route entered and never left
        print("first job, leaked route")
        return threading.get_ident(), stream

    def clean() -> dict[str, Any]:
        print("second job")
        route = capture.current()
        return {
            "thread": threading.get_ident(),
            "var": var.get(),
            "route": route.name if route is not None else None,
            "job": jobs.current_job(),
        }

    def bare() -> Any:
        return var.get(), capture.current()

    first = pool.submit(dirty, log=tmp_path / "first.log")
    second = pool.submit(clean, log=tmp_path / "second.log")
    third = pool.submit(bare)
    first_thread, leaked_stream = first.result(timeout=DEADLINE)
    try:
        seen = second.result(timeout=DEADLINE)
        assert seen["thread"] == first_thread
        assert seen["var"] == "unset"
        assert seen["route"] == str(tmp_path / "second.log")
        assert seen["job"] is second
        assert third.result(timeout=DEADLINE) == ("unset", None)
    finally:
        leaked_stream.close()
    assert lines(tmp_path / "second.log") == ["second job"]
    assert lines(leaked_log) == ["first job, leaked route"]
    assert var.get() == "unset"


# -- cancellation ------------------------------------------------------------------------------


def test_pending_job_cancelled_never_starts(pools: Callable[..., JobPool], tmp_path: Path) -> None:
    pool = pools(1)
    release = threading.Event()
    started = threading.Event()
    called = threading.Event()
    callbacks: list[Job] = []

    def blocker() -> None:
        started.set()
        block_until(release)

    first = pool.submit(blocker)
    assert started.wait(DEADLINE)
    pending = pool.submit(called.set, log=tmp_path / "never.log")
    pending.add_done_callback(callbacks.append)
    assert pending.state is JobState.PENDING
    assert pending.cancel() is True
    # Final at once, without waiting for a worker.
    assert pending.done() and pending.state is JobState.CANCELLED
    assert callbacks == [pending]
    assert pending.cancel() is False
    assert pending not in pool.jobs()

    release.set()
    assert first.result(timeout=DEADLINE) is None
    after = pool.submit(lambda: "next")  # the worker went past the cancelled job
    assert after.result(timeout=DEADLINE) == "next"
    assert not called.is_set()
    assert pending.started_at is None and pending.ended_at is not None
    assert pending.exception() is None
    with pytest.raises(Cancelled):
        pending.result()
    assert not (tmp_path / "never.log").exists()
    assert callbacks == [pending]


def test_checkpoint_raises_after_cancel(pools: Callable[..., JobPool], tmp_path: Path) -> None:
    pool = pools(1)
    started = threading.Event()
    cancelled = threading.Event()
    reached: list[str] = []

    def steps() -> None:
        jobs.checkpoint()  # not cancelled yet: no-op
        reached.append("before")
        started.set()
        assert cancelled.wait(DEADLINE)
        assert jobs.current_job() is not None and jobs.current_job().cancel_requested()
        try:
            jobs.checkpoint()
        except Cancelled:
            reached.append("raised")
            raise
        reached.append("after")

    job = pool.submit(steps, log=tmp_path / "steps.log", name="steps")
    assert started.wait(DEADLINE)
    assert job.cancel() is True
    assert job.cancel_requested()
    cancelled.set()
    assert job.wait(DEADLINE)
    assert job.state is JobState.CANCELLED
    assert reached == ["before", "raised"]
    assert job.exception() is None
    with pytest.raises(Cancelled):
        job.result()
    assert "[corral] job steps cancelled" in (tmp_path / "steps.log").read_text()


def test_checkpoint_and_sleep_outside_jobs_are_plain() -> None:
    jobs.checkpoint()
    jobs.sleep(0)
    jobs.sleep(-1)
    assert jobs.current_job() is None


def test_sleep_wakes_at_once_on_cancel(pools: Callable[..., JobPool]) -> None:
    pool = pools(1)
    started = threading.Event()
    after_sleep = threading.Event()

    def sleeper() -> None:
        started.set()
        jobs.sleep(60)
        after_sleep.set()

    job = pool.submit(sleeper)
    assert started.wait(DEADLINE)
    assert not job.wait(0.05)  # really asleep
    t0 = time.monotonic()
    job.cancel()
    assert job.wait(DEADLINE)
    assert time.monotonic() - t0 < 1.0
    assert job.state is JobState.CANCELLED
    assert not after_sleep.is_set()


def test_run_command_after_cancel_never_spawns(
    pools: Callable[..., JobPool], tmp_path: Path
) -> None:
    pool = pools(1)
    started = threading.Event()
    flag = tmp_path / "ran"

    def late() -> None:
        started.set()
        me = jobs.current_job()
        assert me is not None
        assert wait_for(me.cancel_requested)
        jobs.run_command(["sh", "-c", f"touch '{flag}'"])

    job = pool.submit(late)
    assert started.wait(DEADLINE)
    job.cancel()
    assert job.wait(DEADLINE)
    assert job.state is JobState.CANCELLED
    assert not flag.exists()


def _cancel_command_job(
    pool: JobPool, marker: str, script: str, grace: float, log: Path
) -> tuple[Job, list[psutil.Process], float]:
    def run() -> None:
        jobs.run_command(["sh", "-c", script, marker], grace=grace)

    job = pool.submit(run, log=log)
    members = wait_for_group(marker, 3)  # sh + background sleep + foreground sleep
    assert len({m.pid for m in members}) == 3
    t0 = time.monotonic()
    assert job.cancel() is True
    assert job.wait(DEADLINE + grace), "cancelled command job did not finish"
    return job, members, time.monotonic() - t0


def test_cancel_kills_whole_process_group(
    pools: Callable[..., JobPool], marker: str, tmp_path: Path
) -> None:
    grace = 5.0
    job, members, elapsed = _cancel_command_job(
        pools(1), marker, GROUP_SCRIPT, grace, tmp_path / "group.log"
    )
    assert job.state is JobState.CANCELLED
    # TERM was enough: no waiting out the grace period.
    assert elapsed < grace - 1, f"cancel took {elapsed:.2f}s"
    for m in members:
        try:
            os.kill(m.pid, 0)
        except ProcessLookupError:
            continue
        # Still in the process table: only as a zombie its new parent has not reaped yet.
        assert dead(m), f"pid {m.pid} of the cancelled command is alive"


def test_cancel_kills_term_ignoring_group_after_grace(
    pools: Callable[..., JobPool], marker: str, tmp_path: Path
) -> None:
    grace = 0.5
    job, members, elapsed = _cancel_command_job(
        pools(1), marker, STUBBORN_SCRIPT, grace, tmp_path / "stubborn.log"
    )
    assert job.state is JobState.CANCELLED
    assert elapsed >= grace, "the group ignores TERM, so it must have waited out the grace"
    assert elapsed < grace + 3.0, f"KILL after grace took {elapsed:.2f}s"
    assert all(dead(m) for m in members)


def test_cancel_seen_only_after_the_term_killed_the_leader(
    pools: Callable[..., JobPool],
    marker: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """cancel() TERMs the group itself. When the job thread is descheduled and first notices the
    cancel through the leader's exit status (-TERM), that is still a cancel, not a failed
    command, and group members that ignore TERM are still KILLed after the grace period."""
    real_spawn = capture.spawn

    def spawn_slow_to_notice(*args: Any, **kwargs: Any) -> capture.RoutedProcess:
        proc = real_spawn(*args, **kwargs)
        real_poll = proc.poll

        def poll() -> int | None:
            me = jobs.current_job()
            if me is not None and not me.cancel_requested():
                # The thread stalls here until cancel() has TERMed the group, the leader died.
                assert wait_for(me.cancel_requested)
                proc.popen.wait(DEADLINE)
            return real_poll()

        proc.poll = poll  # type: ignore[method-assign]
        return proc

    monkeypatch.setattr(capture, "spawn", spawn_slow_to_notice)
    script = "(trap '' TERM; sleep 60) & sleep 60; wait"

    def run() -> None:
        jobs.run_command(["sh", "-c", script, marker], grace=0.5)

    job = pools(1).submit(run, log=tmp_path / "late.log")
    members = wait_for_group(marker, 3)  # sh, a sleep that ignores TERM, a sleep
    assert job.cancel() is True
    assert job.wait(DEADLINE)
    assert job.state is JobState.CANCELLED, repr(job.exception())
    assert all(dead(m) for m in members), "a TERM-ignoring member outlived the cancel"


def test_run_command_timeout(pools: Callable[..., JobPool], marker: str, tmp_path: Path) -> None:
    pool = pools(1)

    def slow() -> None:
        jobs.run_command(["sh", "-c", GROUP_SCRIPT, marker], timeout=0.5, grace=2.0)

    t0 = time.monotonic()
    job = pool.submit(slow, log=tmp_path / "slow.log")
    members = wait_for_group(marker, 3)
    assert job.wait(DEADLINE)
    assert time.monotonic() - t0 < 4.0
    assert job.state is JobState.FAILED
    assert isinstance(job.exception(), subprocess.TimeoutExpired)
    assert all(dead(m) for m in members)
    assert "TimeoutExpired" in (tmp_path / "slow.log").read_text()


def test_a_command_ending_mid_line_leaves_the_log_on_a_new_line(
    pools: Callable[..., JobPool], tmp_path: Path
) -> None:
    """What the job prints after a command whose output stops mid-line starts a line of its
    own ("abc[corral] setup done" before), and a command that ends its lines gets no blank one."""
    pool = pools(1)

    def job() -> None:
        jobs.run_command(["printf", "partial"])
        print("after partial", flush=True)
        jobs.run_command(["printf", "whole\\n"])
        print("after whole", flush=True)
        jobs.run_command(["sh", "-c", "printf failed; exit 3"], check=False)
        print("after failed", flush=True)

    done = pool.submit(job, log=tmp_path / "job.log")
    assert done.wait(DEADLINE) and done.exception() is None
    assert lines(tmp_path / "job.log") == [
        "partial",
        "after partial",
        "whole",
        "after whole",
        "failed",
        "after failed",
    ]


def test_run_command_exit_codes(pools: Callable[..., JobPool], tmp_path: Path) -> None:
    pool = pools(2)

    def checked() -> int:
        return jobs.run_command(["sh", "-c", "echo out; echo err >&2; exit 3"])

    def unchecked() -> int:
        return jobs.run_command("echo shell; exit 4", shell=True, check=False)

    def fine() -> int:
        return jobs.run_command(["sh", "-c", "echo $CORRAL_T"], env={"CORRAL_T": "env-ok"})

    a = pool.submit(checked, log=tmp_path / "a.log")
    b = pool.submit(unchecked, log=tmp_path / "b.log")
    c = pool.submit(fine, log=tmp_path / "c.log")
    assert a.wait(DEADLINE) and b.wait(DEADLINE) and c.wait(DEADLINE)
    exc = a.exception()
    assert isinstance(exc, CommandFailed) and exc.returncode == 3
    assert "code 3" in str(exc)
    assert lines(tmp_path / "a.log")[:2] == ["out", "err"]
    assert b.result() == 4
    assert lines(tmp_path / "b.log") == ["shell"]
    assert c.result() == 0
    assert lines(tmp_path / "c.log") == ["env-ok"]

    # Outside any job too.
    assert jobs.run_command(["sh", "-c", "exit 5"], check=False) == 5
    with pytest.raises(CommandFailed) as info:
        jobs.run_command(["sh", "-c", "exit 6"])
    assert info.value.returncode == 6
    with pytest.raises(subprocess.TimeoutExpired):
        jobs.run_command(["sleep", "60"], timeout=0.2, grace=1.0)


def test_orphaned_zombies_do_not_delay_cancel(tmp_path: Path) -> None:
    """When nobody reaps orphans (corral as a container's PID 1, or under an init that does not
    reap) the group's killed grandchildren stay zombies. They are dead: cancel must not wait out
    the grace period and the KILL period for them."""
    if not sys.platform.startswith("linux"):
        pytest.skip("needs prctl(PR_SET_CHILD_SUBREAPER)")
    script = textwrap.dedent(
        """
        import ctypes, json, os, sys, time
        import psutil
        from corral import jobs

        if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # CHILD_SUBREAPER
            print(json.dumps({"skip": "prctl failed"}))
            sys.exit(0)
        pool = jobs.JobPool(max_workers=1)
        job = pool.submit(
            jobs.run_command, ["sh", "-c", "sleep 60 & sleep 60; wait"], grace=3.0
        )
        me = psutil.Process()
        deadline = time.monotonic() + 10
        while len(me.children(recursive=True)) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        members = me.children(recursive=True)
        t0 = time.monotonic()
        job.cancel()
        job.wait(30)
        elapsed = time.monotonic() - t0
        live = []
        for p in members:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    live.append(p.pid)
                    p.kill()
            except psutil.NoSuchProcess:
                pass
        pool.shutdown(timeout=5)
        while True:  # reap the orphans this process adopted
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        print(json.dumps(
            {"members": len(members), "elapsed": elapsed, "state": job.state, "live": live}
        ))
        """
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(jobs.__file__).resolve().parents[1]), env.get("PYTHONPATH", "")]
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=40,
        env=env,
        cwd=tmp_path,
        check=True,
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    if "skip" in report:
        pytest.skip(report["skip"])
    assert report["members"] == 3
    assert report["state"] == "cancelled"
    assert report["live"] == []
    assert report["elapsed"] < 2.0, f"cancel took {report['elapsed']:.2f}s (grace 3 s)"


# -- lanes and limits --------------------------------------------------------------------------


def test_teardown_not_starved_by_saturated_launch_lane(pools: Callable[..., JobPool]) -> None:
    pool = pools(8, {"launch": 2, "teardown": 1})
    release = threading.Event()
    running = threading.Semaphore(0)

    def launch() -> None:
        running.release()
        block_until(release)

    launches = [pool.submit(launch, kind="launch", name=f"launch{i}") for i in range(6)]
    assert running.acquire(timeout=DEADLINE) and running.acquire(timeout=DEADLINE)
    assert sum(j.state is JobState.RUNNING for j in launches) == 2
    assert pool.stats()["launch"]["queued"] == 4

    t0 = time.monotonic()
    teardown = pool.submit(lambda: "freed", kind="teardown")
    assert teardown.result(timeout=2.0) == "freed"
    assert time.monotonic() - t0 < 1.0
    assert teardown.queued_seconds is not None and teardown.queued_seconds < 1.0
    # ... while the launch lane is still saturated.
    assert sum(j.state is JobState.RUNNING for j in launches) == 2
    assert sum(j.state is JobState.PENDING for j in launches) == 4

    release.set()
    for job in launches:
        assert job.wait(DEADLINE) and job.state is JobState.SUCCEEDED


def test_a_group_with_nothing_running_gets_a_job_past_a_full_lane(
    pools: Callable[..., JobPool],
) -> None:
    """Jobs that hang (group a's) hold every slot of the lane: each other group still gets
    one job running (a guest past the limit), and no more than one, while the lane is full."""
    pool = pools(8, {"launch": 2})
    release = threading.Event()
    try:
        hung = [
            pool.submit(block_until, release, kind="launch", group=group)
            for group in ("a", "a", "b", "b")
        ]
        assert wait_for(lambda: sum(j.state is JobState.RUNNING for j in hung) == 3), hung
        assert [j.state for j in hung].count(JobState.PENDING) == 1, hung  # b's second
        first = pool.submit(lambda: "launched", kind="launch", group="c")
        assert first.result(timeout=DEADLINE) == "launched"
        release_c = threading.Event()
        held = [pool.submit(block_until, e, kind="launch", group="c") for e in (release_c, release)]
        assert wait_for(lambda: held[0].state is JobState.RUNNING), "group c's job waits"
        assert held[1].state is JobState.PENDING  # one at a time past the limit
        assert pool.stats()["launch"]["guests"] == 2  # b's and c's
        release_c.set()
        assert wait_for(lambda: held[1].state is JobState.RUNNING), "c's next job waits"
        assert [j.state for j in hung].count(JobState.RUNNING) == 3, hung
    finally:
        release.set()
    for job in [*hung, first, *held]:
        assert job.wait(DEADLINE) and job.state is JobState.SUCCEEDED, job
    assert wait_for(lambda: pool.stats()["launch"]["guests"] == 0), "a guest stayed"


def test_guests_past_a_full_lane_are_at_most_its_limit(pools: Callable[..., JobPool]) -> None:
    """One guest per starved group, but no more guests than the lane's limit: a daemon
    restarting 50 services must not run 50 setups at once."""
    pool = pools(8, {"launch": 2})
    release = threading.Event()
    try:
        full = [pool.submit(block_until, release, kind="launch", group="a") for _ in range(2)]
        assert wait_for(lambda: all(j.state is JobState.RUNNING for j in full)), full
        others = [pool.submit(block_until, release, kind="launch", group=g) for g in "bcdef"]
        assert wait_for(lambda: sum(j.state is JobState.RUNNING for j in others) == 2), others
        assert [j.state for j in others].count(JobState.PENDING) == 3, others
        assert pool.stats()["launch"]["guests"] == 2
    finally:
        release.set()
    for job in [*full, *others]:
        assert job.wait(DEADLINE) and job.state is JobState.SUCCEEDED, job


def test_an_abandoned_guest_is_stuck_like_an_abandoned_worker() -> None:
    """A guest whose call ignores cancellation is abandoned as a worker is: it counts as
    abandoned (not as a guest), its group gets its next job, and shutdown() does not wait for
    it. It stayed a guest: shutdown waited its whole timeout (15 s for the daemon's stop)."""
    pool = JobPool(max_workers=4, limits={"launch": 1})
    release, unstick = threading.Event(), threading.Event()
    try:
        held = pool.submit(block_until, release, kind="launch", group="a")
        stuck = pool.submit(unstick.wait, DEADLINE, kind="launch", group="b")  # no checkpoint
        after = pool.submit(block_until, release, kind="launch", group="b")
        assert wait_for(lambda: stuck.state is JobState.RUNNING), stuck
        assert pool.abandon(stuck, TimeoutError("hung"))
        assert wait_for(lambda: after.state is JobState.RUNNING), "b's next job waits"
        stats = pool.stats()["launch"]
        assert (stats["guests"], stats["abandoned"]) == (1, 1), stats
        release.set()
        assert held.wait(DEADLINE) and after.wait(DEADLINE)
        started = time.monotonic()
        assert not pool.shutdown(timeout=DEADLINE)  # the stuck thread is alive: False, at once
        assert time.monotonic() - started < DEADLINE / 2
    finally:
        release.set()
        unstick.set()
        pool.shutdown(timeout=DEADLINE)  # again, if an assertion stopped the test early
    assert stuck.state is JobState.FAILED and wait_for(stuck.returned)
    assert wait_for(lambda: pool.stats()["launch"]["abandoned"] == 0), "the stuck thread stayed"


def test_worker_limit_per_kind_respected(pools: Callable[..., JobPool]) -> None:
    limits = {"launch": 3, "default": 2}
    pool = pools(2, {"launch": 3})
    lock = threading.Lock()
    now = dict.fromkeys(limits, 0)
    peak = dict.fromkeys(limits, 0)
    full = {kind: threading.Event() for kind in limits}

    def counted(kind: str) -> None:
        with lock:
            now[kind] += 1
            peak[kind] = max(peak[kind], now[kind])
            if now[kind] == limits[kind]:
                full[kind].set()
        try:
            block_until(full[kind])  # the first `limit` jobs overlap for sure
            jobs.sleep(0.002)
        finally:
            with lock:
                now[kind] -= 1

    submitted = [pool.submit(counted, kind, kind=kind) for kind in limits for _ in range(15)]
    for job in submitted:
        job.result(timeout=DEADLINE)
    assert peak == limits
    stats = pool.stats()
    assert stats["launch"]["workers"] <= 3 and stats["launch"]["limit"] == 3
    assert stats["default"]["workers"] <= 2 and stats["default"]["limit"] == 2


# -- callbacks, snapshots, copies --------------------------------------------------------------


def test_done_callbacks_once_including_late_and_failing(
    pools: Callable[..., JobPool], caplog: pytest.LogCaptureFixture
) -> None:
    pool = pools(1)
    release = threading.Event()
    calls: list[tuple[str, Job, str]] = []
    calls_lock = threading.Lock()

    def recorder(tag: str) -> Callable[[Job], None]:
        def cb(job: Job) -> None:
            with calls_lock:
                calls.append((tag, job, threading.current_thread().name))

        return cb

    def broken(job: Job) -> None:
        raise RuntimeError("callback bug")

    job = pool.submit(block_until, release, name="cb-job")
    job.add_done_callback(broken)
    job.add_done_callback(recorder("early"))
    with caplog.at_level(logging.ERROR, logger="corral.jobs"):
        release.set()
        assert job.wait(DEADLINE)
        assert wait_for(lambda: len(calls) == 1)
    assert calls[0][:2] == ("early", job)
    assert any("done-callback of job cb-job raised" in r.getMessage() for r in caplog.records)

    job.add_done_callback(recorder("late"))  # after completion: at once, in this thread
    assert calls[1] == ("late", job, threading.current_thread().name)
    assert job.cancel() is False

    # The pool survived the failing callback.
    assert pool.submit(lambda: 7).result(timeout=DEADLINE) == 7
    assert [c[0] for c in calls] == ["early", "late"]

    # Failed and cancelled jobs call back exactly once too.
    failed = pool.submit(_explode, "cb")
    failed.add_done_callback(recorder("failed"))
    assert failed.wait(DEADLINE)
    assert wait_for(lambda: len(calls) == 3)
    running = pool.submit(jobs.sleep, 60)
    running.add_done_callback(recorder("cancelled"))
    assert wait_for(lambda: running.state is JobState.RUNNING)
    running.cancel()
    running.cancel()
    assert running.wait(DEADLINE)
    assert wait_for(lambda: len(calls) == 4)
    assert [c[0] for c in calls] == ["early", "late", "failed", "cancelled"]


def test_snapshot_and_listings_are_copies(pools: Callable[..., JobPool], tmp_path: Path) -> None:
    pool = pools(1)
    release = threading.Event()
    job = pool.submit(block_until, release, log=tmp_path / "s.log", name="snap", kind="launch")
    assert wait_for(lambda: job.state is JobState.RUNNING)

    snap = job.snapshot()
    assert snap["id"] == job.id and snap["name"] == "snap" and snap["kind"] == "launch"
    assert snap["state"] == "running" and snap["log"] == str(tmp_path / "s.log")
    assert snap["started_at"] is not None and snap["ended_at"] is None and snap["error"] is None
    snap["state"] = "tampered"
    snap.clear()
    assert job.snapshot()["state"] == "running"
    assert job.snapshot() is not job.snapshot()
    json.dumps(job.snapshot())  # plain values only

    listed = pool.jobs()
    assert listed == [job]
    listed.clear()
    assert pool.jobs() == [job]
    stats = pool.stats()
    stats["launch"]["limit"] = 99
    assert pool.stats()["launch"]["limit"] == 1

    release.set()
    assert job.wait(DEADLINE)
    assert wait_for(lambda: pool.jobs() == [])
    final = job.snapshot()
    assert final["state"] == "succeeded" and final["ended_at"] >= final["started_at"]


def test_concurrent_readers_while_jobs_churn(pools: Callable[..., JobPool]) -> None:
    """Snapshots, listings and stats taken while workers add and remove jobs never raise."""
    pool = pools(4, {"launch": 2})
    stop = threading.Event()
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            while not stop.is_set():
                for job in pool.jobs():
                    job.snapshot()
                pool.stats()
        except BaseException as exc:
            errors.append(exc)

    readers = [threading.Thread(target=reader) for _ in range(3)]
    for t in readers:
        t.start()
    try:
        submitted = [
            pool.submit(lambda i=i: i, kind=("launch", "teardown")[i % 2]) for i in range(500)
        ]
        for i, job in enumerate(submitted):
            assert job.result(timeout=DEADLINE) == i
    finally:
        stop.set()
        for t in readers:
            t.join(DEADLINE)
    assert errors == []


# -- shutdown ----------------------------------------------------------------------------------


def test_shutdown_cancels_everything_and_leaves_nothing_behind(
    pools: Callable[..., JobPool], marker: str, tmp_path: Path
) -> None:
    threads_before = set(threading.enumerate())
    pool = pools(2, {"launch": 1})
    never = threading.Event()
    sleeping = threading.Event()

    def launch() -> None:
        jobs.run_command(["sh", "-c", GROUP_SCRIPT, marker])

    def waiter() -> None:
        sleeping.set()
        jobs.sleep(60)

    running_cmd = pool.submit(launch, kind="launch", log=tmp_path / "launch.log")
    pending = pool.submit(never.set, kind="launch")
    running_sleep = pool.submit(waiter, kind="teardown")
    members = wait_for_group(marker, 3)
    assert sleeping.wait(DEADLINE)
    assert pending.state is JobState.PENDING
    assert corral_threads(threads_before)

    t0 = time.monotonic()
    assert pool.shutdown(cancel_pending=True, timeout=DEADLINE) is True
    assert time.monotonic() - t0 < 3.0
    for job in (running_cmd, pending, running_sleep):
        assert job.done() and job.state is JobState.CANCELLED, job
    assert not never.is_set()
    assert pending.started_at is None
    assert all(dead(m) for m in members)
    mine = {m.pid for m in members}
    leftovers = [
        p.pid for p in psutil.Process().children(recursive=True) if p.pid in mine and not dead(p)
    ]
    assert leftovers == []
    assert leader_with(marker) is None
    assert corral_threads(threads_before) == []
    assert pool.jobs() == []

    with pytest.raises(RuntimeError):
        pool.submit(lambda: None)
    with pytest.raises(RuntimeError):
        pool.submit(lambda: None, kind="brand-new-kind")
    assert pool.shutdown(timeout=1.0) is True  # idempotent


def test_shutdown_without_cancel_still_kills_commands_at_deadline(
    pools: Callable[..., JobPool], marker: str, tmp_path: Path
) -> None:
    threads_before = set(threading.enumerate())
    pool = pools(1)

    def launch() -> None:
        jobs.run_command(["sh", "-c", GROUP_SCRIPT, marker])

    job = pool.submit(launch, log=tmp_path / "l.log")
    members = wait_for_group(marker, 3)
    pool.shutdown(cancel_running=False, timeout=0.3)
    # No child outlives the pool: the command was killed at the deadline, so the job ends.
    assert all(dead(m) for m in members)
    assert job.wait(DEADLINE)
    assert job.state is JobState.FAILED
    exc = job.exception()
    assert isinstance(exc, CommandFailed) and exc.returncode == -signal.SIGTERM
    assert wait_for(lambda: corral_threads(threads_before) == [])


def test_shutdown_without_cancel_pending_drains_queue(pools: Callable[..., JobPool]) -> None:
    pool = pools(1)
    release = threading.Event()
    ran: list[int] = []
    first = pool.submit(block_until, release)
    rest = [pool.submit(ran.append, i) for i in range(3)]
    assert wait_for(lambda: first.state is JobState.RUNNING)
    release.set()
    assert pool.shutdown(cancel_pending=False, cancel_running=False, timeout=DEADLINE)
    assert ran == [0, 1, 2]
    assert all(j.state is JobState.SUCCEEDED for j in [first, *rest])


def test_submit_racing_shutdown_runs_nothing_after_shutdown(
    pools: Callable[..., JobPool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submit() caught mid-way by a shutdown() in another thread: either it is refused, or the
    shutdown sees its job. No job may run, and no worker start, after shutdown() returned True."""
    threads_before = set(threading.enumerate())
    pool = pools(1)
    ran = threading.Event()
    at_return: dict[str, Any] = {}
    original = Job.add_done_callback

    def shut_down() -> None:
        ok = pool.shutdown(cancel_pending=False, cancel_running=False, timeout=2.0)
        at_return.update(ok=ok, ran=ran.is_set(), threads=corral_threads(threads_before))

    def racing_add_done_callback(self: Job, fn: Callable[[Job], object]) -> None:
        if getattr(fn, "__self__", None) is pool and not at_return:
            # White-box: submit() registers the pool's bookkeeping callback; another thread
            # shuts the pool down right then.
            t = threading.Thread(target=shut_down)
            t.start()
            t.join(0.5)  # a correct submit() may hold a lock that makes shutdown() wait
        original(self, fn)

    monkeypatch.setattr(Job, "add_done_callback", racing_add_done_callback)
    try:
        job: Job | None = pool.submit(ran.set)
    except RuntimeError:
        job = None
    assert wait_for(lambda: bool(at_return)), "shutdown() never returned"
    if job is not None:
        assert job.wait(DEADLINE)
    assert at_return["ok"] is True
    assert at_return["threads"] == []
    assert ran.is_set() == at_return["ran"], "a job ran after shutdown() returned"
    assert wait_for(lambda: corral_threads(threads_before) == [])
