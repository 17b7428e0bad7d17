"""Route ``sys.stdout``/``sys.stderr`` per thread and per asyncio task.

corral runs many launch and teardown jobs on one thread pool in one process, and each job's
output must land in that job's own log. ``sys.stdout`` is a single global, so swapping it per job
(``contextlib.redirect_stdout``) races between threads. Instead ONE router object is installed as
``sys.stdout`` (and one as ``sys.stderr``) for the life of the process; on every write it looks up
the route of the current thread or task in a :class:`contextvars.ContextVar` and writes there, or to
the stream that was in place at install time (the *fallback*) when no route is set.

Why a ContextVar: it is the cheapest lookup (~60 ns), each asyncio task gets its own copy (which
rules out ``threading.local``), and a brand-new thread starts with an empty context, so it can never
inherit a stale route from a dead thread whose ident was reused.

Policies a user of this module relies on:

* Routes nest (``with to(a): with to(b): ...``) and are undone in order.
* Threads: on Python 3.11-3.13 a plain ``threading.Thread`` starts with an EMPTY context, so its
  output goes to the fallback. Use :class:`Thread` or :func:`wrap` to carry the starter's route
  into a thread. On 3.14, ``sys.flags.thread_inherit_context`` (on by default only in free-threaded
  builds) makes plain threads inherit it too; corral never relies on that and always uses these
  helpers.
* A thread that outlives the route it inherited (a helper a job forgot to join) writes to the
  fallback once the route has ended: never into a closed log, never raising.
* Each destination has its own lock. Several threads writing to one ``TextIOWrapper`` corrupt it
  on 3.11/3.12 (CPython issue 118138); a lock per destination avoids that without a global lock
  (a single global lock piles up behind the GIL at 32+ writer threads).
* A destination that fails (closed file, full disk, full non-blocking pipe, unencodable text on a
  strict stream) never raises into the writer. The failure is reported once, on the original
  stderr, and never through the router itself, so reporting cannot recurse.
* Log files are opened UTF-8 with ``errors="backslashreplace"``, line-buffered, flushed when the
  route ends, at interpreter exit and before ``fork()``. That holds for text; bytes written to
  ``sys.stdout.buffer`` and a child's output go to the file as they are (a log may hold what
  is not UTF-8; `corral logs` passes bytes on as they are).
* ``print(..., file=sys.__stdout__)`` is the intentional escape hatch: it bypasses the router.
* Logging: :func:`install` re-points existing ``logging.StreamHandler``\\ s that hold the original
  stdout/stderr at the router (handlers created before install would otherwise bypass it).
* Subprocesses write to file descriptors, not to ``sys.stdout``: use :func:`spawn` or :func:`run`,
  which hand the child a duplicate of the route's descriptor (flushing first, so order is kept;
  taken under the route's lock, so a route ending meanwhile cannot hand the child a descriptor
  closed, or reused for another job's log) or, for destinations without one, pipe the child's
  output and pump it into the route. A library passing
  ``stdout=sys.stdout`` to ``subprocess`` gets the route's descriptor from ``fileno()`` (or the
  fallback's when the route has none, or the process's own when neither has), so it does not
  crash.

What cannot be routed, by design:

* Writes below Python: C extensions writing to fd 1/2, ``os.write(1, ...)``, and children started
  without :func:`spawn` that inherit fd 1/2. They go to the process's real descriptors.
* The ``warnings`` module's once-per-location registry is process-wide: a warning shown in one
  job's log is not shown again in another job's log for the same code location.
* Code that reassigns ``sys.stdout`` after install (``colorama.init``, a library's
  ``redirect_stdout`` left in place) takes output away from the router. :func:`install` (called by
  every :func:`to`) notices, reports it once on the original stderr, and puts the router back.
* ``faulthandler`` needs a real descriptor; :func:`install` points it at the original stderr.

Size: one process-wide router, kept in one module. The route ContextVar, the per-stream locks
(rebuilt in a forked child by rebinding this module's globals), the install state and the
inlined write path are shared by every part, and :func:`spawn`/:func:`run` hand a child the
route's own descriptor; split, the halves would have to import each other (an import circle)
or reach into each other's globals, which the after-fork reset makes unsafe.
"""

from __future__ import annotations

import atexit
import contextvars
import faulthandler
import io
import logging
import os
import stat
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, ParamSpec, TypeVar

__all__ = [
    "RoutedProcess",
    "Thread",
    "current",
    "end_line",
    "flush_all",
    "install",
    "installed",
    "run",
    "spawn",
    "to",
    "uninstall",
    "wrap",
]

P = ParamSpec("P")
R = TypeVar("R")


# How long a writer waits for a destination another thread is writing to before giving up on
# this one write (reported once): bounded so one stuck destination cannot hang its other writers.
_LOCK_TIMEOUT = 2.0


class _Target:
    """One destination stream with its own lock and failure bookkeeping.

    ``ended`` is set (under the lock) when the route that created this target exits; a writer that
    still holds the target after that (a helper thread that outlived its job) is sent to the
    fallback instead of a closed file.

    The write path is the hot path of the whole module (every ``print`` is two writes), so the
    bound methods it needs are cached in slots: attribute lookups through ``self.stream.write``
    and a ``with`` block on the lock cost more than the routing decision itself.
    """

    __slots__ = (
        "__weakref__",
        "acquire",
        "ended",
        "failures",
        "first_error",
        "lock",
        "name",
        "owned",
        "release",
        "stream",
        "stream_write",
    )

    def __init__(self, stream: IO[str] | None, *, owned: bool, name: str) -> None:
        self.stream = stream
        self.owned = owned
        self.name = name
        self.ended = False
        self.failures = 0
        self.first_error: str | None = None
        self.stream_write: Callable[[str], int] = len if stream is None else stream.write
        self._set_lock(_lock_for(stream) if stream is not None else threading.Lock())

    def _set_lock(self, lock: threading.Lock) -> None:
        self.lock = lock
        self.acquire = lock.acquire
        self.release = lock.release

    def write(self, s: str, fallback: _Target) -> int:
        if not self.acquire(False) and not self.wait_for_lock():
            return len(s)
        try:
            if not self.ended:
                return self.stream_write(s)
        except Exception as exc:
            return self.recover(s, exc)
        finally:
            self.release()
        return fallback.write(s, fallback)

    def wait_for_lock(self) -> bool:
        """Slow path of the lock: bounded, so a writer stuck on a blocked pipe (or a signal
        handler printing while its own thread is inside ``write``) cannot hang every other
        writer of this destination; their output is dropped and reported instead."""
        if self.acquire(True, _LOCK_TIMEOUT):
            return True
        self.report(TimeoutError(f"destination busy for more than {_LOCK_TIMEOUT:g} s"))
        return False

    def write_bytes(self, b: bytes, fallback: _Target) -> int:
        """Bytes written through ``sys.stdout.buffer``, kept in order with text writes."""
        if not self.acquire(False) and not self.wait_for_lock():
            return len(b)
        try:
            if not self.ended:
                stream = self.stream
                if stream is None:
                    return len(b)
                raw = getattr(stream, "buffer", None)
                if raw is None:
                    encoding = getattr(stream, "encoding", None) or "utf-8"
                    stream.write(b.decode(encoding, "backslashreplace"))
                else:
                    stream.flush()
                    raw.write(b)
                    if b"\n" in b:
                        raw.flush()
                return len(b)
        except Exception as exc:
            self.report(exc)
            return len(b)
        finally:
            self.release()
        return fallback.write_bytes(b, fallback)

    def recover(self, s: str, exc: Exception) -> int:
        """Turn a failed write into a report; retry once for text the stream cannot encode.

        Called with the lock held.
        """
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}") from None
        stream = self.stream
        if isinstance(exc, UnicodeEncodeError) and stream is not None:
            encoding = getattr(stream, "encoding", None) or "utf-8"
            safe = s.encode(encoding, "backslashreplace").decode(encoding, "replace")
            try:
                written = stream.write(safe)
            except Exception as again:
                exc = again
            else:
                self.report(exc, "text it cannot encode is written escaped")
                return written
        self.report(exc)
        return len(s)

    def report(
        self,
        exc: BaseException,
        consequence: str = "its output is dropped until it works again",
    ) -> None:
        self.failures += 1
        if self.failures == 1:
            self.first_error = str(exc) or repr(exc)
            _report(
                f"corral.capture: cannot write to {self.name}: {exc!r}; "
                f"{consequence} (reported once)"
            )

    def flush(self, timeout: float = _LOCK_TIMEOUT) -> None:
        if not self.acquire(True, timeout):
            return
        try:
            if not self.ended and self.stream is not None:
                self.stream.flush()
        except Exception as exc:
            self.report(exc)
        finally:
            self.release()

    def end(self) -> None:
        """Close the route: later writers holding this target go to the fallback.

        If another writer is stuck on the destination (a blocked pipe) past the lock timeout,
        the route still ends, but the stream is left alone: flushing or closing it without the
        lock would hang this thread behind the stuck one, or corrupt the stream.
        """
        acquired = self.acquire(True, _LOCK_TIMEOUT)
        try:
            if self.ended:
                return
            self.ended = True
            if not acquired:
                self.report(TimeoutError(f"destination busy for more than {_LOCK_TIMEOUT:g} s"))
            elif self.stream is not None:
                if self.owned:
                    self.stream.close()
                else:
                    self.stream.flush()
        except Exception as exc:
            self.report(exc)
        finally:
            if acquired:
                self.release()
            # Under the guard: flush_all() iterates the set, which must not change meanwhile.
            with _open_targets_guard:
                _open_targets.discard(self)

    def fileno(self) -> int:
        if self.stream is None:
            raise io.UnsupportedOperation("no stream")
        return self.stream.fileno()

    def reinit_lock(self) -> None:
        """After fork, in the child: a fresh lock, still shared with every target of the same
        stream (call after ``_stream_locks`` was emptied)."""
        self._set_lock(_lock_for(self.stream) if self.stream is not None else threading.Lock())


# Destinations shared by two routes (the same stream object passed to two `to()`) share one lock;
# keyed weakly so a stream that nobody uses any more is not kept alive by its lock.
_stream_locks: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()
_stream_locks_guard = threading.Lock()


def _lock_for(stream: Any) -> threading.Lock:
    with _stream_locks_guard:
        try:
            lock = _stream_locks.get(stream)
        except TypeError:  # not weak-referenceable: no sharing possible
            return threading.Lock()
        if lock is None:
            lock = threading.Lock()
            _stream_locks[stream] = lock
        return lock


_current: contextvars.ContextVar[_Target | None] = contextvars.ContextVar(
    "corral_capture_route", default=None
)
_open_targets: weakref.WeakSet[_Target] = weakref.WeakSet()
_open_targets_guard = threading.Lock()


class _Router:
    """The object installed as ``sys.stdout`` or ``sys.stderr``.

    It is deliberately not an ``io.TextIOBase``: that base class carries state (``closed``,
    ``__del__`` closing) that does not fit one object shared by every thread. Every method
    resolves the current route first, and the hot path (``write``) does nothing else.
    """

    __slots__ = ("_buffer", "_fallback", "_label")

    def __init__(self, label: str) -> None:
        self._label = label
        self._fallback = _Target(None, owned=False, name=f"original {label}")
        self._buffer = _BufferRouter(self)

    def _route(self) -> _Target:
        t = _current.get()
        if t is None or t.ended:
            return self._fallback
        return t

    def write(self, s: str) -> int:
        # _Target.write inlined: this runs for every print() of every job.
        t = _current.get()
        if t is None:
            t = self._fallback
        if not t.acquire(False) and not t.wait_for_lock():
            return len(s)
        try:
            if not t.ended:
                return t.stream_write(s)
        except Exception as exc:
            return t.recover(s, exc)
        finally:
            t.release()
        return self._fallback.write(s, self._fallback)

    def writelines(self, lines: Iterable[str]) -> None:
        t = _current.get()
        if t is None:
            t = self._fallback
        for line in lines:
            t.write(line, self._fallback)

    def flush(self) -> None:
        self._route().flush()

    def fileno(self) -> int:
        """The route's descriptor, flushed first; the fallback's when the route has none, and
        the process's own (``sys.__stdout__``/``sys.__stderr__``) when neither has one.

        ``subprocess.Popen(stdout=sys.stdout)`` calls this: a child then writes straight into the
        job's log file, after everything Python wrote before it.
        """
        t = self._route()
        for candidate in (t, self._fallback):
            try:
                fd = candidate.fileno()
            except Exception:
                continue
            candidate.flush()
            return fd
        std = getattr(sys, f"__{self._label}__", None)
        try:
            if std is not None:
                fd = std.fileno()
                std.flush()
                return int(fd)
        except Exception:
            pass
        raise io.UnsupportedOperation(f"corral {self._label} route has no file descriptor")

    def isatty(self) -> bool:
        stream = self._route().stream
        try:
            return bool(stream is not None and stream.isatty())
        except Exception:
            return False

    @property
    def encoding(self) -> str:
        return getattr(self._route().stream, "encoding", None) or "utf-8"

    @property
    def errors(self) -> str:
        return getattr(self._route().stream, "errors", None) or "strict"

    @property
    def closed(self) -> bool:
        stream = self._route().stream
        return bool(getattr(stream, "closed", False))

    @property
    def buffer(self) -> _BufferRouter:
        return self._buffer

    @property
    def name(self) -> str:
        return f"<corral {self._label}>"

    @property
    def mode(self) -> str:
        return "w"

    @property
    def newlines(self) -> None:
        return None

    @property
    def line_buffering(self) -> bool:
        return bool(getattr(self._route().stream, "line_buffering", False))

    def readable(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        """Ignored: the router is shared by the whole process and must outlive any caller."""

    def __getattr__(self, attr: str) -> Any:
        # Rare attributes (reconfigure, ...) resolve through the current route's stream.
        return getattr(self._route().stream, attr)

    def __repr__(self) -> str:
        return f"<corral.capture router for {self._label}>"


class _BufferRouter:
    """``sys.stdout.buffer``: bytes go to the route's binary layer, in order with text."""

    __slots__ = ("_router",)

    def __init__(self, router: _Router) -> None:
        self._router = router

    def write(self, b: bytes | bytearray | memoryview) -> int:
        router = self._router
        t = _current.get()
        if t is None:
            t = router._fallback
        return t.write_bytes(bytes(b), router._fallback)

    def writelines(self, lines: Iterable[bytes]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._router.flush()

    def fileno(self) -> int:
        return self._router.fileno()

    def isatty(self) -> bool:
        return self._router.isatty()

    def readable(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    @property
    def closed(self) -> bool:
        return self._router.closed


_stdout = _Router("stdout")
_stderr = _Router("stderr")
_state_lock = threading.RLock()
_installed = False
_replaced_reported = False
_repointed_handlers: list[tuple[logging.StreamHandler[Any], Any]] = []


def _report(message: str) -> None:
    """Write a diagnostic to the original stderr, never through the router (no recursion)."""
    target = _stderr._fallback
    stream = target.stream if target.stream is not None else sys.__stderr__
    if stream is None:
        return
    # Called with some destination's lock held, maybe the fallback's own: do not block on it.
    acquired = target.acquire(True, 0.5)
    try:
        stream.write(message + "\n")
        stream.flush()
    except Exception:
        pass
    finally:
        if acquired:
            target.release()


def installed() -> bool:
    """Whether the routers are installed and still in place as ``sys.stdout``/``sys.stderr``."""
    return _installed and sys.stdout is _stdout and sys.stderr is _stderr


def install() -> None:
    """Install the routers (idempotent); put them back if something replaced them.

    Cheap when already in place, so :func:`to` calls it on every entry.
    """
    global _installed, _replaced_reported
    if _installed and sys.stdout is _stdout and sys.stderr is _stderr:
        return
    with _state_lock:
        if _installed and sys.stdout is _stdout and sys.stderr is _stderr:
            return  # another thread installed while this one waited for the lock
        if _installed:
            for label, router, current_stream in (
                ("stdout", _stdout, sys.stdout),
                ("stderr", _stderr, sys.stderr),
            ):
                if current_stream is not router and not _replaced_reported:
                    _replaced_reported = True
                    _report(
                        f"corral.capture: sys.{label} was replaced by {current_stream!r} after "
                        "install; re-installing the router (output written meanwhile bypassed "
                        "per-job routing)"
                    )
            sys.stdout = _stdout
            sys.stderr = _stderr
            return
        for router, original in ((_stdout, sys.stdout), (_stderr, sys.stderr)):
            if isinstance(original, _Router):
                # A router put back after uninstall (a redirect_stdout that outlived it): the
                # original is still the fallback it had; making it None would drop all output.
                continue
            router._fallback = _Target(original, owned=False, name=f"original {router._label}")
        _repoint_handlers()
        if faulthandler.is_enabled():
            _enable_faulthandler()
        sys.stdout = _stdout
        sys.stderr = _stderr
        _installed = True
        _replaced_reported = False


def hold_standard_fds() -> list[int]:
    """Point descriptors 0, 1 and 2 at ``/dev/null`` where they are closed; return which were.

    Why: a process started with them closed (``corral daemon run >&- 2>&-``, a supervisor that
    closes them) hands those numbers to the next files it opens: the daemon's event loop, the
    API's or the data plane's socket, a job's log. What still writes to fd 1/2 below the router
    (a fatal error, C code, a child inheriting them) then writes into that socket or file.
    Called first thing by ``corral daemon run``, before anything is opened.
    """
    held: list[int] = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            held.append(fd)
    return held


def _enable_faulthandler() -> None:
    for stream in (_stderr._fallback.stream, sys.__stderr__):
        try:
            if stream is not None:
                faulthandler.enable(file=stream)
                return
        except Exception:
            continue


def _repoint_handlers() -> None:
    """Point StreamHandlers that hold the original stdout/stderr at the routers."""
    originals: dict[int, _Router] = {}
    for router in (_stdout, _stderr):
        if router._fallback.stream is not None:
            originals[id(router._fallback.stream)] = router
    for std, router in ((sys.__stdout__, _stdout), (sys.__stderr__, _stderr)):
        if std is not None:
            originals.setdefault(id(std), router)
    for handler in _all_stream_handlers():
        target = originals.get(id(handler.stream))
        if target is None:
            continue
        try:
            previous = handler.setStream(target)
        except AttributeError:  # a handler whose stream is a read-only property (lastResort)
            continue
        _repointed_handlers.append((handler, previous))


def _all_stream_handlers() -> list[logging.StreamHandler[Any]]:
    refs: Sequence[Any] = list(getattr(logging, "_handlerList", []))
    handlers: list[Any] = [ref() for ref in refs]
    loggers: list[Any] = [logging.getLogger()]
    loggers += list(logging.Logger.manager.loggerDict.values())
    for lg in loggers:
        handlers += list(getattr(lg, "handlers", []))
    seen: set[int] = set()
    out: list[logging.StreamHandler[Any]] = []
    for h in handlers:
        is_stream = isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
        if is_stream and id(h) not in seen:
            seen.add(id(h))
            out.append(h)
    return out


def uninstall() -> None:
    """Restore the original streams and handlers.

    The routers keep working for anyone still holding them (a thread mid-``print``, a handler
    created meanwhile): routes stay in effect, so nothing raises and nothing is lost.
    """
    global _installed
    with _state_lock:
        if not _installed:
            return
        flush_all()
        if sys.stdout is _stdout:
            sys.stdout = _stdout._fallback.stream
        if sys.stderr is _stderr:
            sys.stderr = _stderr._fallback.stream
        for handler, previous in _repointed_handlers:
            if handler.stream in (_stdout, _stderr):
                handler.setStream(previous)
        _repointed_handlers.clear()
        _installed = False


def _make_target(target: str | os.PathLike[str] | IO[str]) -> _Target:
    if isinstance(target, (str, os.PathLike)):
        path = Path(target)
        path.parent.mkdir(parents=True, exist_ok=True)
        stream = open(  # noqa: SIM115 - closed by _Target.end()
            path, "a", encoding="utf-8", errors="backslashreplace", buffering=1
        )
        t = _Target(stream, owned=True, name=str(path))
    elif isinstance(target, _Router):
        # Routing into "whatever sys.stdout is now" means the current route, not the router
        # itself (which would write into itself forever).
        current_target = target._route()
        t = _Target(current_target.stream, owned=False, name=current_target.name)
    else:
        t = _Target(target, owned=False, name=getattr(target, "name", None) or repr(target))
    with _open_targets_guard:
        _open_targets.add(t)
    return t


class to:
    """Send everything the current thread/task writes to ``target`` until the block ends.

    ``target`` is a path (opened append, UTF-8, ``errors="backslashreplace"``, line-buffered,
    closed at the end) or a text stream (flushed, not closed, at the end). Installs the routers
    if needed. ``__enter__`` returns the destination stream.
    """

    __slots__ = ("_error", "_spec", "_target", "_token")

    def __init__(self, target: str | os.PathLike[str] | IO[str]) -> None:
        self._spec = target
        self._target: _Target | None = None
        self._token: contextvars.Token[_Target | None] | None = None
        self._error: str | None = None

    @property
    def error(self) -> str | None:
        """The first failure of this destination (a full disk, a closed stream), or None.

        Writes that fail are dropped and reported once on the original stderr; this lets the
        route's owner (a job) tell its user that its log is incomplete, and why. Readable during
        the block and after it.
        """
        t = self._target
        return t.first_error if t is not None else self._error

    def __enter__(self) -> IO[str]:
        install()
        t = _make_target(self._spec)
        stream = t.stream
        if stream is None:  # checked before the route is set: a failed enter must not leak it
            t.end()
            raise TypeError(f"capture.to() needs a path or a text stream, not {self._spec!r}")
        self._target = t
        self._token = _current.set(t)
        return stream

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        token, t = self._token, self._target
        self._token = self._target = None
        if token is not None:
            try:
                _current.reset(token)
            except ValueError:  # exited from another context than it was entered in
                _current.set(token.old_value if token.old_value is not token.MISSING else None)
        if t is not None:
            t.end()
            self._error = t.first_error


def current() -> IO[str] | None:
    """The stream the current thread/task is routed to, or None outside any route."""
    t = _current.get()
    if t is None or t.ended:
        return None
    return t.stream


def flush_all() -> None:
    """Flush every open route and the originals (at exit and before fork)."""
    with _open_targets_guard:
        targets = list(_open_targets)
    for t in targets:
        t.flush(timeout=0.2)
    for router in (_stdout, _stderr):
        router._fallback.flush(timeout=0.2)


def _after_fork_in_child() -> None:
    # Another thread of the parent may have held a lock at fork time; in the child that thread no
    # longer exists, so its lock would stay held forever.
    global _open_targets_guard, _stream_locks, _stream_locks_guard, _state_lock
    _open_targets_guard = threading.Lock()
    _stream_locks = weakref.WeakKeyDictionary()  # its locks may be held by parent threads
    _stream_locks_guard = threading.Lock()
    _state_lock = threading.RLock()
    for t in list(_open_targets):
        t.reinit_lock()
    for router in (_stdout, _stderr):
        router._fallback.reinit_lock()


atexit.register(flush_all)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=flush_all, after_in_child=_after_fork_in_child)


def wrap(fn: Callable[P, R]) -> Callable[P, R]:
    """Return ``fn`` bound to a copy of the caller's context (and so its route).

    Each call runs in its own copy, so the wrapped callable may run in several threads at once.
    """
    ctx = contextvars.copy_context()

    def run_in_context(*args: P.args, **kwargs: P.kwargs) -> R:
        return ctx.copy().run(fn, *args, **kwargs)

    run_in_context.__wrapped__ = fn  # type: ignore[attr-defined]
    return run_in_context


class Thread(threading.Thread):
    """A ``threading.Thread`` that runs in a copy of its creator's context (and route).

    Subclasses may override :meth:`run` as usual: the context is entered around whatever
    ``run`` the instance has (bound here, so it works whatever ``_bootstrap_inner`` does).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        context = contextvars.copy_context()
        run = self.run
        self._corral_context = context

        def run_in_context() -> None:
            try:
                context.run(run)
            finally:
                self.__dict__.pop("run", None)  # break the cycle self -> run_in_context -> self

        self.run = run_in_context  # type: ignore[method-assign]


class RoutedProcess:
    """A child process whose stdout/stderr land in the route that was current at spawn time."""

    def __init__(self, popen: subprocess.Popen[bytes], pumps: list[threading.Thread]) -> None:
        self.popen = popen
        self._pumps = pumps

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the child, then for its output to be pumped (raises TimeoutExpired)."""
        code = self.popen.wait(timeout)
        for pump in self._pumps:
            pump.join()
        return code


def _incomplete_utf8_tail(chunk: bytes) -> int:
    """Where a UTF-8 sequence cut off at the end of ``chunk`` starts (``len(chunk)`` if none)."""
    n = len(chunk)
    for i in range(n - 1, max(n - 4, -1), -1):
        byte = chunk[i]
        if byte < 0x80:
            return n
        if byte >= 0xC0:  # lead byte: is its sequence complete?
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return i if n - i < need else n
    return n


def _pump(pipe: IO[bytes], write_bytes: Callable[[bytes], object]) -> None:
    # A read can end in the middle of a multi-byte character; a route without a binary layer
    # decodes each write on its own, so the cut-off bytes wait for the next read.
    fd = pipe.fileno()
    held = b""
    try:
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunk = held + chunk
            cut = _incomplete_utf8_tail(chunk)
            held = chunk[cut:]
            if cut:
                write_bytes(chunk[:cut])
        if held:
            write_bytes(held)
    except Exception as exc:
        _report(f"corral.capture: lost child output: {exc!r}")
    finally:
        pipe.close()


def _child_fd(t: _Target) -> int | None:
    """A descriptor of its own onto ``t``'s file for a child (the caller closes it), or None
    when ``t`` has none, has ended, or stays busy past the lock timeout.

    Duplicated under the route's lock, after what was written before is flushed and while the
    route is still open: a route that ends meanwhile (a job returning while a helper thread it
    started spawns a child) closes only its own descriptor, so the child neither gets a closed
    one (EBADF) nor a number already reused for another job's log.
    """
    if not t.acquire(True, _LOCK_TIMEOUT):
        return None
    try:
        stream = t.stream
        if t.ended or stream is None:
            return None
        try:
            stream.flush()
        except Exception as exc:
            t.report(exc)
        return os.dup(stream.fileno())
    except Exception:
        return None
    finally:
        t.release()


def _child_streams(dups: list[int]) -> tuple[list[int], list[tuple[int, _Router]]]:
    """The child's stdout and stderr for :func:`spawn`, and which of them need a pump. The
    descriptors duplicated for it are appended to ``dups`` (closed by the caller once the child
    has started)."""
    fds: list[int] = []
    pumps_for: list[tuple[int, _Router]] = []
    targets: list[_Target] = []
    for index, router in enumerate((_stdout, _stderr)):
        t = router._route()
        fd = _child_fd(t)
        if fd is None and t.ended:  # the route ended since it was looked up
            t = router._fallback
            fd = _child_fd(t)
        targets.append(t)
        if index == 1 and targets[0] is t:
            # Both streams go to one destination: the child's stderr joins its stdout (one
            # descriptor, or one pipe, keeps their lines in order).
            if fd is not None:
                os.close(fd)
            fds.append(subprocess.STDOUT)
        elif fd is not None:
            dups.append(fd)
            fds.append(fd)
        else:
            fds.append(subprocess.PIPE)
            pumps_for.append((index, router))
    return fds, pumps_for


def end_line() -> None:
    """End the current stdout route's file on a line break, after a child wrote to it directly.

    A command whose output stops mid-line (``printf abc``) would otherwise have the next line
    printed after it run on from it: "abc[corral] setup done". Only a route with a file is
    checked (its last byte, read back under the route's lock); a pipe or the fallback is left
    as it is.
    """
    t = _stdout._route()
    if t is _stdout._fallback or not t.acquire(True, _LOCK_TIMEOUT):
        return
    try:
        stream = t.stream
        if t.ended or stream is None or not _is_file(stream):
            return
        stream.flush()
        # The route's descriptor is write-only: read the last byte through a second one onto
        # the same file (right even after the path was rotated away).
        reader = os.open(f"/proc/self/fd/{stream.fileno()}", os.O_RDONLY)
        try:
            size = os.fstat(reader).st_size
            last = os.pread(reader, 1, size - 1) if size else b"\n"
        finally:
            os.close(reader)
        if last != b"\n":
            stream.write("\n")
            stream.flush()
    except Exception as exc:
        t.report(exc)
    finally:
        t.release()


def _is_file(stream: IO[str]) -> bool:
    """Whether ``stream`` writes to a regular file, whose last byte :func:`end_line` can read
    back. A stream with no descriptor (``io.StringIO``), a socket or a pipe is not one: reading
    it back fails or reads nothing, and must not be reported as the route failing (a job's
    ``log_error``)."""
    try:
        return stat.S_ISREG(os.fstat(stream.fileno()).st_mode)
    except (OSError, ValueError):  # io.UnsupportedOperation is both
        return False


def spawn(
    args: str | Sequence[str],
    *,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    shell: bool = False,
    start_new_session: bool = False,
    stdin: int | IO[Any] | None = subprocess.DEVNULL,
    preexec_fn: Callable[[], None] | None = None,
) -> RoutedProcess:
    """Start a child whose output goes to the current route, in order with Python output.

    A route backed by a file hands the child a descriptor of its own onto that file (flushed
    first, so earlier prints come first, and the child's output survives even if this process
    dies, or the route ends while the child starts). A route without a descriptor gets the
    child's output through a pipe and a pump thread.
    """
    dups: list[int] = []
    try:
        fds, pumps_for = _child_streams(dups)
        popen = subprocess.Popen(
            args,
            cwd=cwd,
            env=None if env is None else dict(env),
            shell=shell,
            start_new_session=start_new_session,
            stdin=stdin,
            stdout=fds[0],
            stderr=fds[1],
            preexec_fn=preexec_fn,
        )
    finally:
        for fd in dups:
            os.close(fd)
    pumps: list[threading.Thread] = []
    for index, router in pumps_for:
        pipe = popen.stdout if index == 0 else popen.stderr
        assert pipe is not None
        pump = Thread(
            target=_pump,
            args=(pipe, router.buffer.write),
            name=f"corral-pump-{popen.pid}-{router._label}",
            daemon=True,
        )
        pump.start()
        pumps.append(pump)
    return RoutedProcess(popen, pumps)


def run(
    args: str | Sequence[str],
    *,
    check: bool = False,
    timeout: float | None = None,
    **kwargs: Any,
) -> int:
    """Run a child to completion with its output in the current route; return its exit code."""
    proc = spawn(args, **kwargs)
    try:
        code = proc.wait(timeout)
    except BaseException:
        proc.popen.kill()
        proc.wait()
        raise
    if check and code != 0:
        raise subprocess.CalledProcessError(code, args)
    return code
