"""corral.fallback: after an update gave up, the version still serving keeps its size.

Replayed with test_plan's :class:`Sim` (rows and a clock, launches and teardowns at once), its
steps extended as the controller's: the fallback version in the facts, and
:func:`corral.fallback.keep_serving` after :func:`corral.plan.toward_target`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conftest import CorralHome, spec_text, wait_for, write_spec
from test_plan import R, Sim, started

from corral import fallback, plan
from corral.plan import Add, Busy, Facts, Note
from corral.replicas import ReplicaStatus, UpdateMode, replica_status


@dataclass(frozen=True)
class V:
    version: int
    first_ready_at: float | None


class FallbackSim(Sim):
    """A :class:`Sim` whose step also keeps the serving version, as the controller's does."""

    def step(self) -> list[plan.Action]:
        actions = plan.upkeep(list(self.rows.values()), Busy(), self.now)
        self.apply(actions)
        rows = list(self.rows.values())
        ready = self.version in self.ready_versions
        versions = [V(v, 1.0 if v in self.ready_versions else None) for v in range(1, 10)]
        f = Facts(
            rows=rows,
            version=self.version,
            mode=self.mode,
            min_replicas=self.min_replicas,
            version_ready=ready,
            target=self.target,
            failure=self.failure,
            fallback=fallback.fallback_version(versions, self.version, ready, rows),
        )
        later = [*plan.toward_target(f, self.now), *fallback.keep_serving(f, self.now)]
        self.apply(later)
        return actions + later

    def apply(self, actions: list[plan.Action]) -> None:
        for a in actions:
            if isinstance(a, Add) and a.version is not None:
                for _ in range(a.count):
                    rid = next(self.ids)
                    self.rows[rid] = R(rid, a.version, seq=rid, updated_at=self.now)
            else:
                super().apply([a])


def failed_update(target: int, mode: UpdateMode = UpdateMode.ROLLING) -> FallbackSim:
    """A service of ``target`` READY version-1 replicas whose update to version 2 gave up."""
    sim = started(target)
    sim.__class__ = FallbackSim
    sim.update(mode)
    for _ in range(30):
        sim.step()
        for r in list(sim.rows.values()):
            if r.version == 2 and replica_status(r) is ReplicaStatus.STARTING:
                sim.crash(r.id)
        sim.now += 1
    assert sim.failure is not None and sim.failure.startswith("version 2 never became ready")
    assert sim.statuses(1) == [ReplicaStatus.READY] * target
    return sim


def test_a_lost_replica_of_the_version_still_serving_is_replaced_by_that_version() -> None:
    sim = failed_update(2)
    lost = next(r.id for r in sim.rows.values() if r.version == 1)
    last = max(sim.rows)
    sim.crash(lost)
    for _ in range(5):
        sim.step()
        sim.now += 1
    new = [r for r in sim.rows.values() if r.id > last]
    assert [r.version for r in new] == [1]
    assert len(new) == 1, sim.rows
    assert replica_status(new[0]) is ReplicaStatus.STARTING  # not retired by the rolling rule
    sim.become_ready(new[0].id)
    sim.step()
    assert sim.serving() == 2
    assert sim.statuses(1).count(ReplicaStatus.READY) == 2
    assert not any(replica_status(r) is ReplicaStatus.STARTING for r in sim.rows.values())


def test_a_blue_green_update_that_gave_up_keeps_its_old_version_too() -> None:
    sim = failed_update(1, UpdateMode.BLUE_GREEN)
    (old,) = (r.id for r in sim.rows.values() if r.version == 1)
    sim.retire(old)  # `corral down NAME --replica-id N`
    sim.step()
    (new,) = (r for r in sim.rows.values() if r.version == 1)
    assert replica_status(new) is ReplicaStatus.STARTING
    sim.become_ready(new.id)
    sim.step()
    assert sim.serving() == 1  # version 2 is still held, with nothing READY to hold


def test_nothing_is_kept_while_the_current_version_may_still_become_ready() -> None:
    rows = [R(1, 1, ready=1, first_ready_at=1.0), R(2, 2)]
    versions = [V(1, 1.0), V(2, None)]
    assert fallback.fallback_version(versions, 2, False, rows) is None
    # A first version that never became READY has nothing older to fall back on.
    crashed = [R(i, 1, app_failed=1, failure="exit 1") for i in (1, 2, 3)]
    assert fallback.fallback_version([V(1, None)], 1, False, crashed) is None
    # Gave up: the newest older version that was READY serves.
    failed = [R(i, 3, app_failed=1, failure="exit 1") for i in (5, 6, 7)]
    assert fallback.fallback_version([V(1, 1.0), V(2, 2.0), V(3, None)], 3, False, failed) == 2


def given_up(rows: list[R], target: int, fallback_version: int | None) -> Facts:
    """A rolling update to version 2 that never became READY, and who serves meanwhile."""
    return Facts(
        rows=rows,
        version=2,
        mode=UpdateMode.ROLLING,
        min_replicas=target,
        version_ready=False,
        target=target,
        fallback=fallback_version,
    )


def test_a_replacement_waits_for_the_backoff_of_its_version() -> None:
    rows = [R(1, 1, app_failed=1, failure="exit 1", first_ready_at=1.0, updated_at=100.0)]
    facts = given_up(rows, 1, 1)
    assert fallback.keep_serving(facts, 100.5) == [
        Note("waiting 0s before replacing a version 1 replica")
    ]
    assert fallback.keep_serving(facts, 101.0)[0] == Add(1, 1, 1)


def test_end_to_end_the_old_version_is_kept_at_its_size_after_a_failed_update(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """`corral update` to a version that cannot start: rc 1, traffic stays on version 1. Then
    one version-1 replica is taken down (`--replica-id`, "a replacement starts"): a version-1
    replica replaces it and the service is back at 2 READY, instead of staying at 1 for good
    (and at 0, a 503 outage, when the last one goes)."""
    spec = write_spec(tmp_path / "svc.yaml", spec_text("keep", 2))
    corral_home.run("up", str(spec))
    bad = write_spec(tmp_path / "bad.yaml", spec_text("keep", 2, run="echo bad; exit 1"))
    result = corral_home.run("update", "keep", str(bad), check=False, timeout=90)
    assert result.returncode == 1 and "traffic stays on version 1" in result.stderr
    first, second = (r["id"] for r in corral_home.status("keep")["replicas"] if r["version"] == 1)
    corral_home.run("down", "keep", "--replica-id", str(first), "-y")
    corral_home.run("down", "keep", "--replica-id", str(second), "-y")

    def back() -> dict[str, Any] | None:
        svc = corral_home.status("keep")
        ready = [r for r in svc["replicas"] if r["status"] == "READY"]
        ids = {r["id"] for r in ready}
        return svc if len(ready) == 2 and not ids & {first, second} else None

    svc = wait_for(back, 60, "two new version-1 replicas READY")
    assert {r["version"] for r in svc["replicas"] if r["status"] == "READY"} == {1}
    assert svc["status"] == "READY" and svc["traffic_versions"] == [1], svc


def test_no_room_is_made_for_a_version_given_up() -> None:
    """A relaunch of the version that gave up may still wait for a device (a full machine):
    the rolling rule must not retire a replica still serving to make room for it. (It did,
    once the fallback's own new replica made the old ones look like enough: 0 READY.)"""
    rows = [
        R(1, 1, ready=1, first_ready_at=1.0),
        R(7, 1),  # the fallback's replacement, starting
        R(6, 2),  # the given-up version's last relaunch, waiting for a device
    ]
    for fallback_version, made in ((1, False), (None, True)):
        actions = plan.replace_old_versions(given_up(rows, 2, fallback_version))
        assert any(isinstance(a, plan.MakeRoom) for a in actions) is made, actions
        if fallback_version is not None:  # and what still serves is kept, starting or not
            assert not any(isinstance(a, plan.Retire) for a in actions), actions
