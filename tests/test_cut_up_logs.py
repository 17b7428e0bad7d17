"""A new service's logs start apart from an earlier same-name service's, also across a crash.

`up` set the earlier service's logs aside (``logs.previous``) only after storing the new
service's row: a daemon killed between the two left the new service, started again by the next
daemon, writing on in the earlier one's files (its replica 1 appended to the other's replica 1
log). They are set aside before the row now; an `up` that is then refused or cut leaves an empty
directory, which the next `up` does not set aside over the earlier service's logs.
"""

from __future__ import annotations

import sys
from pathlib import Path

from conftest import CorralHome, spec_text, write_spec

from corral import logfiles

# The real daemon, dying (as SIGKILL) right after it stored a new service's row.
DIES_AFTER_CREATE = """
import asyncio, os, sys
from pathlib import Path
from corral import state
from corral.bootstrap import serve

real = state.Store.create_service

def create_service(self, *args, **kwargs):
    real(self, *args, **kwargs)
    os._exit(137)

state.Store.create_service = create_service
asyncio.run(serve(Path(sys.argv[1])))
"""

OLD = "a line of the earlier service's replica 1\n"


def test_a_service_created_across_a_crash_has_logs_of_its_own(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    spec = write_spec(tmp_path / "s.yaml", spec_text("again", 1))
    corral_home.run("up", str(spec))
    corral_home.run("down", "again", "-y")
    logs = corral_home.path / "services" / "again" / "logs"
    with (logs / "replica_1.log").open("a") as log:
        log.write(OLD)
    corral_home.stop_daemon()
    argv = [sys.executable, "-c", DIES_AFTER_CREATE, str(corral_home.path)]
    corral_home.start_daemon(argv=argv)
    assert corral_home.run("up", str(spec), "-d", check=False).returncode != 0
    corral_home._reap()
    corral_home.start_daemon()  # starts the stored service
    corral_home.wait_replicas("again", 1, timeout=60)
    assert OLD not in (logs / "replica_1.log").read_text()
    assert OLD in (logs.with_name("logs.previous") / "replica_1.log").read_text()
    corral_home.run("down", "again", "-y")


def test_an_up_refused_after_setting_logs_aside_keeps_the_earlier_ones(tmp_path: Path) -> None:
    logs = tmp_path / "svc" / "logs"
    logfiles.fresh(logs)
    (logs / "controller.log").write_text("the earlier service")
    logfiles.fresh(logs)  # an up, then refused: nothing written in the new directory
    logfiles.fresh(logs)  # the next up
    previous = logs.with_name("logs.previous") / "controller.log"
    assert previous.read_text() == "the earlier service"
    assert sorted(p.name for p in logs.iterdir()) == [logfiles.MARKER]
