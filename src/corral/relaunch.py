"""How long a service waits before relaunching after failures, and why: the backoff of
:mod:`corral.plan` (and of :mod:`corral.fallback`'s replacements), told apart so that what a
step decided can also say when the wait ends and what it waits after (``status``).

One backoff mechanism (:func:`backoff`) serves every retry: relaunching after failures,
retrying a failed teardown, and the controller's own retries of a locked state file.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from corral.replicas import ReplicaFacts, failure_status, ready_held

BACKOFF_CAP = 30.0


class Failed(ReplicaFacts, Protocol):
    """What the reason of a wait names of a failed replica (a :class:`corral.plan.Row`)."""

    @property
    def seq(self) -> int: ...
    @property
    def failure(self) -> str | None: ...


def backoff(failures: int, *, base: float = 1.0, cap: float = BACKOFF_CAP) -> float:
    """Seconds to wait after ``failures`` consecutive failures: base, 2 base, 4 base ... cap."""
    return min(cap, base * float(2 ** max(0, failures - 1)))


def failures_in_a_row(current: Sequence[Failed]) -> list[Failed]:
    """The failures the relaunch backoff counts: those after the newest READY that held
    (:func:`corral.replicas.ready_held`)."""
    failures = [r for r in current if failure_status(r) is not None]
    if readies := [r.first_ready_at for r in current if r.first_ready_at and ready_held(r)]:
        failures = [r for r in failures if r.updated_at > max(readies)]
    return failures


def relaunch_wait(current: Sequence[Failed], now: float) -> float:
    """Seconds before relaunching after consecutive failures, so a crashing app is not
    hammered. Failures before the newest READY that held do not count."""
    failures = failures_in_a_row(current)
    if not failures:
        return 0.0
    last = max(r.updated_at for r in failures)
    return max(0.0, last + backoff(len(failures)) - now)


def relaunch_reason(current: Sequence[Failed]) -> str:
    """Why a relaunch waits: ``3 failures in a row; last: replica 4 FAILED: exited with
    code 1``, for ``status`` beside when the wait ends (a count of seconds alone says
    neither what failed nor that the waits grow)."""
    failures = failures_in_a_row(current)
    if not failures:
        return "no failure counted"
    last = max(failures, key=lambda r: (r.updated_at, r.id))
    count = f"{len(failures)} failure{'s' if len(failures) != 1 else ''} in a row"
    why = f"{count}; last: replica {last.seq or last.id} {failure_status(last)}"
    return f"{why}: {last.failure}" if last.failure else why
