"""corral.procfs: what /proc says about real processes, and stopping whole process groups."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from corral import procfs

DEADLINE = 10.0

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs procfs")


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts, each in a session of its own; killed and reaped at the end."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(DEADLINE)


def spawn(procs: list[subprocess.Popen[bytes]], argv: list[str]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(argv, start_new_session=True)
    procs.append(proc)
    return proc


def test_stat_is_read_past_a_command_name_with_spaces_and_parentheses(
    tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    sleep = shutil.which("sleep")
    assert sleep is not None
    odd = tmp_path / "x) (y z"
    shutil.copy(sleep, odd)
    proc = spawn(started, [str(odd), "60"])
    wait_until(lambda: Path(f"/proc/{proc.pid}/comm").read_text().strip() == odd.name, "exec")
    # Just after exec it may still be running or in disk sleep (its pages loading on a busy
    # machine); once in its sleep, the state read past the odd name is S.
    wait_until(lambda: (procfs.state_and_group(proc.pid) or (b"",))[0] == b"S", "asleep")
    state = procfs.state_and_group(proc.pid)
    assert state is not None
    assert state[1] == proc.pid  # its own session, so its own group
    assert state[0] == b"S"
    ticks = procfs.start_ticks(proc.pid)
    assert ticks is not None and ticks == procfs.start_ticks(proc.pid)
    mine = procfs.start_ticks(os.getpid())
    assert mine is not None and ticks >= mine  # started after this test process


def test_gone_process_reads_as_none(started: list[subprocess.Popen[bytes]]) -> None:
    proc = spawn(started, ["sh", "-c", "exit 0"])
    proc.wait(DEADLINE)
    assert procfs.state_and_group(proc.pid) is None
    assert procfs.start_ticks(proc.pid) is None


def test_a_group_of_zombies_is_gone(started: list[subprocess.Popen[bytes]]) -> None:
    """An exited leader that nobody reaped yet keeps killpg(0) succeeding; it is dead all the
    same, so the group is not alive and stopping it returns at once."""
    proc = spawn(started, ["sh", "-c", "exit 0"])
    wait_until(lambda: procfs.state_and_group(proc.pid) == (b"Z", proc.pid), "a zombie")
    assert procfs.only_zombies(proc.pid)
    assert not procfs.group_alive(proc.pid)
    assert procfs.terminate_process_group(proc.pid, grace=DEADLINE) is True


def test_terminate_process_group_of_gone_group_is_true() -> None:
    proc = subprocess.Popen(["sh", "-c", "exit 0"], start_new_session=True)
    proc.wait(DEADLINE)
    assert procfs.terminate_process_group(proc.pid, grace=0.1) is True


def test_a_group_that_ignores_term_is_killed_after_the_grace(
    started: list[subprocess.Popen[bytes]],
) -> None:
    script = "trap '' TERM; sleep 60 & sleep 60 & echo ready; wait"
    proc = subprocess.Popen(["sh", "-c", script], start_new_session=True, stdout=subprocess.PIPE)
    started.append(proc)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    assert procfs.group_alive(proc.pid)
    began = time.monotonic()
    assert procfs.terminate_process_group(proc.pid, grace=0.3, reap=proc.poll) is True
    assert time.monotonic() - began >= 0.3  # TERM was ignored: KILL came after the grace
    assert proc.wait(DEADLINE) == -signal.SIGKILL
    assert not procfs.group_alive(proc.pid)


def test_groups_never_signalled_whole() -> None:
    assert not procfs.safe_group(1)
    assert not procfs.safe_group(os.getpgrp())
    assert not procfs.safe_group(0)


def test_boot_id_is_stable() -> None:
    first = procfs.boot_id()
    assert first == procfs.boot_id()
    if sys.platform == "linux":
        assert first is not None and len(first) >= 32
