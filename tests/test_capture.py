"""Tests for corral.capture: per-thread/per-task routing of sys.stdout/sys.stderr.

Each numbered section follows docs/reference output-routing.md. In-process tests install the
routers over StringIO "originals" (the fallbacks), so what bypassed routing and what got reported
on the original stderr can be read back. Behaviour that needs the process's real descriptors
(exit, fork, os.write, faulthandler, warnings' process-wide registry) runs in a child interpreter.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import contextvars
import errno
import fcntl
import functools
import gc
import io
import logging
import os
import re
import subprocess
import sys
import termios
import textwrap
import threading
import time
import traceback
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from corral import capture

SRC = Path(__file__).resolve().parents[1] / "src"
REPORT = "corral.capture: cannot write to"
F_GETPIPE_SZ = 1032  # Linux fcntl command


# --------------------------------------------------------------------------------------------
# helpers and fixtures


@dataclass
class Std:
    """The streams that were sys.stdout/sys.stderr at install time (the fallbacks)."""

    out: io.StringIO
    err: io.StringIO

    def reports(self) -> int:
        return self.err.getvalue().count(REPORT)


class TtyStringIO(io.StringIO):
    def isatty(self) -> bool:
        return True


def start_clean() -> None:
    """Undo an installation left by another test module (jobs install the routers and keep
    them), so that this test's install() takes ITS streams as the originals."""
    capture.uninstall()
    assert not capture.installed()


@contextlib.contextmanager
def installed_over(out: io.StringIO, err: io.StringIO) -> Iterator[Std]:
    start_clean()
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    capture.install()
    try:
        yield Std(out, err)
    finally:
        capture.uninstall()
        sys.stdout, sys.stderr = saved


@pytest.fixture
def std() -> Std:
    """The StringIOs a test's ``@routed``/``@swapped`` decorator puts in as the originals."""
    return Std(io.StringIO(), io.StringIO())


def _with_streams(install: bool) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Swap in ``std`` as sys.stdout/sys.stderr (and install the routers) around the test.

    Done inside the test call, not in a fixture: pytest's own capture re-assigns sys.stdout and
    sys.stderr when the call phase starts, after fixtures ran.
    """

    def decorate(fn: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            std: Std = kwargs["std"]
            start_clean()
            saved = sys.stdout, sys.stderr
            sys.stdout, sys.stderr = std.out, std.err
            try:
                if not install:
                    fn(*args, **kwargs)
                    return
                capture.install()
                assert capture.installed()
                assert capture.current() is None
                try:
                    fn(*args, **kwargs)
                finally:
                    capture.uninstall()
                assert sys.stdout is std.out
                assert sys.stderr is std.err
            finally:
                sys.stdout, sys.stderr = saved

        return wrapper

    return decorate


routed = _with_streams(install=True)
swapped = _with_streams(install=False)


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def wait_until(pred: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


class Recorder:
    """Run callables on threads and keep any exception they raise."""

    def __init__(self) -> None:
        self.errors: list[BaseException] = []

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., None]:
        def run(*args: Any, **kwargs: Any) -> None:
            try:
                fn(*args, **kwargs)
            except BaseException as exc:
                self.errors.append(exc)

        return run


def run_child(
    code: str, *args: str, timeout: float = 30.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHONPATH": str(SRC), **(env or {})}
    for name in ("PYTHONFAULTHANDLER", "PYTHONUNBUFFERED"):  # buffering is what is tested
        full_env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )


def pipe_available(fd: int) -> int:
    buf = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, buf)
    return buf[0]


# --------------------------------------------------------------------------------------------
# Routing (1-6)


@swapped
def test_install_and_uninstall_swap_the_standard_streams(std: Std) -> None:
    capture.install()
    try:
        assert capture.installed()
        assert sys.stdout is not std.out and sys.stderr is not std.err
        capture.install()  # idempotent
        assert capture.installed()
        print("to original")
        print("to original err", file=sys.stderr)
    finally:
        capture.uninstall()
    assert not capture.installed()
    assert sys.stdout is std.out and sys.stderr is std.err
    capture.uninstall()  # idempotent
    assert std.out.getvalue() == "to original\n"
    assert std.err.getvalue() == "to original err\n"


@routed
def test_routes_nest_and_unwind_in_order(std: Std, tmp_path: Path) -> None:
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    with capture.to(a):
        print(0)
        with capture.to(b):
            print(1)
            print("1err", file=sys.stderr)
        print(2)
        print("2err", file=sys.stderr)
    print(3)
    assert read(a) == "0\n2\n2err\n"
    assert read(b) == "1\n1err\n"
    assert std.out.getvalue() == "3\n"
    assert std.err.getvalue() == ""


@routed
def test_nested_routes_to_text_streams(std: Std) -> None:
    a, b = io.StringIO(), io.StringIO()
    with capture.to(a) as got_a:
        assert got_a is a
        assert capture.current() is a
        with capture.to(b) as got_b:
            assert got_b is b
            assert capture.current() is b
            print("inner")
        assert capture.current() is a
        print("outer")
    assert capture.current() is None
    assert a.getvalue() == "outer\n"
    assert b.getvalue() == "inner\n"
    assert not a.closed and not b.closed  # streams are flushed, not closed


@routed
def test_current_returns_the_file_of_a_path_route(std: Std, tmp_path: Path) -> None:
    with capture.to(tmp_path / "sub" / "dir" / "job.log") as f:  # parents are created
        assert capture.current() is f
        assert f.encoding == "utf-8"
    assert f.closed
    assert capture.current() is None


@routed
def test_route_to_sys_stdout_means_the_current_route(std: Std, tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    with capture.to(log):
        with capture.to(sys.stdout):  # "whatever stdout is now": the job's log, no loop
            print("inner")
        print("outer")
    with capture.to(sys.stdout):  # outside any route: the original
        print("free")
    assert read(log) == "inner\nouter\n"
    assert std.out.getvalue() == "free\n"


@routed
def test_entering_a_route_with_nothing_to_write_to_does_not_leak(std: Std) -> None:
    outer = io.StringIO()
    with capture.to(outer):
        with pytest.raises(TypeError), capture.to(None):  # type: ignore[arg-type]
            pass
        assert capture.current() is outer
        print("still outer")
    assert outer.getvalue() == "still outer\n"
    assert capture.current() is None


@routed
def test_pool_thread_reuse_does_not_leak_a_forgotten_route(std: Std) -> None:
    leaked = io.StringIO()

    def sloppy_job() -> int:
        capture._current.set(capture._make_target(leaked))  # sets a route, never resets
        print("sloppy")
        return threading.get_ident()

    def next_job() -> tuple[int, Any]:
        print("next")
        return threading.get_ident(), capture.current()

    with ThreadPoolExecutor(max_workers=1) as pool:
        # Each job in a fresh context: the next job on the SAME thread sees no route.
        ident1 = pool.submit(contextvars.Context().run, sloppy_job).result()
        ident2, seen = pool.submit(contextvars.Context().run, next_job).result()
        assert ident1 == ident2
        assert seen is None
        # The premise: without a fresh context the worker's context carries the route over.
        pool.submit(sloppy_job).result()
        _, seen = pool.submit(next_job).result()
        assert seen is leaked
    assert leaked.getvalue() == "sloppy\nsloppy\nnext\n"
    assert std.out.getvalue() == "next\n"


@routed
def test_pool_thread_reuse_capture_to_resets_without_fresh_context(
    std: Std, tmp_path: Path
) -> None:
    def job(i: int, fail: bool) -> int:
        with capture.to(tmp_path / f"{i}.log"):
            print(f"job {i}")
            if fail:
                raise RuntimeError("boom")
        return threading.get_ident()

    def probe() -> tuple[int, Any]:
        print("probe")
        return threading.get_ident(), capture.current()

    with ThreadPoolExecutor(max_workers=1) as pool:
        ident = pool.submit(job, 0, False).result()
        assert pool.submit(probe).result() == (ident, None)
        with pytest.raises(RuntimeError):
            pool.submit(job, 1, True).result()
        assert pool.submit(probe).result() == (ident, None)
    assert read(tmp_path / "0.log") == "job 0\n"
    assert read(tmp_path / "1.log") == "job 1\n"
    assert std.out.getvalue() == "probe\nprobe\n"


@routed
def test_pool_jobs_submitted_through_wrap_do_not_leak(std: Std) -> None:
    leaked, submitter = io.StringIO(), io.StringIO()

    def sloppy_job() -> None:
        capture._current.set(capture._make_target(leaked))
        print("sloppy")

    def next_job() -> Any:
        print("next")
        return capture.current()

    with ThreadPoolExecutor(max_workers=1) as pool, capture.to(submitter):
        pool.submit(capture.wrap(sloppy_job)).result()
        assert pool.submit(capture.wrap(next_job)).result() is submitter
    assert leaked.getvalue() == "sloppy\n"
    assert submitter.getvalue() == "next\n"


@routed
def test_asyncio_tasks_on_one_thread_keep_their_own_routes(std: Std, tmp_path: Path) -> None:
    order: list[str] = []

    async def job(name: str) -> None:
        with capture.to(tmp_path / f"{name}.log"):
            for i in range(50):
                print(f"{name} {i}")
                order.append(name)
                await asyncio.sleep(0)
                with capture.to(tmp_path / f"{name}-inner.log"):
                    print(f"{name} inner {i}")
                    await asyncio.sleep(0)

    async def free() -> None:
        for i in range(50):
            print(f"free {i}")
            order.append("free")
            await asyncio.sleep(0)

    async def main() -> None:
        await asyncio.gather(job("a"), job("b"), free())

    asyncio.run(main())
    # The tasks really interleaved on this one thread.
    assert order[:3] == ["a", "b", "free"]
    for name in ("a", "b"):
        assert read(tmp_path / f"{name}.log") == "".join(f"{name} {i}\n" for i in range(50))
        assert read(tmp_path / f"{name}-inner.log") == "".join(
            f"{name} inner {i}\n" for i in range(50)
        )
    assert std.out.getvalue() == "".join(f"free {i}\n" for i in range(50))


@pytest.mark.skipif(
    bool(getattr(sys.flags, "thread_inherit_context", 0)),
    reason="plain threads inherit the context on this interpreter",
)
@routed
def test_plain_thread_started_in_a_route_falls_back(std: Std, tmp_path: Path) -> None:
    rec = Recorder()
    seen: list[Any] = []

    def helper() -> None:
        seen.append(capture.current())
        print("from plain thread")

    log = tmp_path / "job.log"
    with capture.to(log):
        th = threading.Thread(target=rec(helper))
        th.start()
        th.join(10)
        print("from job")
    assert not rec.errors
    assert seen == [None]
    assert read(log) == "from job\n"
    assert std.out.getvalue() == "from plain thread\n"


@routed
def test_new_threads_never_see_a_stale_route(std: Std) -> None:
    rec = Recorder()
    seen: list[Any] = []
    idents: list[int] = []
    sink = io.StringIO()

    def short_lived() -> None:
        idents.append(threading.get_ident())
        seen.append(capture.current())
        print("fallback")
        capture._current.set(capture._make_target(sink))  # dies with a route set
        print("sink")

    for _ in range(200):
        th = threading.Thread(target=rec(short_lived))
        th.start()
        th.join(10)
    assert not rec.errors
    assert seen == [None] * 200
    assert std.out.getvalue() == "fallback\n" * 200
    assert sink.getvalue() == "sink\n" * 200
    # Thread idents are reused (that is what makes per-ident routing tables dangerous).
    assert len(set(idents)) < len(idents)


@routed
def test_capture_thread_carries_the_route_into_the_thread(std: Std, tmp_path: Path) -> None:
    rec = Recorder()
    log, own = tmp_path / "job.log", tmp_path / "helper.log"

    def helper() -> None:
        print("helper")
        with capture.to(own):  # its own nested route does not touch the starter's
            print("helper own")
        print("helper again")

    with capture.to(log):
        th = capture.Thread(target=rec(helper), name="helper")
        th.start()
        th.join(10)
        print("job")
    th2 = capture.Thread(target=rec(lambda: print("outside")))
    th2.start()
    th2.join(10)
    assert not rec.errors
    assert th.name == "helper"
    assert read(log) == "helper\nhelper again\njob\n"
    assert read(own) == "helper own\n"
    assert std.out.getvalue() == "outside\n"


@routed
def test_capture_thread_subclass_run_override_is_routed(std: Std) -> None:
    class Worker(capture.Thread):
        def run(self) -> None:
            print("subclass run")

    buf = io.StringIO()
    with capture.to(buf):
        w = Worker()
        w.start()
        w.join(10)
    assert buf.getvalue() == "subclass run\n"


@routed
def test_wrap_carries_the_route_args_and_result(std: Std) -> None:
    buf = io.StringIO()

    def job(a: int, *, b: int) -> int:
        print(f"job {a} {b}")
        return a + b

    with capture.to(buf), ThreadPoolExecutor(max_workers=2) as pool:
        wrapped = capture.wrap(job)
        assert pool.submit(wrapped, 1, b=2).result() == 3
    assert wrapped.__wrapped__ is job  # type: ignore[attr-defined]
    assert wrapped(3, b=4) == 7  # after the route ended: like any late helper, falls back
    assert buf.getvalue() == "job 1 2\n"
    assert std.out.getvalue() == "job 3 4\n"


@routed
def test_wrap_callable_may_run_in_several_threads_at_once(std: Std) -> None:
    rec = Recorder()
    buf = io.StringIO()
    barrier = threading.Barrier(4, timeout=10)
    results: list[Any] = []

    def job(i: int) -> None:
        own = io.StringIO()
        capture._current.set(capture._make_target(own))  # in its own copy of the context
        barrier.wait()  # all four are inside the same wrapped context at once
        print(f"own {i}")
        results.append(own)

    with capture.to(buf):
        wrapped = capture.wrap(job)
        threads = [threading.Thread(target=rec(wrapped), args=(i,)) for i in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(10)
        print("starter")
    assert not rec.errors
    assert sorted(s.getvalue() for s in results) == [f"own {i}\n" for i in range(4)]
    assert buf.getvalue() == "starter\n"


@routed
def test_thread_outliving_its_job_writes_to_the_fallback(std: Std, tmp_path: Path) -> None:
    rec = Recorder()
    go = threading.Event()
    seen: dict[str, Any] = {}

    def helper() -> None:
        assert go.wait(10)
        print("late print")
        print("late err", file=sys.stderr)
        sys.stdout.writelines(["late lines\n"])
        sys.stdout.buffer.write(b"late bytes\n")
        sys.stdout.flush()
        seen["current"] = capture.current()
        seen["closed"] = sys.stdout.closed
        seen["isatty"] = sys.stdout.isatty()

    log = tmp_path / "job.log"
    with capture.to(log) as f:
        th = capture.Thread(target=rec(helper))
        th.start()
        print("job")
    assert f.closed
    go.set()
    th.join(10)
    assert not rec.errors
    assert seen == {"current": None, "closed": False, "isatty": False}
    assert read(log) == "job\n"
    assert std.out.getvalue() == "late print\nlate lines\nlate bytes\n"
    assert std.err.getvalue() == "late err\n"  # and no failure report: never hit the file


@routed
def test_thread_writing_while_its_route_ends_never_hits_the_closed_file(
    std: Std, tmp_path: Path
) -> None:
    rec = Recorder()
    stop = threading.Event()
    written = [0]

    def helper() -> None:
        while not stop.is_set():
            print(f"<{written[0]}>")
            written[0] += 1

    log = tmp_path / "job.log"
    with capture.to(log):
        th = capture.Thread(target=rec(helper))
        th.start()
        wait_until(lambda: written[0] > 200, what="helper writing")
    ended_at = written[0]
    wait_until(lambda: written[0] > ended_at + 200, what="helper writing after the route")
    stop.set()
    th.join(10)
    assert not rec.errors
    assert std.reports() == 0
    in_log = [int(n) for n in re.findall(r"<(\d+)>", read(log))]
    in_fallback = [int(n) for n in re.findall(r"<(\d+)>", std.out.getvalue())]
    assert in_log + in_fallback == list(range(written[0]))
    assert in_log and in_fallback


# --------------------------------------------------------------------------------------------
# The stream surface (7-9)


@routed
def test_stream_surface_in_a_file_route(std: Std, tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    with capture.to(log) as f:
        out = sys.stdout
        assert out.isatty() is False
        assert out.fileno() == f.fileno()
        assert out.buffer.fileno() == f.fileno()
        assert out.encoding == "utf-8"
        assert out.errors == "backslashreplace"
        assert out.closed is False
        assert out.buffer.closed is False
        assert out.readable() is False
        assert out.writable() is True
        assert out.buffer.writable() is True
        assert out.line_buffering is True
        assert out.write("abc") == 3
        out.writelines(["l1\n", "l2\n"])
        assert out.buffer.write(b"bytes\n") == 6
        print("text")
        out.buffer.write(bytearray(b"b2 "))
        print("t2")
        out.buffer.writelines([b"m1 ", memoryview(b"m2\n")])
        out.write("pending text, ")  # still in the text layer's buffer
        out.buffer.write(b"then bytes\n")
        out.buffer.flush()
        out.flush()
        out.close()  # ignored: the router is shared by the whole process
        assert not f.closed
        print("still open")
    assert read(log) == (
        "abcl1\nl2\nbytes\ntext\nb2 t2\nm1 m2\npending text, then bytes\nstill open\n"
    )


@routed
def test_stream_surface_in_a_text_stream_route(std: Std) -> None:
    buf = io.StringIO()
    with capture.to(buf):
        assert sys.stdout.isatty() is False
        assert sys.stdout.encoding == "utf-8"
        assert sys.stdout.closed is False
        sys.stdout.write("a")
        sys.stdout.buffer.write("é€\n".encode())
        print("b")
        assert sys.stdout.getvalue() == "aé€\nb\n"  # rare attributes: the route's stream
    assert buf.getvalue() == "aé€\nb\n"


def test_isatty_is_false_for_file_routes_even_over_a_terminal(tmp_path: Path) -> None:
    with installed_over(TtyStringIO(), TtyStringIO()):
        assert sys.stdout.isatty() is True  # the fallback's answer
        assert sys.stderr.isatty() is True
        with capture.to(tmp_path / "job.log"):
            assert sys.stdout.isatty() is False
            assert sys.stderr.isatty() is False
            assert sys.stdout.buffer.isatty() is False
            with capture.to(TtyStringIO()):
                assert sys.stdout.isatty() is True
        assert sys.stdout.isatty() is True


def test_print_to_dunder_stdout_bypasses_and_c_level_output_is_not_routed(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    child = run_child(
        """
        import ctypes, os, subprocess, sys
        from corral import capture
        capture.install()
        with capture.to(sys.argv[1]):
            print("routed")
            print("escape", file=sys.__stdout__, flush=True)
            os.write(1, b"raw-fd\\n")
            os.write(2, b"raw-fd2\\n")
            subprocess.run([sys.executable, "-c", "print('inherited')"], check=True)
            libc = ctypes.CDLL(None)
            libc.puts(b"from-c")
            libc.fflush(None)
        """,
        str(log),
    )
    assert child.returncode == 0, child.stderr
    assert read(log) == "routed\n"
    assert child.stdout.splitlines() == ["escape", "raw-fd", "inherited", "from-c"]
    assert child.stderr == "raw-fd2\n"


# --------------------------------------------------------------------------------------------
# Bypasses and what corral does about them (10-15)


@swapped
def test_stream_handler_created_before_install_is_repointed(std: Std, tmp_path: Path) -> None:
    logger = logging.getLogger(f"corral-test-{uuid.uuid4().hex}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler = logging.StreamHandler()  # holds the original sys.stderr
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger.addHandler(handler)
    errors: list[Any] = []
    handler.handleError = errors.append  # type: ignore[method-assign]
    assert handler.stream is std.err
    log = tmp_path / "job.log"
    try:
        capture.install()
        try:
            assert handler.stream is sys.stderr  # the router
            with capture.to(log):
                logger.info("in job")
            logger.info("outside")
        finally:
            capture.uninstall()
        assert handler.stream is std.err
        logger.info("after uninstall")
    finally:
        logger.removeHandler(handler)
    assert not errors
    assert read(log) == "INFO in job\n"
    assert std.err.getvalue() == "INFO outside\nINFO after uninstall\n"


@swapped
def test_stream_handler_on_dunder_stderr_is_repointed_and_restored(std: Std) -> None:
    logger = logging.getLogger(f"corral-test-{uuid.uuid4().hex}")
    handler = logging.StreamHandler(sys.__stderr__)
    other = logging.StreamHandler(io.StringIO())
    logger.addHandler(handler)
    logger.addHandler(other)
    try:
        capture.install()
        try:
            assert handler.stream is sys.stderr
            assert isinstance(other.stream, io.StringIO)  # unrelated streams are left alone
        finally:
            capture.uninstall()
        assert handler.stream is sys.__stderr__
    finally:
        logger.removeHandler(handler)
        logger.removeHandler(other)


@swapped
def test_handler_created_while_installed_keeps_routing_after_uninstall(std: Std) -> None:
    logger = logging.getLogger(f"corral-test-{uuid.uuid4().hex}")
    logger.propagate = False
    capture.install()
    handler = logging.StreamHandler()  # holds the router
    logger.addHandler(handler)
    buf = io.StringIO()
    try:
        with capture.to(buf):
            capture.uninstall()
            logger.warning("after uninstall, still in the route")
        logger.warning("outside")
    finally:
        capture.uninstall()
        logger.removeHandler(handler)
    assert buf.getvalue() == "after uninstall, still in the route\n"
    assert std.err.getvalue() == "outside\n"


@routed
def test_run_in_a_file_route_keeps_order(std: Std, tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    child = "import sys; print('child out', flush=True); print('child err', file=sys.stderr)"
    with capture.to(log):
        print("before")
        sys.stdout.write("no newline yet ")
        assert capture.run([sys.executable, "-c", child]) == 0
        print("after")
    assert read(log) == "before\nno newline yet child out\nchild err\nafter\n"
    assert std.out.getvalue() == ""


@routed
def test_run_in_a_text_stream_route_pumps_in_order(std: Std) -> None:
    buf = io.StringIO()
    child = (
        "import sys\n"
        "for i in range(200): print(f'out {i}', flush=True)\n"
        "print('err line', file=sys.stderr, flush=True)\n"
    )
    with capture.to(buf):
        print("before")
        assert capture.run([sys.executable, "-c", child]) == 0
        print("after")
    text = buf.getvalue()
    assert text.startswith("before\n") and text.endswith("after\n")
    # The child's stdout and stderr come through two pipes and two pumps: relative to each other
    # they interleave at write boundaries (possibly between a line and its newline).
    assert text.count("err line") == 1
    lines = [ln for ln in text.replace("err line", "").splitlines() if ln]
    assert lines == ["before", *(f"out {i}" for i in range(200)), "after"]
    assert std.out.getvalue() == "" and std.err.getvalue() == ""


@routed
def test_pumped_multibyte_text_is_not_split(std: Std) -> None:
    buf = io.StringIO()
    child = "import sys; sys.stdout.buffer.write('€'.encode() * 100_000 + b'\\n')"
    with capture.to(buf):
        assert capture.run([sys.executable, "-c", child]) == 0
    assert buf.getvalue() == "€" * 100_000 + "\n"


@routed
def test_run_returns_only_after_all_child_output_is_pumped(std: Std) -> None:
    class SlowSink(io.StringIO):
        def write(self, s: str) -> int:
            time.sleep(0.03)  # a slow destination: the pump lags behind the child
            return super().write(s)

    sink = SlowSink()
    size = 512 * 1024
    code = f"import sys; sys.stdout.write('z' * {size}); sys.stdout.flush()"
    with capture.to(sink):
        assert capture.run([sys.executable, "-c", code]) == 0
        assert len(sink.getvalue()) == size  # all of it, before run() returned
        print("after")
    assert sink.getvalue() == "z" * size + "after\n"
    assert std.out.getvalue() == ""


@routed
def test_run_outside_routes_goes_to_the_fallback(std: Std) -> None:
    code = "import sys; print('o', flush=True); print('e', file=sys.stderr)"
    assert capture.run([sys.executable, "-c", code]) == 0
    assert std.out.getvalue() == "o\n"
    assert std.err.getvalue() == "e\n"


@routed
def test_run_check_and_exit_codes(std: Std) -> None:
    buf = io.StringIO()
    with capture.to(buf):
        assert capture.run([sys.executable, "-c", "raise SystemExit(3)"]) == 3
        with pytest.raises(subprocess.CalledProcessError) as info:
            capture.run([sys.executable, "-c", "raise SystemExit(4)"], check=True)
        assert info.value.returncode == 4
        assert capture.run("echo shell $((1+1))", shell=True) == 0
        assert capture.run([sys.executable, "-c", "import os; print(os.getcwd())"], cwd="/") == 0
        env = {**os.environ, "CORRAL_T": "v"}
        code = "import os; print(os.environ['CORRAL_T'])"
        assert capture.run([sys.executable, "-c", code], env=env) == 0
    assert buf.getvalue() == "shell 2\n/\nv\n"


@routed
def test_run_timeout_kills_the_child(std: Std) -> None:
    buf = io.StringIO()
    start = time.monotonic()
    code = "import time; print('started', flush=True); time.sleep(60)"
    with capture.to(buf), pytest.raises(subprocess.TimeoutExpired):
        capture.run([sys.executable, "-c", code], timeout=1.0)
    assert time.monotonic() - start < 15
    assert buf.getvalue() == "started\n"


@routed
def test_spawn_returns_a_routed_process(std: Std, tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    with capture.to(log):
        proc = capture.spawn(
            [sys.executable, "-c", "import sys; print(sys.stdin.read() or 'empty')"]
        )
        assert proc.pid > 0
        assert proc.wait(timeout=20) == 0
        assert proc.returncode == 0
        assert proc.poll() == 0
        buf = io.StringIO()
        with capture.to(buf):
            pumped = capture.spawn([sys.executable, "-c", "print('pumped')"])
            assert pumped.wait(timeout=20) == 0
    assert read(log) == "empty\n"
    assert buf.getvalue() == "pumped\n"


@routed
def test_subprocess_with_stdout_sys_stdout_lands_in_the_file_route(
    std: Std, tmp_path: Path
) -> None:
    log = tmp_path / "job.log"
    code = "import sys; print('child', flush=True); print('err', file=sys.stderr)"
    with capture.to(log):
        print("before")
        sys.stdout.write("unterminated, ")  # fileno() flushes it before the child gets the fd
        subprocess.run(
            [sys.executable, "-c", code], stdout=sys.stdout, stderr=sys.stderr, check=True
        )
        print("after")
    assert read(log) == "before\nunterminated, child\nerr\nafter\n"


@routed
def test_subprocess_with_stdout_sys_stdout_without_any_descriptor_does_not_crash(
    capfd: pytest.CaptureFixture[str], std: Std
) -> None:
    # Neither the route (StringIO) nor the fallback (StringIO) has a descriptor.
    buf = io.StringIO()
    with capture.to(buf):
        fd = sys.stdout.fileno()
        assert isinstance(fd, int)
        subprocess.run(
            [sys.executable, "-c", "print('child on a real descriptor')"],
            stdout=sys.stdout,
            check=True,
        )
    assert "child on a real descriptor" in capfd.readouterr().out
    assert buf.getvalue() == ""


@routed
def test_replaced_stdout_is_reported_once_and_install_restores_routing(
    std: Std, tmp_path: Path
) -> None:
    router_out, router_err = sys.stdout, sys.stderr
    intruder = io.StringIO()
    sys.stdout = intruder
    assert not capture.installed()
    print("bypassed")
    capture.install()
    assert sys.stdout is router_out and capture.installed()
    assert std.err.getvalue().count("was replaced") == 1
    assert "sys.stdout" in std.err.getvalue()
    # Replaced again (stderr this time): to() re-installs, the report is not repeated.
    sys.stderr = intruder
    log = tmp_path / "job.log"
    with capture.to(log):
        print("routed")
        print("routed err", file=sys.stderr)
    assert sys.stderr is router_err
    assert read(log) == "routed\nrouted err\n"
    assert intruder.getvalue() == "bypassed\n"
    assert std.err.getvalue().count("was replaced") == 1
    assert std.out.getvalue() == ""


@swapped
def test_reinstall_over_a_restored_stale_router_keeps_the_original(std: Std) -> None:
    capture.install()
    stale = sys.stdout  # e.g. redirect_stdout entered while installed, exited after uninstall
    capture.uninstall()
    sys.stdout = stale
    capture.install()
    try:
        print("not lost")
    finally:
        capture.uninstall()
    assert std.out.getvalue() == "not lost\n"


def test_faulthandler_writes_to_the_original_stderr(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    child = run_child(
        """
        import faulthandler, sys
        from corral import capture
        faulthandler.enable()
        capture.install()
        assert faulthandler.is_enabled()
        with capture.to(sys.argv[1]):
            print("in job", flush=True)
            faulthandler._sigsegv()
        """,
        str(log),
    )
    assert child.returncode != 0
    assert "Fatal Python error: Segmentation fault" in child.stderr
    assert "_sigsegv" in child.stderr or 'File "<string>"' in child.stderr
    assert read(log) == "in job\n"


def test_warnings_land_in_the_job_log_and_the_registry_is_process_wide(tmp_path: Path) -> None:
    child = run_child(
        """
        import sys, warnings
        from corral import capture
        a, b, c = sys.argv[1:4]
        def warn_here():
            warnings.warn("careful now", UserWarning)
        with capture.to(a):
            warn_here()
        with capture.to(b):
            warn_here()  # same location: already shown once in this process
        with capture.to(c), warnings.catch_warnings():
            warnings.simplefilter("always")
            warn_here()
        """,
        *(str(tmp_path / f"{n}.log") for n in "abc"),
    )
    assert child.returncode == 0, child.stderr
    assert "UserWarning: careful now" in read(tmp_path / "a.log")
    assert read(tmp_path / "b.log") == ""
    assert "UserWarning: careful now" in read(tmp_path / "c.log")
    assert child.stderr == ""


# --------------------------------------------------------------------------------------------
# Failure must not spread (16)


@routed
def test_closed_route_file_never_raises_and_is_reported_once(std: Std, tmp_path: Path) -> None:
    with capture.to(tmp_path / "job.log") as f:
        f.close()
        assert sys.stdout.closed is True
        print("a")
        print("b", flush=True)
        print("c", file=sys.stderr)
        sys.stdout.writelines(["d\n", "e\n"])
        sys.stdout.buffer.write(b"f\n")
        sys.stdout.flush()
    assert std.reports() == 1
    assert str(tmp_path / "job.log") in std.err.getvalue()
    print("fallback fine")
    assert std.out.getvalue() == "fallback fine\n"


@routed
def test_closed_route_through_logging_never_calls_handle_error(std: Std) -> None:
    logger = logging.getLogger(f"corral-test-{uuid.uuid4().hex}")
    logger.propagate = False
    handler = logging.StreamHandler()  # created while installed: holds the router
    errors: list[Any] = []
    handler.handleError = errors.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    stream = io.StringIO()
    try:
        with capture.to(stream):
            stream.close()
            for i in range(5):
                logger.warning("lost %d", i)
    finally:
        logger.removeHandler(handler)
    assert errors == []
    assert std.reports() == 1


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@routed
def test_full_disk_never_raises_and_is_reported_once(std: Std) -> None:
    with capture.to("/dev/full"):
        for i in range(100):
            print(f"line {i}")
        sys.stdout.write("x" * 100_000)
        sys.stdout.buffer.write(b"bytes\n")
        sys.stdout.flush()
    assert std.reports() == 1
    assert "ENOSPC" in std.err.getvalue() or "No space left" in std.err.getvalue()
    assert capture.current() is None


@routed
def test_lone_surrogate_on_a_strict_stream_is_escaped_and_reported_once(std: Std) -> None:
    raw = io.BytesIO()
    strict = io.TextIOWrapper(raw, encoding="utf-8", errors="strict", write_through=True)
    with capture.to(strict):
        print("ok")
        print("bad \udcff here")
        print("also \udc80")
        print("fine é")
    assert raw.getvalue().decode("utf-8") == "ok\nbad \\udcff here\nalso \\udc80\nfine é\n"
    assert std.reports() == 1
    assert "UnicodeEncodeError" in std.err.getvalue()


@routed
def test_unencodable_text_on_an_ascii_stream_is_escaped(std: Std) -> None:
    raw = io.BytesIO()
    strict = io.TextIOWrapper(raw, encoding="ascii", errors="strict", write_through=True)
    with capture.to(strict):
        print("café \udcff")
    assert raw.getvalue() == b"caf\\xe9 \\udcff\n"
    assert std.reports() == 1


@routed
def test_full_nonblocking_pipe_never_raises_and_is_reported_once(std: Std) -> None:
    r, w = os.pipe()
    os.set_blocking(w, False)
    stream = open(w, "w", encoding="utf-8", buffering=1)  # noqa: SIM115
    logger = logging.getLogger(f"corral-test-{uuid.uuid4().hex}")
    logger.propagate = False
    handler = logging.StreamHandler()
    errors: list[Any] = []
    handler.handleError = errors.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    size = fcntl.fcntl(r, F_GETPIPE_SZ)
    try:
        with capture.to(stream):
            line = "y" * 1000
            for _ in range(3 * size // 1000):
                print(line)
                logger.warning(line)
            sys.stdout.buffer.write(b"z" * size)
            sys.stdout.flush()
        assert errors == []
        assert std.reports() == 1
        assert "BlockingIOError" in std.err.getvalue()
    finally:
        logger.removeHandler(handler)
        os.set_blocking(r, False)
        with contextlib.suppress(BlockingIOError):
            while os.read(r, 1 << 20):
                pass
        with contextlib.suppress(OSError):
            stream.close()
        os.close(r)


@routed
def test_a_writer_stuck_on_a_blocked_pipe_does_not_hang_others(
    std: Std, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(capture, "_LOCK_TIMEOUT", 0.2)
    rec = Recorder()
    r, w = os.pipe()
    stream = open(w, "w", encoding="utf-8", buffering=1)  # noqa: SIM115 - blocking pipe
    size = fcntl.fcntl(r, F_GETPIPE_SZ)

    def stuck() -> None:
        with capture.to(stream):
            sys.stdout.write("s" * (4 * size) + "\n")  # blocks: nobody reads yet

    release, drained = threading.Event(), threading.Event()

    def drain() -> None:
        release.wait(6)  # safety net: a hung route exit is released (and then fails the test)
        while os.read(r, 1 << 20):
            pass
        drained.set()

    th = threading.Thread(target=rec(stuck))
    th.start()
    drainer = threading.Thread(target=drain, daemon=True)
    drainer.start()
    try:
        wait_until(lambda: pipe_available(r) >= size, what="the pipe to fill")
        start = time.monotonic()
        with capture.to(stream):  # same destination, same lock: the stuck writer holds it
            print("dropped")
        elapsed = time.monotonic() - start
        assert elapsed < 3.0, f"writer and route exit were held up {elapsed:.1f}s"
        assert std.reports() == 1
        assert "busy" in std.err.getvalue()
    finally:
        release.set()
        th.join(10)
        with contextlib.suppress(OSError):
            stream.close()
        assert drained.wait(10)
        os.close(r)
    assert not rec.errors


@routed
def test_reporting_never_goes_back_through_the_failing_route(std: Std) -> None:
    calls = [0]

    class Broken(io.StringIO):
        def write(self, s: str) -> int:
            calls[0] += 1
            raise OSError(errno.EIO, "broken")

    with capture.to(Broken()):
        for i in range(3):
            print(f"line {i}")
            print("err", file=sys.stderr)
    assert calls[0] == 12  # 2 writes per print; the report never went through the router
    assert std.reports() == 1


def test_a_broken_original_stderr_does_not_raise_or_recurse(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(capture, "_LOCK_TIMEOUT", 0.2)
    out, err = io.StringIO(), io.StringIO()
    out.close()
    err.close()
    with installed_over(out, err):
        print("to a closed original")
        print("to a closed original err", file=sys.stderr)
        with capture.to(io.StringIO()) as buf:
            buf.close()
            print("to a closed route, reported to a closed stderr")
        sys.stdout.flush()
        sys.stderr.flush()


@routed
def test_a_route_stream_that_prints_does_not_recurse(
    std: Std, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(capture, "_LOCK_TIMEOUT", 0.1)
    depth = [0]
    max_depth = [0]

    class Chatty(io.StringIO):
        def write(self, s: str) -> int:
            depth[0] += 1
            max_depth[0] = max(max_depth[0], depth[0])
            try:
                print("side effect", file=sys.stderr)  # back into the router, same route
                return super().write(s)
            finally:
                depth[0] -= 1

    chatty = Chatty()
    with capture.to(chatty):
        print("payload")
    assert chatty.getvalue() == "payload\n"
    assert max_depth[0] == 1
    assert std.reports() == 1


# --------------------------------------------------------------------------------------------
# Log files (17)


@routed
def test_log_files_are_utf8_with_backslashreplace_and_appended(std: Std, tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_text("earlier run\n", encoding="utf-8")
    with capture.to(log):
        print("é ✓ \udcff end")
        sys.stdout.buffer.write("bytes é\n".encode())
    assert log.read_bytes() == "earlier run\né ✓ \\udcff end\nbytes é\n".encode()
    assert std.reports() == 0


@routed
def test_log_files_are_flushed_per_line_and_at_route_end(std: Std, tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    with capture.to(log):
        print("one")
        assert read(log) == "one\n"  # another reader sees it before the route ends
        lonely = logging.getLogger(f"corral-test-{uuid.uuid4().hex}")
        lonely.propagate = False  # no handlers anywhere: logging.lastResort -> sys.stderr
        lonely.error("two")
        assert read(log) == "one\ntwo\n"
        sys.stdout.write("partial")
    assert read(log) == "one\ntwo\npartial"


@routed
def test_text_stream_routes_are_flushed_not_closed_at_route_end(std: Std, tmp_path: Path) -> None:
    path = tmp_path / "mine.log"
    with open(path, "w", encoding="utf-8", buffering=1 << 16) as f:
        with capture.to(f):
            print("buffered")
        assert not f.closed
        assert read(path) == "buffered\n"
        f.write("mine\n")
    assert read(path) == "buffered\nmine\n"


@routed
def test_flush_all_flushes_open_routes(std: Std, tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    with capture.to(log):
        sys.stdout.write("pending")
        assert read(log) == ""
        capture.flush_all()
        assert read(log) == "pending"


def test_log_files_are_flushed_at_interpreter_exit(tmp_path: Path) -> None:
    daemon_log, main_log = tmp_path / "daemon.log", tmp_path / "main.log"
    child = run_child(
        """
        import sys, threading
        from corral import capture
        ready = threading.Event()
        def job():
            with capture.to(sys.argv[1]):
                sys.stdout.write("daemon partial")
                ready.set()
                threading.Event().wait()  # still inside its route when the process exits
        threading.Thread(target=job, daemon=True).start()
        assert ready.wait(10)
        sys.stdout.write("fallback partial")
        capture.to(sys.argv[2]).__enter__()  # never exited
        sys.stdout.write("main partial")
        """,
        str(daemon_log),
        str(main_log),
    )
    assert child.returncode == 0, child.stderr
    assert read(daemon_log) == "daemon partial"
    assert read(main_log) == "main partial"
    assert child.stdout == "fallback partial"


def test_buffers_are_flushed_before_fork(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    child = run_child(
        """
        import os, sys
        from corral import capture
        capture.install()
        with capture.to(sys.argv[1]):
            sys.stdout.write("route-before-fork")  # no newline: still buffered
            pid = os.fork()
            if pid == 0:
                print("|child")
                capture.flush_all()
                os._exit(0)
            os.waitpid(pid, 0)
            print("|parent")
        sys.stdout.write("fallback-before-fork")  # stdout is a pipe: block-buffered
        pid = os.fork()
        if pid == 0:
            print("|child")
            capture.flush_all()
            os._exit(0)
        os.waitpid(pid, 0)
        print("|parent")
        """,
        str(log),
    )
    assert child.returncode == 0, child.stderr
    assert read(log).count("route-before-fork") == 1
    assert sorted(read(log).splitlines()) == ["route-before-fork|child", "|parent"]
    assert child.stdout.count("fallback-before-fork") == 1
    assert sorted(child.stdout.splitlines()) == ["fallback-before-fork|child", "|parent"]


def test_forked_child_is_not_blocked_by_a_lock_held_at_fork(tmp_path: Path) -> None:
    child = run_child(
        """
        import io, os, sys, threading, time
        from corral import capture
        capture._LOCK_TIMEOUT = 0.5
        capture.install()
        entered, gate = threading.Event(), threading.Event()
        class Slow(io.StringIO):
            def write(self, s):
                if s == "held":  # only the parent's holder thread blocks
                    entered.set()
                    gate.wait(10)
                return super().write(s)
        slow = Slow()
        def holder():
            with capture.to(slow):
                sys.stdout.write("held")  # holds the destination's lock across the fork
        th = threading.Thread(target=holder)
        th.start()
        assert entered.wait(10)
        pid = os.fork()
        if pid == 0:
            start = time.monotonic()
            with capture.to(slow):
                sys.stdout.write("child line")
            took = time.monotonic() - start
            ok = "child line" in slow.getvalue()
            os.write(1, f"{ok} {took:.2f}".encode())
            os._exit(0)
        gate.set()
        th.join(10)
        os.waitpid(pid, 0)
        """,
    )
    assert child.returncode == 0, child.stderr
    ok, took = child.stdout.split()
    assert ok == "True", child.stdout + child.stderr
    assert float(took) < 0.4
    assert REPORT not in child.stderr


@routed
def test_a_huge_write_without_newline_does_not_grow_memory(std: Std, tmp_path: Path) -> None:
    log = tmp_path / "huge.log"
    chunk = "x" * (1 << 20)
    gc.collect()
    tracemalloc.start()
    try:
        with capture.to(log):
            base, _ = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            for _ in range(200):
                sys.stdout.write(chunk)
            _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert log.stat().st_size == 200 << 20
    log.unlink()
    assert peak - base < 16 << 20, f"peak grew by {(peak - base) >> 20} MiB"


# --------------------------------------------------------------------------------------------
# Jobs that raise (18)


@routed
def test_a_job_that_raises_gets_its_traceback_and_the_route_is_reset(
    std: Std, tmp_path: Path
) -> None:
    log = tmp_path / "job.log"
    with pytest.raises(RuntimeError, match="boom"), capture.to(log) as f:
        print("working")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            traceback.print_exc()  # how the job runner reports it: inside the route
            raise
    assert f.closed
    assert capture.current() is None
    print("after")
    text = read(log)
    assert text.startswith("working\nTraceback (most recent call last):")
    assert text.endswith("RuntimeError: boom\n")
    assert std.out.getvalue() == "after\n"
    assert std.err.getvalue() == ""


@routed
def test_an_inner_route_that_raises_restores_the_outer(std: Std, tmp_path: Path) -> None:
    outer, inner = tmp_path / "outer.log", tmp_path / "inner.log"
    with capture.to(outer):
        with contextlib.suppress(ValueError), capture.to(inner):
            print("inner")
            raise ValueError
        print("outer")
    assert read(inner) == "inner\n"
    assert read(outer) == "outer\n"


# --------------------------------------------------------------------------------------------
# Uninstall while threads write (19), concurrency


@routed
def test_uninstall_while_threads_write_loses_nothing(std: Std, tmp_path: Path) -> None:
    rec = Recorder()
    stop = threading.Event()
    counts = [0] * 8
    ready = threading.Barrier(9, timeout=10)

    def writer(i: int) -> None:
        route = capture.to(tmp_path / f"{i}.log") if i % 2 == 0 else contextlib.nullcontext()
        with route:
            ready.wait()
            while not stop.is_set():
                print(f"<{i}:{counts[i]}>")
                counts[i] += 1

    threads = [threading.Thread(target=rec(writer), args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    ready.wait()
    wait_until(lambda: min(counts) >= 200, what="writers to start")
    at_uninstall = list(counts)
    capture.uninstall()
    assert not capture.installed()
    wait_until(
        lambda: all(c >= a + 200 for c, a in zip(counts, at_uninstall, strict=True)),
        what="writers to go on after uninstall",
    )
    stop.set()
    for th in threads:
        th.join(10)
    assert not rec.errors
    text = std.out.getvalue() + "".join(read(tmp_path / f"{i}.log") for i in range(0, 8, 2))
    found: dict[int, list[int]] = {i: [] for i in range(8)}
    for i, n in re.findall(r"<(\d+):(\d+)>", text):
        found[int(i)].append(int(n))
    for i in range(8):
        assert sorted(found[i]) == list(range(counts[i])), f"writer {i}"
    assert std.reports() == 0


@routed
def test_flush_all_while_routes_end_concurrently_never_raises(std: Std) -> None:
    rec = Recorder()
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            with contextlib.ExitStack() as stack:
                for _ in range(100):
                    stack.enter_context(capture.to(io.StringIO()))

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads inside flush_all's walk over open routes
    threads = [threading.Thread(target=rec(churn)) for _ in range(4)]
    try:
        for th in threads:
            th.start()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and not rec.errors:
            rec(capture.flush_all)()
    finally:
        stop.set()
        for th in threads:
            th.join(10)
        sys.setswitchinterval(old)
    assert not rec.errors


@routed
def test_32_threads_each_with_its_own_route(std: Std, tmp_path: Path) -> None:
    rec = Recorder()
    n_threads, n_lines = 32, 2000
    barrier = threading.Barrier(n_threads, timeout=10)
    payload = "é-payload-" * 5

    def job(i: int) -> None:
        with capture.to(tmp_path / f"{i:02d}.log"):
            barrier.wait()
            for n in range(n_lines):
                print(f"t{i:02d} {n:04d} {payload}")
                if n % 500 == 0:
                    print(f"t{i:02d} {n:04d} err", file=sys.stderr)

    threads = [threading.Thread(target=rec(job), args=(i,)) for i in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not rec.errors
    for i in range(n_threads):
        expected = []
        for n in range(n_lines):
            expected.append(f"t{i:02d} {n:04d} {payload}\n")
            if n % 500 == 0:
                expected.append(f"t{i:02d} {n:04d} err\n")
        assert (tmp_path / f"{i:02d}.log").read_bytes() == "".join(expected).encode()
    assert std.out.getvalue() == "" and std.err.getvalue() == ""


@routed
def test_threads_sharing_one_destination_do_not_corrupt_it(std: Std, tmp_path: Path) -> None:
    rec = Recorder()
    n_threads, n_lines = 16, 1000
    barrier = threading.Barrier(n_threads, timeout=10)
    path = tmp_path / "shared.log"
    line_re = re.compile(r"t(\d\d) (\d{4}) [a-z]{40}")

    with open(path, "w", encoding="utf-8") as shared:  # one TextIOWrapper, block-buffered

        def job(i: int) -> None:
            with capture.to(shared):  # separate routes, same stream: one lock
                barrier.wait()
                for n in range(n_lines):
                    # one write per line (print's text and newline are two writes, which other
                    # threads may legitimately get between)
                    sys.stdout.write(f"t{i:02d} {n:04d} {'abcdefghij' * 4}\n")

        threads = [threading.Thread(target=rec(job), args=(i,)) for i in range(n_threads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
    assert not rec.errors
    lines = read(path).splitlines()
    assert len(lines) == n_threads * n_lines
    seen: dict[int, list[int]] = {i: [] for i in range(n_threads)}
    for line in lines:
        m = line_re.fullmatch(line)
        assert m, f"garbled line {line!r}"
        seen[int(m.group(1))].append(int(m.group(2)))
    for i in range(n_threads):
        assert seen[i] == list(range(n_lines))
