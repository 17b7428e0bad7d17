"""One balancer worker replaced by a new process (``corral daemon restart-workers``).

Kept apart from :mod:`corral.dataplane.plane` (the daemon's bookkeeping of its workers): this is
one slot's sequence, in order, and nothing else. The new process is already started and binds
every port beside the old one (SO_REUSEPORT); once it has applied the table the old one is told
to exit, drains its requests under way for the longest ``drain_timeout`` of the services (then
SIGKILL), and what it counted on the slot's hand-over rows of the shared boards goes with it
(:func:`corral.balancer.load_board.clear_hand_over`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from corral.balancer.load_board import clear_hand_over
from corral.dataplane.processes import find_process, old_worker_grace
from corral.dataplane.protocol import encode
from corral.procfs import terminate_all

if TYPE_CHECKING:
    from corral.dataplane.plane import DataPlane
    from corral.state import WorkerRow

__all__ = ["replace_worker"]

log = logging.getLogger("corral.dataplane")


async def replace_worker(
    plane: DataPlane, slot: int, old: WorkerRow, new: int, timeout: float
) -> None:
    """``old``, the worker of ``slot``, gives way to process ``new`` (started as its successor):
    gone when this returns, so the next slot is touched only then."""
    seq = plane.current_seq()

    def ready() -> bool:
        conn = plane._conns.get(new)
        return conn is not None and conn.seq >= seq

    if not await plane.wait_until(ready, timeout):
        log.warning("new balancer worker %d (pid %d) did not take over in time", slot, new)
    conn = plane._conns.get(old.pid)
    if conn is not None:
        with contextlib.suppress(OSError):
            conn.writer.write(encode({"t": "exit"}))
    proc = find_process(old.pid, old.created)
    if proc is not None:  # SIGTERM asks what "exit" asks (drain, then go); SIGKILL past that
        grace = old_worker_grace(route.route for route in plane.routes.values())
        await asyncio.to_thread(terminate_all, [proc], grace)
    clear_hand_over(plane.home / "dataplane", slot, plane.size)
    # Until it was told to exit the old one wrote the slot's row too, after the new one had
    # written it from its table: the table again has each worker write its row anew, or a
    # count of the old one's stayed there (a replica full under a limit, loaded by nothing).
    plane.changed()
