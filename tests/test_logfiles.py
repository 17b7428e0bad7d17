"""The size cap on replica logs (corral.logfiles), on real files, and end to end.

Unit: a log over the cap is copied to ``.1`` and emptied in place; a writer holding it open
with O_APPEND goes on at offset 0 (no hole, no reopen); 0 disables the cap; a copy that cannot
be written still empties the log; a writer appending while the log is rotated over and over
loses whole writes at most, never gets its lines cut, reordered or duplicated.

End to end: a daemon with ``CORRAL_LOG_MAX_BYTES`` set small, an app writing ~20 MiB: its log
ends under the cap, the previous generation in ``.1``, and ``corral logs`` (following) keeps
printing the app's new lines across the rotations, in order, never a line from before again.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import REPO, CorralHome, wait_for, write_spec

from corral.logcap import HOME_LOG_CAP_PERIOD, LOG_CAP_PERIOD
from corral.logfiles import (
    backup_of,
    parse_max_bytes,
    rotate_all,
    rotate_if_over,
    rotation_mark,
)

# -- unit ---------------------------------------------------------------------------------------


def append_fd(path: Path) -> int:
    """A descriptor like the one a local replica gets for its log (open(path, "ab"))."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)


def test_rotates_only_over_the_cap(tmp_path: Path) -> None:
    log = tmp_path / "replica_1.log"
    log.write_bytes(b"a" * 100)
    assert rotate_if_over(log, 100) is None  # at the cap: not over it
    assert log.read_bytes() == b"a" * 100 and not backup_of(log).exists()

    log.write_bytes(b"b" * 101)
    done = rotate_if_over(log, 100)
    assert done is not None and done.error is None and done.kept == 101
    assert backup_of(log) == tmp_path / "replica_1.log.1"
    assert backup_of(log).read_bytes() == b"b" * 101
    assert log.read_bytes() == b""
    assert not (tmp_path / "replica_1.log.1.tmp").exists()

    # The next rotation replaces the one generation kept.
    log.write_bytes(b"c" * 150)
    assert rotate_if_over(log, 100) is not None
    assert backup_of(log).read_bytes() == b"c" * 150
    assert sorted(p.name for p in tmp_path.iterdir()) == ["replica_1.log", "replica_1.log.1"]


def test_append_writer_goes_on_at_zero(tmp_path: Path) -> None:
    log = tmp_path / "replica_2.log"
    fd = append_fd(log)
    try:
        os.write(fd, b"old line\n" * 20)
        mark = rotation_mark(log)
        assert rotate_if_over(log, 64) is not None
        assert rotation_mark(log) != mark  # what a follower watches for
        os.write(fd, b"new line\n")
    finally:
        os.close(fd)
    # No hole of zeros up to the old offset: the write landed at the new end, offset 0.
    assert log.read_bytes() == b"new line\n"
    assert backup_of(log).read_bytes() == b"old line\n" * 20


def test_zero_disables(tmp_path: Path) -> None:
    log = tmp_path / "replica_3.log"
    log.write_bytes(b"z" * 10_000)
    assert rotate_if_over(log, 0) is None
    assert rotate_all([log, tmp_path / "missing.log"], 0) == []
    assert log.stat().st_size == 10_000 and not backup_of(log).exists()
    assert rotate_if_over(tmp_path / "missing.log", 10) is None


def test_copy_failure_still_empties_the_log(tmp_path: Path) -> None:
    """The cap is there so a flood cannot fill the disk: a copy that cannot be written (here
    its temporary name is taken by a directory) drops the old content rather than keep it."""
    log = tmp_path / "replica_4.log"
    log.write_bytes(b"q" * 500)
    (tmp_path / "replica_4.log.1.tmp").mkdir()
    [done] = rotate_all([log], 100)
    assert not isinstance(done, str) and done.error is not None and done.kept == 0
    assert log.read_bytes() == b""


def test_env_values() -> None:
    assert parse_max_bytes(None) == 64 << 20
    assert parse_max_bytes("") == 64 << 20
    assert parse_max_bytes("0") == 0
    assert parse_max_bytes("1048576") == 1 << 20
    assert parse_max_bytes("64M") == parse_max_bytes("64MiB") == 64 << 20
    assert parse_max_bytes("2g") == 2 << 30
    for bad in ("-1", "1.5M", "lots", "M", "١٢"):
        with pytest.raises(ValueError):
            parse_max_bytes(bad)


# The busy writer of the next test: a process of its own, as a replica is. A thread of the test's
# process shared its GIL with the rotation, which then waited out the writer's time slices
# between its copy and its truncation and lost more than a replica's log does (over half the
# lines in one CI run on a loaded machine). It appends numbered lines, 10 a write, until the
# stop file exists, then prints how many it wrote.
BUSY_WRITER = textwrap.dedent(
    """
    import os, sys
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    n = 0
    while n < 10**6 and not os.path.exists(sys.argv[2]):
        os.write(fd, b"".join(b"line %06d %s\\n" % (i, b"x" * 40) for i in range(n, n + 10)))
        n += 10
    print(n)
    """
)


def test_rotating_under_a_busy_writer(tmp_path: Path) -> None:
    """A process appends numbered lines, many per write, while the log is rotated again and
    again. Every generation copied plus the last one, read in order: whole lines only, numbers
    strictly increasing (nothing read twice, nothing out of order), a generation copied to .1
    may end mid-line; what is missing went in the window between the copy's end and the
    truncation."""
    log = tmp_path / "replica_5.log"
    os.close(append_fd(log))
    stop = tmp_path / "stop"
    writer = subprocess.Popen(
        [sys.executable, "-c", BUSY_WRITER, str(log), str(stop)], stdout=subprocess.PIPE
    )
    generations: list[bytes] = []
    rotations = 0
    try:
        deadline = time.monotonic() + 30
        while rotations < 20 and writer.poll() is None and time.monotonic() < deadline:
            if rotate_if_over(log, 4096) is not None:
                rotations += 1
                generations.append(backup_of(log).read_bytes())
    finally:
        stop.touch()
        out, _ = writer.communicate(timeout=30)
    total = int(out)
    generations.append(log.read_bytes())
    numbers: list[int] = []
    for n, generation in enumerate(generations):
        lines = generation.decode().split("\n")
        tail = lines.pop()  # "" when the generation ends with a whole line
        if n == len(generations) - 1:
            assert tail == "", f"the live log ends mid-line: {tail!r}"
        else:
            # A write still in progress when the copy met the end is in .1 only in part (a
            # read is not atomic against a write); its rest went with the truncation.
            assert re.fullmatch(r"(l(i(n(e( (\d{1,6}( x{0,40})?)?)?)?)?)?)?", tail), tail
        assert all(re.fullmatch(r"line \d{6} x{40}", line) for line in lines), "a cut line"
        numbers += [int(line.split()[1]) for line in lines]
    assert numbers == sorted(set(numbers)), "a line read twice or out of order"
    assert rotations >= 2, rotations
    assert total - len(numbers) < total // 2, (total - len(numbers), rotations)


# -- end to end -----------------------------------------------------------------------------------

CAP = 4 << 20
BURST = 5 << 20  # over the cap: each burst is rotated away before the next one
BURSTS = 4

CHATTER = textwrap.dedent(
    """
    import os, sys, threading, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", int(os.environ["PORT"])), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    go, cap, burst, bursts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    seq = 0

    def lines(texts):
        global seq
        out = []
        for text in texts:
            out.append(f"seq {seq} {text}\\n".encode())
            seq += 1
        os.write(1, b"".join(out))  # one O_APPEND write: lost whole or kept whole

    def wait(predicate, seconds):
        deadline = time.monotonic() + seconds
        while not predicate() and time.monotonic() < deadline:
            time.sleep(0.05)

    lines(["waiting"])
    wait(lambda: os.path.exists(go), 60)
    for n in range(1, bursts + 1):
        written = 0
        while written < burst:
            lines(["x" * 100] * 500)
            written += 500 * 110
        # Paced by the cap itself: the next burst once corral emptied the log.
        wait(lambda: os.fstat(1).st_size < cap, 60)
        lines([f"rotated {n}"])
    lines(["FLOOD DONE"])
    while True:
        lines(["tick"])
        time.sleep(0.05)
    """
)

LINE = re.compile(r"seq (\d+) (x{100}|waiting|rotated \d+|FLOOD DONE|tick)")
# The start of a line, ended early by the API where the follower restarted after a rotation.
CUT = re.compile(r"s|se|seq|seq \d+|seq \d+ (x{0,100}|[a-zA-Z ]*\d*)")


class Follower:
    """``corral logs NAME ID`` (following) with its output collected on a thread. Not
    conftest.LineReader: that one rescans every line per wait, too slow for 20 MiB of lines."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self.texts: Counter[str] = Counter()  # how many whole lines of each kind so far
        assert proc.stdout is not None
        self._stdout = proc.stdout
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        for raw in iter(self._stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append(line)
            match = LINE.fullmatch(line)
            if match:
                self.texts[match.group(2)] += 1

    def wait(self, text: str, count: int, timeout: float) -> None:
        wait_for(lambda: self.texts[text] >= count, timeout, f"{count} x {text!r} followed")

    def stop(self) -> list[str]:
        self.proc.terminate()
        self.proc.wait(10)
        self._thread.join(10)
        return self.lines


@pytest.mark.timeout(150)
def test_flooding_replica_log_is_capped_and_followable(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    home = corral_home
    home.env["CORRAL_LOG_MAX_BYTES"] = str(CAP)
    home.start_daemon()
    app = tmp_path / "chatter.py"
    app.write_text(CHATTER)
    go = tmp_path / "go"
    run = f"exec {sys.executable} {app} {go} {CAP} {BURST} {BURSTS}"
    spec = write_spec(
        tmp_path / "chatter.yaml",
        f"name: chatter\nworkdir: {tmp_path}\nrun: {json.dumps(run)}\n"
        "service:\n  readiness_probe:\n    path: /\n    period_seconds: 0.2\n"
        "    initial_delay_seconds: 30\n  replicas: 1\n",
    )
    home.run("up", str(spec), timeout=90)
    svc = home.wait_replicas("chatter", 1, timeout=60)
    rid = svc["replicas"][0]["id"]
    logs = home.path / "services" / "chatter" / "logs"
    log = logs / f"replica_{rid}.log"  # files go by the id users see

    follower = Follower(home.popen("logs", "chatter", str(rid)))  # follows by default
    try:
        follower.wait("waiting", 1, timeout=30)
        go.touch()
        follower.wait("FLOOD DONE", 1, timeout=120)
        # New lines keep coming after the last rotation: nothing hangs on the emptied file.
        follower.wait("tick", 5, timeout=30)
    finally:
        seen = follower.stop()

    # On disk: the log back under the cap, the last generation in .1, far less than written.
    wait_for(lambda: log.stat().st_size <= CAP, 30, "the log to be rotated under the cap")
    backup = backup_of(log)
    assert backup.exists()
    assert backup.stat().st_size <= BURST + (1 << 20), backup.stat().st_size
    assert log.stat().st_size + backup.stat().st_size < BURST * BURSTS
    assert f"{log.name} over {CAP} bytes" in (logs / "controller.log").read_text()

    # What the follower printed: the app's lines in the app's order, none twice; a line cut
    # short only where the follower started over after a rotation.
    whole = [m for m in map(LINE.fullmatch, seen) if m]
    cut = [line for line in seen if not LINE.fullmatch(line)]
    assert all(CUT.fullmatch(line) for line in cut), [line[:120] for line in cut][:5]
    assert len(cut) <= BURSTS, [line[:120] for line in cut]
    numbers = [int(m.group(1)) for m in whole]
    back = [(a, b) for a, b in itertools.pairwise(numbers) if b <= a]
    assert not back, f"the follower went back or repeated lines: {back[:5]}"
    texts = {m.group(2) for m in whole}
    assert f"rotated {BURSTS}" in texts and "FLOOD DONE" in texts, sorted(texts)[:10]
    home.run("down", "chatter", timeout=60)


@pytest.mark.timeout(90)
def test_the_daemons_and_the_workers_logs_are_capped_too(corral_home: CorralHome) -> None:
    """`daemon.log` and the balancer workers' logs grow with the home's events for as long as
    it lives (the workers across daemons); they had no cap. Grown past it, each is moved to
    `.1` and emptied like a replica's log, within a check period (10 s)."""
    home = corral_home
    cap = 64 * 1024
    home.env["CORRAL_LOG_MAX_BYTES"] = str(cap)
    home.start_daemon()
    logs = [home.path / "daemon.log", home.path / "dataplane" / "worker-0.log"]
    wait_for(lambda: all(p.exists() for p in logs), 30, "the daemon's and a worker's logs")
    for path in logs:  # weeks of events, at once
        with open(path, "ab") as f:
            f.write(b"an old line of the log\n" * 4000)

    def capped() -> bool:
        backups = [backup_of(p) for p in logs]
        return all(b.exists() and b.stat().st_size > cap for b in backups) and all(
            p.stat().st_size < cap for p in logs
        )

    wait_for(capped, 40, "both logs rotated", interval=0.5)


def test_the_reliability_page_says_which_logs_the_cap_covers_and_when() -> None:
    """docs/reliability.md's limits said `daemon.log` was not capped long after the test above
    showed it is: the page names the periods the daemon checks each kind of log at."""
    text = " ".join((REPO / "docs" / "reliability.md").read_text().split())
    assert "`daemon.log` is not capped" not in text
    assert f"every {LOG_CAP_PERIOD:g} s for a service's logs" in text, LOG_CAP_PERIOD
    assert f"every {HOME_LOG_CAP_PERIOD:g} s for `daemon.log` and the balancer" in text
