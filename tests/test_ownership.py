"""Nothing of a home outlives it: workers, daemons and replicas end with their home; one
balancer worker per slot, whatever stalls; a port someone else listens on is never served as
the service's (docs/architecture.md, "Owned by a home").

Real daemons, workers and replicas in temporary homes; every wait has a deadline, and what a
test started is ended by pid in its ``finally``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from conftest import (
    ENV_HOME_MARKER,
    CorralHome,
    kill_pids,
    pid_alive,
    spec_text,
    wait_for,
    write_spec,
)

from corral.dataplane.slots import FROZEN_AFTER
from corral.infra.base import scratch_root
from corral.ownership import worker_home_id

HOMES = 20
GONE_WITHIN = 60.0


def processes_of(marker: str) -> list[psutil.Process]:
    """Live workers (by ``--home-id``) and replicas (by environment) of the home ``marker``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            owner = worker_home_id(proc.cmdline())
            if (owner and owner[0] == marker) or proc.environ().get(ENV_HOME_MARKER) == marker:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def workers_of_slot(marker: str, slot: int) -> list[int]:
    pids = []
    for proc in psutil.process_iter():
        try:
            owner = worker_home_id(proc.cmdline())
            if owner == (marker, slot) and proc.status() != psutil.STATUS_ZOMBIE:
                pids.append(proc.pid)
        except psutil.Error:
            continue
    return pids


def new_home(tmp_path: Path, base: CorralHome, name: str) -> CorralHome:
    path = (tmp_path / name).resolve()
    return CorralHome(path=path, env={**base.env, "CORRAL_HOME": str(path)})


def up(home: CorralHome, name: str, replicas: int = 1) -> dict[str, object]:
    # One file per home: homes come up in parallel threads, and a shared file rewritten by one
    # thread reads as empty in another.
    spec = write_spec(home.path.parent / f"{home.path.name}-{name}.yaml", spec_text(name, replicas))
    home.run("up", str(spec), "-y", timeout=120)
    return home.wait_replicas(name, replicas, timeout=60)


def live_and_delete(home: CorralHome, way: str) -> tuple[str, set[int]]:
    """Bring a service up in ``home``, leave it one ``way``, delete the home; return its
    marker and every pid it had (daemon, workers, replicas)."""
    svc = up(home, "svc")
    marker = home.marker
    assert marker is not None
    pids = {p.pid for p in processes_of(marker)} | {home.daemon_pid()}
    assert len(pids) >= 3, (way, pids)  # a daemon, a worker at least, a replica
    if way == "down":
        home.run("down", "svc", "-y")
    elif way == "stop":
        home.run("daemon", "stop")
    elif way == "kill":
        os.kill(home.daemon_pid(), signal.SIGKILL)
    assert svc
    delete(home.path)
    return marker, pids


def delete(path: Path) -> None:
    """rm -rf, again while a live daemon still writes a file into it meanwhile."""

    def gone() -> bool:
        shutil.rmtree(path, ignore_errors=True)
        return not path.exists()

    wait_for(gone, 30, f"{path} deleted")


@contextlib.contextmanager
def cpu_burners(count: int, seconds: float) -> object:
    """One busy process per core, each ending by itself after ``seconds``."""
    code = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(count)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize("loaded", [False, True], ids=["idle", "loaded"])
def test_deleted_homes_leave_no_process_behind(
    corral_home: CorralHome, tmp_path: Path, loaded: bool
) -> None:
    """20 homes, each up and then left running, taken down, its daemon stopped or SIGKILLed,
    and deleted: within a minute no daemon, worker or replica of any of them runs."""
    ways = ["none", "down", "stop", "kill"]
    homes = [new_home(tmp_path, corral_home, f"h{i}") for i in range(HOMES)]
    seen: set[int] = set()
    burners = cpu_burners(os.cpu_count() or 1, 600) if loaded else contextlib.nullcontext()
    try:
        with burners, ThreadPoolExecutor(4) as pool:
            results = list(
                pool.map(lambda ih: live_and_delete(ih[1], ways[ih[0] % 4]), enumerate(homes))
            )
            for _, pids in results:
                seen |= pids

            def none_left() -> bool:
                left = [p.pid for marker, _ in results for p in processes_of(marker)]
                left += [pid for _, pids in results for pid in pids if pid_alive(pid)]
                return not left

            wait_for(none_left, GONE_WITHIN, "every process of the deleted homes to end", 0.5)
            # Nor their replicas' scratch directories: one per home, whichever way its daemon
            # went (with it stopped or killed, its workers were the last to know of the home).
            left = [str(scratch_root(m)) for m, _ in results if scratch_root(m).exists()]
            assert not left, left
    finally:
        kill_pids(seen)
        for home in homes:
            home._reap()


def test_a_stopped_worker_never_has_a_twin(corral_home: CorralHome, tmp_path: Path) -> None:
    """A worker held back by SIGSTOP past FROZEN_AFTER is ended and only then replaced: at
    no moment do two live workers hold one slot; and a second worker started by hand for a
    held slot exits at once."""
    corral_home.env["CORRAL_BALANCER_WORKERS"] = "1"
    svc = up(corral_home, "frozen")
    marker = corral_home.marker
    assert marker is not None
    (first,) = workers_of_slot(marker, 0)
    twin = subprocess.run(
        [sys.executable, "-m", "corral.dataplane.worker", "--slot", "0", "--home-id", marker],
        env=corral_home.env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert twin.returncode == 0 and "holds slot 0" in twin.stderr, twin.stderr
    assert workers_of_slot(marker, 0) == [first]
    os.kill(first, signal.SIGSTOP)
    try:

        def replaced() -> bool:
            pids = workers_of_slot(marker, 0)
            assert len(pids) <= 1, f"two live workers for slot 0: {pids}"
            return bool(pids) and pids != [first]

        wait_for(replaced, FROZEN_AFTER + 20, "the stopped worker to be replaced", 0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(first, signal.SIGCONT)
    assert not pid_alive(first)
    wait_for(
        lambda: corral_home.service("frozen")["status"] == "READY", 20, "the service READY again"
    )
    assert svc


def test_a_squatter_on_the_port_is_never_served_as_ours(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """Another program that listens on a service's port (SO_REUSEPORT, the same user) while
    no corral process runs: after `daemon start` the service is not READY, and says why."""
    svc = up(corral_home, "squat")
    port = int(str(svc["endpoint"]).rsplit(":", 1)[1])
    corral_home.run("daemon", "stop", "--all")
    squatter = socket.socket()
    try:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        corral_home.run("daemon", "start")

        def flagged() -> dict[str, object] | None:
            now = corral_home.service("squat")
            return now if now and now["balancer_errors"] else None

        shown = wait_for(flagged, 30, "the foreign listener in balancer_errors")
        assert shown["status"] == "CONTROLLER_FAILED", shown
        assert f"listens on 127.0.0.1:{port}" in str(shown["balancer_errors"]), shown
        assert str(os.getpid()) in str(shown["balancer_errors"]), shown  # names the squatter
        assert "CONTROLLER_FAILED" in corral_home.run("status", "squat").stdout
        events = corral_home.api("GET", "/v1/services/squat/events").json()
        assert any("listens on" in str(e) for e in events["events"]), events
    finally:
        squatter.close()
    wait_for(lambda: corral_home.service("squat")["status"] == "READY", 30, "READY once it is gone")
    assert corral_home.service("squat")["balancer_errors"] == []


def answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            return True
    except OSError:
        return False


def test_the_port_stays_the_services_while_no_worker_listens(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """While the daemon runs, a service's port is its own even in a moment when none of its
    workers listens (here: every worker killed while the daemon is stopped by SIGSTOP, so
    none is respawned yet): another program's bind on it fails. Then the workers come back."""
    svc = up(corral_home, "kept")
    port = int(str(svc["endpoint"]).rsplit(":", 1)[1])
    daemon = corral_home.daemon_pid()
    workers = corral_home.worker_pids()
    assert workers
    os.kill(daemon, signal.SIGSTOP)
    try:
        kill_pids(workers)
        wait_for(lambda: not any(pid_alive(p) for p in workers), 10, "the workers gone")
        for address in ("127.0.0.1", "0.0.0.0"):
            with socket.socket() as other:
                other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                with pytest.raises(OSError):
                    other.bind((address, port))
    finally:
        os.kill(daemon, signal.SIGCONT)
    wait_for(
        lambda: len(set(corral_home.worker_pids()) - set(workers)) == len(workers),
        30,
        "the workers respawned",
    )
    wait_for(lambda: corral_home.service("kept")["status"] == "READY", 30, "READY again")
    wait_for(lambda: answers(port), 30, "the respawned workers listening on the port")
    corral_home.run("down", "kept", "-y")
    with socket.socket() as after:  # down gives the port back
        after.bind(("127.0.0.1", port))


def test_workers_leave_when_nothing_is_left_to_serve(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """`daemon stop` with no service left stops the workers too; a worker with no route and
    no daemon exits by itself after its idle time."""
    up(corral_home, "brief")
    corral_home.run("down", "brief", "-y")
    workers = corral_home.worker_pids()
    assert workers
    stopped = corral_home.run("daemon", "stop")
    assert "balancer workers stopped" in stopped.stdout, stopped.stdout
    wait_for(lambda: not any(pid_alive(p) for p in workers), 20, "the workers to stop")

    corral_home.env["CORRAL_WORKER_IDLE_EXIT"] = "2"
    corral_home.start_daemon()
    idle = wait_for(corral_home.worker_pids, 20, "workers of the new daemon")
    corral_home.stop_daemon(signal.SIGKILL)
    wait_for(lambda: not any(pid_alive(p) for p in idle), 30, "idle workers to exit by themselves")


def test_home_watch_sees_deletion_replacement_and_a_lost_state_file(tmp_path: Path) -> None:
    from corral.ownership import HomeWatch

    home = tmp_path / "home"
    home.mkdir()
    (home / "home_id").write_text("abc\n")
    (home / "state.db").write_text("")
    watch = HomeWatch(home)
    assert watch.gone() is None
    (home / "state.db").unlink()
    assert watch.gone() is None  # once: a restore's moment between two files
    (home / "state.db").write_text("")
    assert watch.gone() is None
    (home / "state.db").unlink()
    watch.gone()
    assert "state file" in str(watch.gone())
    (home / "state.db").write_text("")
    # A read of the id that fails for another reason than the file being gone (here the file
    # is a directory: EISDIR, as EMFILE on a loaded machine), or an empty file (another
    # daemon's write under way) tells nothing: nothing is ended on it.
    (home / "home_id").unlink()
    (home / "home_id").mkdir()
    assert watch.gone() is None
    (home / "home_id").rmdir()
    (home / "home_id").write_text("")
    assert watch.gone() is None
    (home / "home_id").write_text("other\n")
    assert "home_id" in str(watch.gone())
    (home / "home_id").unlink()
    assert "home_id" in str(watch.gone())
    shutil.rmtree(home)
    assert "deleted" in str(watch.gone())
    home.mkdir()  # a new home at the path (the kernel may even give it the same inode)
    (home / "state.db").write_text("")
    assert watch.gone() is not None


def test_one_look_finds_each_services_foreign_listener() -> None:
    """The port check reads the machine's listening sockets once for all services
    (``ports.listening_on``) and still tells each service's foreign listener apart: a service
    whose port only our socket holds has none, one whose port another socket holds has that
    one, one whose port nobody holds has none, and a listener on another address than the one
    a service is reached at is not in its way."""
    from corral.dataplane.shared_ports import foreign_listeners

    with contextlib.ExitStack() as stack:
        socks = []
        for host in ("127.0.0.1", "127.0.0.1", "127.0.0.2"):
            sock = stack.enter_context(socket.socket())
            sock.bind((host, 0))
            sock.listen()
            socks.append(sock)
        (ours, theirs, elsewhere) = socks
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            free = probe.getsockname()[1]  # released: nobody listens there
        routes = {
            "ours": ("127.0.0.1", ours.getsockname()[1]),
            "taken": ("127.0.0.1", theirs.getsockname()[1]),
            "free": ("127.0.0.1", free),
            "other address": ("127.0.0.3", elsewhere.getsockname()[1]),
        }
        found = foreign_listeners(routes, {os.fstat(ours.fileno()).st_ino})
        want = {"taken": [("127.0.0.1", os.fstat(theirs.fileno()).st_ino)]}
    assert found == want, found


def test_a_home_leaves_no_scratch_directory_behind(corral_home: CorralHome, tmp_path: Path) -> None:
    """Replicas work in $TMPDIR/corral-<uid>/<home id>/ (outside the home, which a confined
    replica cannot see). A home whose services went and whose daemon stopped leaves nothing
    there, nor one deleted while its daemon ran; a daemon stopped with a service still up
    leaves its directory for the next daemon's replicas."""
    kept = new_home(tmp_path, corral_home, "kept")
    up(kept, "svc")
    marker = kept.marker
    assert marker is not None
    scratch = scratch_root(marker)
    assert scratch.is_dir()
    kept.run("daemon", "stop")
    assert scratch.is_dir()  # the service runs on: its replica's directory is in use
    kept.run("down", "svc", "-y")
    kept.run("daemon", "stop", "--all")
    assert not scratch.exists()

    deleted = new_home(tmp_path, corral_home, "deleted")
    up(deleted, "svc")
    marker = deleted.marker
    assert marker is not None
    daemon = deleted.daemon_pid()
    assert scratch_root(marker).is_dir()
    delete(deleted.path)
    wait_for(lambda: not pid_alive(daemon), GONE_WITHIN, "the deleted home's daemon to exit")
    assert not scratch_root(marker).exists()
