"""The executor: carries out a plan's actions (corral.plan) for one service.

It owns every side effect of a reconcile step: launch jobs (a claim on the machine first, a fair
share of the launch lane), draining, teardown jobs (bounded: a hung one is abandoned and retried),
and resuming a row whose last outcome was not recorded. It never waits on a job: its completion
callback posts to the loop, records the outcome and wakes the controller. Store first, then act.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable

from corral import deploy, plan
from corral.capacity import Grant
from corral.errors import in_words
from corral.infra.base import Infra, LaunchRequest, ReplicaHandle, scratch_root, terminate_told
from corral.infra.local_rules import claim_resources
from corral.jobs import Job, JobState
from corral.replicas import TEARING_DOWN, LaunchState, TeardownState, failure_status
from corral.servicecore import ServiceCore, handle_from_row, handle_to_json
from corral.spec import ServiceSpec
from corral.state import ReplicaRow, StateError

log = logging.getLogger("corral.controller")


class Executor:
    """Applies one service's plan; the controller's loop calls :meth:`apply`."""

    def __init__(self, svc: ServiceCore) -> None:
        self.svc = svc

    def apply(self, actions: list[plan.Action], rows: list[ReplicaRow]) -> None:
        """The executor: carry out a plan's actions, in order, over the rows it was made from."""
        by_id = {r.id: r for r in rows}
        for action in actions:
            match action:
                case plan.Resume(rid):
                    self._resume(by_id[rid])
                case plan.Retire(rid, reason):
                    self.retire(by_id[rid], reason)
                case plan.ScaleDown(rid, reason):
                    self.retire(self.svc.store.mark_scale_down(rid), reason)
                case plan.Launch(rid):
                    row = by_id[rid]
                    self._launch(row, self.svc.spec(row.version))
                case plan.Add(count, target, version):
                    self._add(count, target, version)
                case plan.Fail(reason):
                    self.svc.store.update_service(self.svc.name, failure=reason)
                    rt, held = self.svc.rt, self.svc.held_version  # who serves: the ready set
                    on = sorted({v for i, v in rt.versions.items() if i in rt.ready and v != held})
                    said = f"; traffic stays on version {', '.join(map(str, on))}" if on else ""
                    self.svc.store.event(self.svc.name, "service.failed", reason + said)
                    log.error("service %s: %s", self.svc.name, reason)
                case plan.ClearFailure():
                    self.svc.store.update_service(self.svc.name, failure=None)
                case plan.Switch(version):
                    self.svc.store.event(
                        self.svc.name, "update.switch", f"traffic to version {version}"
                    )
                case plan.Hold(version):
                    if version != self.svc.held_version:
                        self.svc.held_version = version
                        self.svc.publish_ready()
                case plan.MakeRoom(version, target, ready_new):
                    self._make_room(version, rows, target, ready_new)
                case plan.Forget(rid, reason):
                    purged = None if reason is None else "replica.purge"
                    self.svc.store.forget_replica(self.svc.name, rid, purged, reason)
                case plan.Note(text, until, why):
                    self.svc.last_decision = text
                    self.svc.backoff = None if until is None else (until, why or "")
                case _:
                    self._recover(action, by_id)

    def _recover(self, action: plan.Action, by_id: dict[int, ReplicaRow]) -> None:
        """The actions of restart recovery and of resuming a lost launch outcome."""
        match action:
            case plan.RestartTeardown(rid, reason):
                self.retire(self.svc.store.mark_teardown(rid, None), reason)
            case plan.Relaunch(rid, reason, forget_handle):
                self.svc.store.mark_relaunch(rid, forget_handle=forget_handle)
                self.svc.event(rid, "replica.relaunch", reason)
            case plan.Adopt(rid, reason, launched):
                r = by_id[rid]
                handle = handle_from_row(r)
                if launched:
                    self.svc.store.mark_launch(rid, LaunchState.SUCCEEDED)
                elif r.ready and handle is not None:
                    self.svc.rt.ready[rid] = handle.endpoint
                    self.svc.rt.versions[rid] = r.version
                self.svc.event(rid, "replica.adopt", reason)
            case plan.Unknown(rid, not_ready):
                if not_ready:
                    self.svc.store.mark_not_ready(rid)
                self.svc.event(rid, "replica.unknown", self.svc.unknown_reason(by_id[rid]))
            case plan.Gone(rid, liveness):
                r = by_id[rid]
                handle = handle_from_row(r)
                assert handle is not None, "a replica judged gone has a handle"
                self.svc.mark_gone(r, self.svc.infra_for(r), handle, liveness)

    def busy(self) -> plan.Busy:
        return plan.Busy(
            launching=frozenset(self.svc.rt.launches),
            tearing_down=frozenset(self.svc.rt.teardowns) | frozenset(self.svc.rt.draining),
        )

    def outcome_lost(self, r: ReplicaRow) -> bool:
        """A row mid-launch or mid-teardown that no job or drain of this controller works on
        (see :func:`corral.plan.outcome_lost`): the reconcile loop resumes it, as restart
        recovery does."""
        return plan.outcome_lost(r, self.busy())

    def _resume(self, r: ReplicaRow) -> None:
        """Finish a step whose outcome was not recorded (see :meth:`outcome_lost`)."""
        if r.teardown_state in TEARING_DOWN:
            # retire starts over from the drain (it writes teardown_state itself).
            self.retire(r, "teardown resumed (its progress was not recorded)")
            return
        if handle_from_row(r) is None:
            self.svc.store.mark_relaunch(r.id)
            self.svc.event(r.id, "replica.relaunch", "launch outcome not recorded; nothing started")
        elif r.id not in self.svc.rt.resuming:
            # Asked on a thread: a cluster that does not answer takes seconds per question.
            self.svc.rt.resuming.add(r.id)
            self.svc.spawn(self._resume_launch(r.id), name=f"corral-resume-{self.svc.name}-{r.id}")

    async def _resume_launch(self, replica_id: int) -> None:
        """Adopt or relaunch a started replica whose launch outcome was not recorded."""
        try:
            r = self.svc.store.replica(replica_id)
            handle = handle_from_row(r) if r is not None else None
            if r is None or handle is None or not self.outcome_lost(r):
                return
            liveness = await asyncio.to_thread(self.svc.liveness, r, handle)
            now = self.svc.store.replica(replica_id)
            if now is None or not self.outcome_lost(now) or now.handle_json != r.handle_json:
                return  # something else finished it meanwhile
            why = "launch outcome not recorded"
            actions = plan.launch_outcome(replica_id, liveness, why, tell_unknown=False)
            if not actions:
                return  # asked again on a later reconcile; a relaunch now could run it twice
            self.apply(actions, [now])
            self.svc.wake_event.set()
        except StateError as exc:
            log.warning(
                "service %s: replica %d not resumed yet: %s", self.svc.name, replica_id, exc
            )
        finally:
            self.svc.rt.resuming.discard(replica_id)

    def _add(self, count: int, target: int, version: int | None) -> None:
        svc = self.svc.store.service(self.svc.name)
        if svc is None:
            return
        version = version or svc.current_version  # an older one only while it serves alone
        spec = self.svc.spec(version)
        for _ in range(count):
            row = self.svc.store.add_replica(self.svc.name, version, spec.infra, f"target {target}")
            self._launch(row, spec)

    def _launch(self, r: ReplicaRow, spec: ServiceSpec) -> None:
        if r.id in self.svc.rt.launches:
            return
        if len(self.svc.rt.launches) >= self.svc.deps.launches_per_service:
            return  # a fair share of the launch lane: it stays PENDING, a later step launches it
        grant = self._grant(r, spec)
        if grant is None:
            return  # it does not fit now: PENDING with the reason; a freed claim wakes us
        infra = self.svc.infra_for(r)
        self.svc.launching(r)
        vrow = self.svc.store.version(self.svc.name, r.version)
        base = vrow.base_dir if vrow and vrow.base_dir else str(self.svc.dir)
        # The version's own copy of its workdir, and its env and secret values.
        workdir, envs = deploy.launch_inputs(
            self.svc.deps.home, self.svc.name, r.version, spec, base
        )
        replica_dir = scratch_root(self.svc.deps.home_marker) / self.svc.name / str(r.id)
        run = deploy.replica_command(spec, vrow.base_dir if vrow else None)  # as admission read it
        port = deploy.launch_port(spec, run)
        request = LaunchRequest(
            service=self.svc.name,
            replica_id=r.id,
            version=r.version,
            run=run,
            setup=spec.setup,
            envs={**envs, **grant.env},  # corral's device variables win
            workdir=workdir,
            replica_dir=replica_dir,
            log_path=self.svc.replica_log(r.seq),
            port=port,
            resources=spec.resources.model_dump(exclude_none=True),
            home_marker=self.svc.deps.home_marker,
            on_started=functools.partial(self._record_handle, r.id),
            setup_timeout=spec.service.setup_timeout_seconds,
            display_id=r.seq or None,
            cpu_ids=grant.claim.cpu_ids,
        )
        job = self.svc.deps.pool.submit(
            self._run_launch,
            infra,
            request,
            log=self.svc.launch_log(r.seq),
            name=f"{self.svc.name}-launch-{r.seq}",
            kind="launch",
            group=self.svc.name,  # one launch of each service runs, however full the lane
        )
        self.svc.rt.launches[r.id] = job
        job.add_done_callback(functools.partial(self._from_thread, self._launch_done, r.id))

    def _grant(self, r: ReplicaRow, spec: ServiceSpec) -> Grant | None:
        """What the replica may hold (written before its launch), or None while it waits (for
        room, or for its backend to connect): the reason kept for status, and an event."""
        capacity = self.svc.deps.capacity
        granted: Grant | str | None = self.svc.backend_waits(r)
        if granted is None:
            if capacity is None or r.infra != "local":
                return Grant()
            granted = capacity.grant(r.id, claim_resources(spec))
        if isinstance(granted, Grant):
            return granted
        self.svc.note_wait(r, granted)
        return None

    def _make_room(self, version: int, rows: list[ReplicaRow], target: int, ready_new: int) -> None:
        """A rolling update on a full machine: replace one old replica at a time instead of
        surging (:meth:`corral.capacity.Capacity.make_room`; docs/gpus.md)."""
        capacity = self.svc.deps.capacity
        if capacity is None:
            return
        picked = capacity.make_room(
            rows, version, target, ready_new, claim_resources(self.svc.spec(version))
        )
        if picked is not None:
            old, new = picked
            self.retire(
                old,
                f"rolling update to version {version}: no spare capacity, replacing one "
                f"at a time (what it holds goes to replica {new.id})",
            )

    def _run_launch(self, infra: Infra, request: LaunchRequest) -> ReplicaHandle:
        """The launch job (on a JobPool thread). The row turns PROVISIONING only here, when a
        launch slot is free: while the job waits in a saturated launch lane the replica stays
        PENDING ("waiting for a launch slot"), which is what status should say and what
        scale-down removes first. A restart finds it pending either way and launches it."""
        self.svc.store.mark_launch(
            request.replica_id, LaunchState.RUNNING, files_version=request.version
        )
        return infra.launch(request)

    def _from_thread(self, fn: Callable[[int, Job], None], replica_id: int, job: Job) -> None:
        """A job's done-callback runs on the job's thread: hand the result to the loop."""
        self.svc.loop.call_soon_threadsafe(self._job_done, fn, replica_id, job)

    def _job_done(self, fn: Callable[[int, Job], None], replica_id: int, job: Job) -> None:
        """Record a job's outcome; if the state file refuses the write (locked by another
        process), say so and let the reconcile loop resume the row (see outcome_lost)."""
        try:
            fn(replica_id, job)
        except StateError as exc:
            log.warning(
                "service %s: replica %d: outcome of job %s not recorded yet: %s",
                self.svc.name,
                replica_id,
                job.name,
                exc,
            )
            self.svc.wake_event.set()

    def _record_handle(self, replica_id: int, handle: ReplicaHandle) -> None:
        """Called from the launch thread the moment something exists: stored before use."""
        self.svc.store.record_handle(
            replica_id, handle_to_json(handle), handle.endpoint, time.time()
        )

    def _launch_done(self, replica_id: int, job: Job) -> None:
        self.svc.rt.launches.pop(replica_id, None)
        r = self.svc.store.replica(replica_id)
        if r is None:
            return
        if job.state is JobState.SUCCEEDED:
            self.svc.store.mark_launch(replica_id, LaunchState.SUCCEEDED)
            self.svc.event(replica_id, "replica.launched", r.endpoint)
            if job.log_error:
                # Running, but its launch output was lost (a full disk): say so where users look.
                self.svc.event(replica_id, "replica.log_error", job.log_error)
        elif job.state is JobState.CANCELLED:
            self.svc.store.mark_launch(replica_id, LaunchState.CANCELLED)
            self.svc.event(replica_id, "replica.launch_cancelled", None)
        elif isinstance(job.exception(), StateError):
            # The state file refused one of the launch's own writes (locked for longer than a
            # job waits): not the app's failure, so not counted against the version. Whatever
            # started and was not recorded was stopped by the backend; the reconcile loop
            # resumes the row as after a restart (outcome_lost): adopt or launch again.
            self.svc.store.event(
                self.svc.name,
                "replica.relaunch",
                f"launch not recorded: {job.exception()}",
                replica_id=replica_id,
            )
            self.svc.wake_event.set()
            return
        else:
            seq, said = self.svc.seq_of(replica_id), in_words(job.exception())
            detail = f"{said}; see `corral logs {self.svc.name} {seq} --launch`"
            self.svc.store.mark_launch(replica_id, LaunchState.FAILED, failure=detail)
            self.svc.event(replica_id, "replica.launch_failed", detail)
        r = self.svc.store.replica(replica_id)
        if r is not None and r.launch_state is LaunchState.CANCELLED:
            self.retire(r, "launch cancelled")
        self.svc.wake_event.set()

    def retire(self, r: ReplicaRow | None, reason: str) -> None:
        """Take a replica out of service: cancel its launch, or drain and tear it down."""
        if r is None or r.id in self.svc.rt.teardowns or r.id in self.svc.rt.draining:
            return
        if self._teardown_stuck(r.id):
            return  # its last terminate call has not returned: never stack another on it
        self.svc.set_ready(r.id, None)
        job = self.svc.rt.launches.get(r.id)
        if job is not None:
            if job.cancel():
                self.svc.store.event(
                    self.svc.name, "replica.cancel_launch", reason, replica_id=r.id
                )
            return  # _launch_done retires it once the launch has stopped
        if r.teardown_state is TeardownState.SUCCEEDED:
            return
        handle = handle_from_row(r)
        if handle is None:
            # Nothing was started: nothing to tear down.
            if failure_status(r) is not None:
                self.svc.store.mark_teardown(r.id, TeardownState.SUCCEEDED)
            else:
                self.svc.store.forget_replica(self.svc.name, r.id, "replica.removed", reason)
            self._freed()
            self.svc.wake_event.set()
            return
        if r.infra not in self.svc.deps.infras:
            # Nothing here can stop it (the daemon runs without that backend): say so once and
            # leave the row as it is, rather than retry a teardown that cannot start.
            if r.id not in self.svc.rt.no_backend:
                self.svc.rt.no_backend.add(r.id)
                self.svc.event(r.id, "replica.unknown", self.svc.unknown_reason(r))
            return
        self.svc.store.mark_teardown(r.id, TeardownState.PENDING)
        self.svc.store.event(self.svc.name, "replica.teardown", reason, replica_id=r.id)
        self.svc.rt.draining.add(r.id)
        self.svc.spawn(self._drain_then_teardown(r, handle, reason), f"corral-drain-{r.id}")

    async def _drain_then_teardown(self, r: ReplicaRow, handle: ReplicaHandle, why: str) -> None:
        try:
            if self.svc.balancer is not None and failure_status(r) is None:
                drained = await self.svc.balancer.wait_drained(r.id, self._drain_timeout(r))
                if not drained:
                    log.warning(
                        "service %s: replica %d still had requests after %gs of draining",
                        self.svc.name,
                        r.seq,
                        self._drain_timeout(r),
                    )
        finally:
            self.svc.rt.draining.discard(r.id)
        infra = self.svc.infra_for(r)
        try:
            self.svc.store.mark_teardown(r.id, TeardownState.RUNNING)
        except StateError as exc:
            # Nothing started yet: the reconcile loop resumes this teardown (outcome_lost).
            log.warning("service %s: replica %d: teardown postponed: %s", self.svc.name, r.seq, exc)
            return
        job = self.svc.deps.pool.submit(
            terminate_told,
            infra,
            handle,
            self.svc.deps.teardown_grace,
            why,
            log=self.svc.launch_log(r.seq),
            name=f"{self.svc.name}-teardown-{r.seq}",
            kind="teardown",
            log_required=False,  # an unwritable log must not keep a replica running
        )
        self.svc.rt.teardowns[r.id] = job
        job.add_done_callback(functools.partial(self._from_thread, self._teardown_done, r.id))
        self.svc.loop.call_later(self.svc.deps.teardown_timeout, self._teardown_overdue, r.id, job)

    def _freed(self) -> None:
        """A replica's claim (if any) is let go: those waiting for it, of any service, may fit."""
        if self.svc.deps.capacity is not None:
            self.svc.deps.capacity.freed()

    def _teardown_overdue(self, replica_id: int, job: Job) -> None:
        """Bound a teardown job: one running longer than ``teardown_timeout`` is abandoned.

        A thread cannot be killed, and a backend call that ignores cancellation (a stuck RPC)
        would otherwise keep the replica SHUTTING_DOWN, the service undeletable and a teardown
        slot taken, forever. Abandoning fails the job now (so it is recorded as FAILED_CLEANUP
        with the reason, like any failed teardown, and retried with backoff) and hands its slot
        to the next queued teardown; the replica's next attempt waits until the stuck call has
        returned, so stuck threads never pile up on one replica. Time spent queued for a slot
        does not count: that is a busy lane, not a hung call.
        """
        if job.done() or self.svc.stopping:
            return
        limit = self.svc.deps.teardown_timeout
        ran = job.run_seconds
        if ran is None or ran < limit:
            wait = max(0.1, limit - (ran or 0.0))
            self.svc.loop.call_later(wait, self._teardown_overdue, replica_id, job)
            return
        error = TimeoutError(
            f"teardown did not finish within {limit:g}s; its backend call is left running and "
            "the teardown is retried once it returns"
        )
        self.svc.rt.hung[replica_id] = job
        if self.svc.deps.pool.abandon(job, error):  # runs _teardown_done (FAILED_CLEANUP) next
            self.svc.event(replica_id, "replica.teardown_hung", str(error))
            log.error(
                "service %s: replica %d: %s", self.svc.name, self.svc.seq_of(replica_id), error
            )

    def _teardown_stuck(self, replica_id: int) -> bool:
        """True while an abandoned teardown of this replica is still inside its backend call."""
        job = self.svc.rt.hung.get(replica_id)
        if job is None:
            return False
        if job.returned():
            del self.svc.rt.hung[replica_id]
            return False
        return True

    def _drain_timeout(self, r: ReplicaRow) -> float:
        try:
            return self.svc.spec(r.version).service.load_balancer.drain_timeout_seconds
        except Exception:
            return self.svc.deps.drain_timeout

    def _teardown_done(self, replica_id: int, job: Job) -> None:
        self.svc.rt.teardowns.pop(replica_id, None)
        self.svc.rt.probes.pop(replica_id, None)
        r = self.svc.store.replica(replica_id)
        if r is None:
            return
        if job.state is JobState.SUCCEEDED:
            if failure_status(r) is not None:
                # Back to the replica's own failure (why it failed), without the teardown's.
                self.svc.store.mark_teardown(
                    replica_id, TeardownState.SUCCEEDED, failure=_replica_failure(r.failure)
                )
                self.svc.event(replica_id, "replica.terminated", None)
            else:
                # With its event, in one transaction: never a replica gone from the state
                # without a word in the event log, nor the word said twice.
                self.svc.store.forget_replica(self.svc.name, replica_id, "replica.terminated")
            self._freed()
        else:
            said = in_words(job.exception())
            detail = f"teardown failed: {said}; see {self.svc.launch_log(r.seq)}"
            # The replica's own failure stays in the text: it is why it was torn down.
            original = _replica_failure(r.failure)
            self.svc.store.mark_teardown(
                replica_id,
                TeardownState.FAILED,
                attempts=r.teardown_attempts + 1,
                failure=detail if original is None else f"{detail}{_BEFORE}{original}",
            )
            self.svc.event(replica_id, "replica.teardown_failed", detail)
            log.error("service %s: replica %d %s", self.svc.name, r.seq, detail)
        self.svc.wake_event.set()


_TEARDOWN_FAILED = "teardown failed: "
_BEFORE = "; replica: "


def _replica_failure(text: str | None) -> str | None:
    """A replica's own failure text, from a row whose text may have a teardown error in front
    (``teardown failed: ...; replica: <own failure>``)."""
    if text is None or not text.startswith(_TEARDOWN_FAILED):
        return text
    _, sep, original = text.partition(_BEFORE)
    return original if sep else None
