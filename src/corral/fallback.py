"""The version that keeps serving while the current one gave up.

An update whose version never becomes READY is given up (:func:`corral.plan.gave_up`: no crash
loop), and its old replicas keep the traffic ("traffic stays on version 1"). Those replicas are
the service now: one that crashes, fails its probes or is taken down with ``--replica-id`` must
be replaced, or the service shrinks for good, down to no replica at all. The current version
cannot replace it (it gave up), so the one that served before it does, with its own spec and
files, at the target and with the backoff of any relaunch, until the next update.

Pure, as :mod:`corral.plan`: the controller passes the rows and the versions it read.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from corral.plan import Action, Add, Facts, Note, Row, gave_up
from corral.relaunch import relaunch_reason, relaunch_wait
from corral.replicas import is_live


class VersionFacts(Protocol):
    """What this module reads of a stored version (a :class:`corral.state.VersionRow`)."""

    @property
    def version(self) -> int: ...
    @property
    def first_ready_at(self) -> float | None: ...


def fallback_version(
    versions: Iterable[VersionFacts], current: int, version_ready: bool, rows: Sequence[Row]
) -> int | None:
    """The version that serves in place of ``current``: the newest older one that was READY,
    when ``current`` gave up; None while ``current`` may still become READY."""
    if gave_up(current, version_ready, [r for r in rows if r.version == current]) is None:
        return None
    return newest_ready_before(versions, current)


def newest_ready_before(versions: Iterable[VersionFacts], current: int) -> int | None:
    """The newest version older than ``current`` that was ever READY, or None: the one that
    serves in ``current``'s place once it gave up."""
    older = [v.version for v in versions if v.version < current and v.first_ready_at]
    return max(older, default=None)


def keep_serving(facts: Facts, now: float) -> list[Action]:
    """Replicas of ``facts.fallback`` to add so that the replicas still serving reach the
    target again (none while a relaunch of that version must wait: backoff)."""
    if facts.fallback is None:
        return []
    serving = [r for r in facts.rows if r.version != facts.version and is_live(r)]
    missing = facts.target - len(serving)
    if missing <= 0:
        return []
    own = [r for r in facts.rows if r.version == facts.fallback]
    wait = relaunch_wait(own, now)
    if wait > 0:
        text = f"waiting {wait:.0f}s before replacing a version {facts.fallback} replica"
        return [Note(text, until=now + wait, why=relaunch_reason(own))]
    why = f"version {facts.version} gave up; version {facts.fallback} serves"
    return [Add(missing, facts.target, facts.fallback), Note(f"{why}: launching {missing}")]
