"""Chaos: replicas that misbehave, in a real daemon, next to a healthy service.

Every fault comes from one app, tests/apps/faulty.py, told on its command line what to do:
crash at start, crash under load, hang (accept, never answer), start slower than the initial
delay, flap its readiness, flood its log, or leave a tree of SIGTERM-ignoring children (some in
sessions of their own) behind. For each, the test checks:

* the status corral gives the replicas and the service (corral.replicas), and its reason;
* that corral replaces the replica or stops relaunching, as the failure policy says (a version
  that never had a READY replica stops after 3 failures; one that did is replaced);
* that a healthy second service in the SAME daemon keeps answering throughout: bounded traffic
  through its balancer on 127.0.0.1, where every failed request counts as lost (must be 0);
* that nothing is left running: the ``corral_home`` fixture fails a test that leaks a process,
  and the child-tree test checks every pid the tree wrote down.

The last test reproduces the local port race: another process binds the port a replica was
given before the replica does; the probe then reaches that process, which must not make the
replica READY (corral.infra.local.LocalInfra.endpoint_conflict).

Short by default (one round of each fault); ``CORRAL_CHAOS=long`` runs more rounds, longer load
and a bigger flood. Waits have deadlines; nothing is killed but by pid.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from chaos_support import LONG, record, rng, rounds, seconds
from conftest import APPS, EXAMPLES, CorralHome, http, pid_alive, wait_for

pytestmark = pytest.mark.timeout(900 if LONG else 240)

PY = sys.executable
GAVE_UP_WITHIN = 60.0  # deadline for a never-ready version to be given up (a loaded machine)
READY_WITHIN = 60.0


# -- helpers --------------------------------------------------------------------------------------


def spec_text(
    run: str,
    replicas: int,
    *,
    workdir: Path = APPS,
    initial_delay: float = 30,
    period: float = 0.2,
    timeout: float = 1,
    failure_timeout: float = 5,
    first_byte_timeout: float | None = None,
) -> str:
    lb = ""
    if first_byte_timeout is not None:
        lb = f"  load_balancer:\n    first_byte_timeout_seconds: {first_byte_timeout}\n"
    return (
        f"workdir: {workdir}\n"
        f"run: {json.dumps(run)}\n"
        "service:\n"
        "  readiness_probe:\n"
        "    path: /health\n"
        f"    initial_delay_seconds: {initial_delay}\n"
        f"    period_seconds: {period}\n"
        f"    timeout_seconds: {timeout}\n"
        f"    failure_timeout_seconds: {failure_timeout}\n"
        f"  replicas: {replicas}\n"
        f"{lb}"
    )


def faulty(*args: object) -> str:
    return f"exec {PY} faulty.py " + " ".join(str(a) for a in args)


def create(home: CorralHome, name: str, text: str) -> None:
    """``corral up -d`` through the API (the CLI's start-up costs a second per call)."""
    answer = home.api("POST", "/v1/services", body={"spec": text, "name": name}, timeout=30)
    assert answer.status == 201, (name, answer.status, answer.body[:500])


def service(home: CorralHome, name: str) -> dict[str, Any]:
    svc = home.service(name)
    assert svc is not None, f"service {name} is gone"
    return svc


def events(home: CorralHome, name: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = home.api("GET", f"/v1/services/{name}/events").json()["events"]
    return found


def statuses(svc: dict[str, Any]) -> list[str]:
    return [r["status"] for r in svc["replicas"]]


def down(home: CorralHome, *names: str) -> None:
    """Take services down through the API and wait until they are gone (their teardown
    finished: every replica process stopped)."""
    for name in names:
        answer = home.api("DELETE", f"/v1/services/{name}?purge=1")
        assert answer.status in (202, 404), (name, answer.status, answer.body)
    for name in names:
        wait_for(lambda n=name: home.service(n) is None, 90, f"service {name} to be removed")


def replica_ids(svc: dict[str, Any]) -> list[int]:
    return sorted(r["id"] for r in svc["replicas"])


@dataclass
class Traffic:
    """GETs to one URL from ``threads`` threads until stopped, bounded in count and time.

    Every request that is not a 200 within ``timeout`` s is a failure (kept, for the report).
    """

    url: str
    threads: int = 1
    max_requests: int = 20_000
    max_seconds: float = 600.0
    pace: float = 0.02  # between one thread's requests: bounded load, not a benchmark
    timeout: float = 15.0
    sent: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _workers: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Traffic:
        deadline = time.monotonic() + self.max_seconds
        for _ in range(self.threads):
            worker = threading.Thread(target=self._run, args=(deadline,), daemon=True)
            worker.start()
            self._workers.append(worker)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self, deadline: float) -> None:
        while not self._stop.is_set() and time.monotonic() < deadline:
            with self._lock:
                if self.sent >= self.max_requests:
                    return
                self.sent += 1
            try:
                answer = http(self.url + "/", timeout=self.timeout)
                if answer.status != 200:
                    self._fail(f"HTTP {answer.status}: {answer.body[:200]!r}")
            except OSError as exc:
                self._fail(repr(exc))
            self._stop.wait(self.pace)

    def _fail(self, what: str) -> None:
        with self._lock:
            self.failures.append(what)

    def join(self, timeout: float) -> None:
        """Wait until the load ends by itself (its time or request bound)."""
        wait_for(lambda: not any(w.is_alive() for w in self._workers), timeout, "the load to end")

    def stop(self) -> None:
        self._stop.set()
        for worker in self._workers:
            worker.join(timeout=self.timeout + 5)
        assert not any(w.is_alive() for w in self._workers), "a traffic thread is stuck"


def start_steady(home: CorralHome, name: str = "steady") -> str:
    """The healthy service every fault runs next to: 2 replicas of examples/app.py."""
    create(home, name, spec_text(f"exec {PY} app.py", 2, workdir=EXAMPLES))
    svc = home.wait_replicas(name, 2, timeout=READY_WITHIN)
    endpoint: str = svc["endpoint"]
    return endpoint


def assert_steady_served(traffic: Traffic, fault: str) -> None:
    assert traffic.sent > 0, f"no request reached the healthy service during {fault}"
    assert not traffic.failures, (
        f"the healthy service lost {len(traffic.failures)}/{traffic.sent} requests during "
        f"{fault}: {traffic.failures[:5]}"
    )


def until(
    home: CorralHome,
    name: str,
    predicate: Callable[[dict[str, Any]], bool],
    timeout: float,
    what: str,
) -> dict[str, Any]:
    """Poll service ``name`` until ``predicate(service)``; fail with its last state shown."""
    seen: list[dict[str, Any]] = []

    def check() -> dict[str, Any] | None:
        svc = service(home, name)
        seen[:] = [svc]
        return svc if predicate(svc) else None

    try:
        return wait_for(check, timeout, f"{name}: {what}")
    except AssertionError as exc:
        last = seen[0] if seen else None
        shown = None
        if last is not None:
            shown = {
                "status": last["status"],
                "failure": last["failure"],
                "replicas": [
                    (r["id"], r["status"], r["failure"], r["exit_code"]) for r in last["replicas"]
                ],
                "events": [(e["replica_id"], e["action"], e["reason"]) for e in events(home, name)][
                    -15:
                ],
            }
        raise AssertionError(f"{exc}\nlast seen: {json.dumps(shown, indent=1)}") from None


def wait_gave_up(home: CorralHome, name: str) -> dict[str, Any]:
    """The service is FAILED (given up) and every failed replica's teardown is over (a replica
    shows SHUTTING_DOWN until then, its failure status after)."""
    return until(
        home,
        name,
        lambda s: s["status"] == "FAILED" and "SHUTTING_DOWN" not in statuses(s),
        GAVE_UP_WITHIN,
        "FAILED (gave up), teardowns done",
    )


def wait_torn_down(home: CorralHome, name: str, svc: dict[str, Any]) -> None:
    """Every replica process the service ever showed is gone (teardown of failed replicas)."""
    pids = [r["pid"] for r in svc["replicas"] if r["pid"]]
    wait_for(
        lambda: not any(pid_alive(p) for p in pids), 60, f"replica processes of {name} to exit"
    )


# -- 1. never ready: crash at start, hang, slow start ---------------------------------------------


def test_never_ready_faults_stop_relaunching(corral_home: CorralHome) -> None:
    """Three versions that can never become READY: each fails in its own way, the service is
    given up (3 failures, no crash loop), and the healthy service never notices."""
    home = corral_home
    home.start_daemon()
    steady = start_steady(home)
    n_rounds = rounds(1, 3)
    expected = {
        # The app's own last line quoted (its stderr: "replica N: cannot start: ...").
        "crash": ("FAILED", "cannot start: simulated crash at start); see"),
        "hang": ("FAILED_INITIAL_DELAY", "no answer within"),
        "slow": ("FAILED_INITIAL_DELAY", "not ready within"),
    }
    names: list[str] = []
    with Traffic(steady, threads=2) as traffic:
        for round_no in range(n_rounds):
            r = rng("never_ready", round_no)
            delay = r.choice([1.5, 2.0, 2.5])
            specs = {
                "crash": spec_text(faulty("--mode", "crash-start"), 3),
                "hang": spec_text(faulty("--mode", "hang"), 3, initial_delay=delay),
                # Binds long after the initial delay: refused until then.
                "slow": spec_text(faulty("--mode slow-start --delay 120"), 3, initial_delay=delay),
                # The control: slow, but within its initial delay, so it must become READY.
                "intime": spec_text(
                    faulty("--mode slow-start --delay", delay), 1, initial_delay=30
                ),
            }
            for kind, text in specs.items():
                create(home, f"{kind}{round_no}", text)
                names.append(f"{kind}{round_no}")
            home.wait_replicas(f"intime{round_no}", 1, timeout=READY_WITHIN)
            for kind, (status, reason) in expected.items():
                name = f"{kind}{round_no}"
                svc = wait_gave_up(home, name)
                assert "never became ready" in svc["failure"], svc["failure"]
                failed = svc["replicas"]
                assert 3 <= len(failed) <= 4, failed
                assert all(x["status"] == status for x in failed), (name, failed)
                assert all(reason in (x["failure"] or "") for x in failed), (name, failed)
                if kind == "crash":
                    assert all(x["exit_code"] == 3 for x in failed), failed
                wait_torn_down(home, name, svc)

        # Given up means given up: over a few reconcile rounds (2 s each) nothing relaunches.
        given_up = [n for n in names if not n.startswith("intime")]
        ids = {n: replica_ids(service(home, n)) for n in given_up}
        time.sleep(4.5)  # an observation window, not a wait for something to happen
        for name in given_up:
            again = service(home, name)
            assert again["status"] == "FAILED", again
            assert replica_ids(again) == ids[name], (name, again["replicas"])
            assert again["last_decision"].startswith("not relaunching"), again["last_decision"]

    assert_steady_served(traffic, "never-ready faults")
    for kind in expected:
        record(
            f"replica {dict(crash='crash at start', hang='hang', slow='slow start')[kind]}",
            rounds=n_rounds,
            lost=len(traffic.failures),
            healthy_requests=traffic.sent,
            status=expected[kind][0],
        )


# -- 2. crash under load; flapping readiness ------------------------------------------------------


def test_crash_under_load_hang_and_flapping_readiness(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """A version that was READY and then crashes, hangs or flaps is replaced, never given up;
    a replica whose readiness flaps briefly goes NOT_READY and back without being replaced."""
    home = corral_home
    home.start_daemon()
    steady = start_steady(home)
    n_rounds = rounds(1, 3)
    load_seconds = seconds(8, 25)
    crash_load: list[dict[str, Any]] = []
    hang_load: list[dict[str, Any]] = []
    with Traffic(steady, threads=2) as traffic:
        for round_no in range(n_rounds):
            r = rng("crash_flap", round_no)
            crashy, hard, soft = f"crashy{round_no}", f"flaphard{round_no}", f"flapsoft{round_no}"
            requests = r.randint(25, 40)
            create(
                home,
                crashy,
                # 2 of its 3 replicas crash (a budget shared through a file), so one always
                # serves: then a request lost to a crash is lost by corral, not by capacity.
                spec_text(
                    faulty(
                        "--mode crash-after --requests",
                        requests,
                        f"--step 40 --crash-budget {tmp_path}/budget{round_no}:2",
                    ),
                    3,
                ),
            )
            # Down for 4 s, failure timeout 1 s: FAILED_PROBING, replaced.
            create(
                home,
                hard,
                spec_text(faulty("--mode flap --up 2 --down 4"), 1, failure_timeout=1),
            )
            # Down for 1 s at a time, failure timeout 30 s: NOT_READY and back, never failed.
            create(
                home,
                soft,
                spec_text(faulty("--mode flap --up 1 --down 1"), 1, failure_timeout=30),
            )
            # Serves for 3 s, then accepts and never answers: probes time out (1 s), so
            # FAILED_PROBING after 2 s of that; the balancer answers what it sent there with a
            # 504 after its first-byte timeout (4 s), never leaves a client waiting.
            hung = f"hung{round_no}"
            create(
                home,
                hung,
                spec_text(
                    faulty("--mode hang --after 3"), 2, failure_timeout=2, first_byte_timeout=4
                ),
            )
            hung_url = home.wait_replicas(hung, 2, timeout=READY_WITHIN, exact=False)["endpoint"]
            hang_traffic = Traffic(hung_url, threads=2, pace=0.1, timeout=30).__enter__()
            svc = home.wait_replicas(crashy, 3, timeout=READY_WITHIN)
            with Traffic(svc["endpoint"], threads=3, pace=0.05, max_seconds=load_seconds) as load:
                until(
                    home,
                    crashy,
                    lambda s: sum(x == "FAILED" for x in statuses(s)) >= 2,
                    load_seconds + 60,
                    "2 replicas to crash under load",
                )
                load.join(load_seconds + 30)
            # A request in flight to a replica that crashed, or sent to one whose death the
            # prober has not seen yet, is retried on another (a GET is idempotent): never lost.
            lost = load.failures
            crash_load.append({"sent": load.sent, "lost": len(lost)})
            assert not lost, f"{len(lost)}/{load.sent} requests lost to crashes: {lost[:5]}"

            # Replaced, not given up: the version had READY replicas.
            svc = home.wait_replicas(crashy, 3, timeout=READY_WITHIN, exact=False)
            assert svc["status"] == "READY", svc
            crashed = [x for x in svc["replicas"] if x["status"] == "FAILED"]
            assert len(crashed) == 2, svc["replicas"]  # the budget: exactly 2 crash
            assert all(x["exit_code"] == 4 for x in crashed), svc["replicas"]
            assert all("process exited (code 4" in x["failure"] for x in crashed), crashed
            assert len(svc["replicas"]) > 3, "no replacement was launched"

            # The hung one: FAILED_PROBING (probes time out), replaced, never given up; every
            # request sent to it was answered by the balancer (a 504 at worst), none hung.
            svc = until(
                home,
                hung,
                lambda s: statuses(s).count("FAILED_PROBING") >= 2,
                60,
                "hung replicas to be FAILED_PROBING",
            )
            hang_traffic.stop()
            probing = [x for x in svc["replicas"] if x["status"] == "FAILED_PROBING"]
            assert all("no answer within 1s" in x["failure"] for x in probing), probing
            assert svc["failure"] is None, svc
            unanswered = [f for f in hang_traffic.failures if not f.startswith("HTTP 5")]
            assert not unanswered, f"requests left without an answer: {unanswered[:5]}"
            kinds = Counter(
                " ".join(f.split()[:2]) + (" no ready replicas" if "no ready" in f else "")
                for f in hang_traffic.failures
            )
            hang_load.append({"sent": hang_traffic.sent, "failures": kinds})

            # The hard flapper: READY, then FAILED_PROBING and replaced (a new replica READY).
            svc = until(
                home,
                hard,
                lambda s: "FAILED_PROBING" in statuses(s) and "READY" in statuses(s),
                60,
                "FAILED_PROBING, then a READY replacement",
            )
            probing = [x for x in svc["replicas"] if x["status"] == "FAILED_PROBING"]
            assert all("probes failing" in x["failure"] for x in probing), probing
            assert svc["failure"] is None, svc

            # The soft flapper: the same replica went NOT_READY and READY again, twice.
            def soft_flapped(name: str = soft) -> list[dict[str, Any]] | None:
                evs = events(home, name)
                ups = [e for e in evs if e["action"] == "replica.ready"]
                downs = [e for e in evs if e["action"] == "replica.not_ready"]
                return evs if len(ups) >= 3 and len(downs) >= 2 else None

            evs = wait_for(soft_flapped, 60, f"{soft} to flap NOT_READY -> READY twice")
            assert len({e["replica_id"] for e in evs if e["action"] == "replica.ready"}) == 1, evs
            assert not [e for e in evs if e["action"] == "replica.failed"], evs
            assert service(home, soft)["failure"] is None
            down(home, crashy, hard, soft, hung)

    assert_steady_served(traffic, "crash under load and flapping")
    record(
        "replica crash under load",
        rounds=n_rounds,
        lost=len(traffic.failures) + sum(c["lost"] for c in crash_load),
        healthy_requests=traffic.sent,
        crashing_service_requests=sum(c["sent"] for c in crash_load),
        crashing_service_lost=sum(c["lost"] for c in crash_load),
    )
    record(
        "replica hang after READY",
        rounds=n_rounds,
        lost=len(traffic.failures),
        healthy_requests=traffic.sent,
        hung_service_requests=sum(h["sent"] for h in hang_load),
        hung_service_answers=dict(sum((h["failures"] for h in hang_load), Counter())),
        hung_service_unanswered=0,
    )
    record(
        "replica flapping readiness",
        rounds=n_rounds,
        lost=len(traffic.failures),
        healthy_requests=traffic.sent,
    )


# -- 3. output flood ------------------------------------------------------------------------------


def stream_length(url: str, token: str) -> int:
    """GET ``url`` (127.0.0.1) and count the bytes of its body, reading in chunks."""
    assert url.startswith("http://127.0.0.1:"), url
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    total = 0
    with urllib.request.urlopen(request, timeout=30) as response:
        while chunk := response.read(1 << 20):
            total += len(chunk)
    return total


def stream_while_polling(url: str, token: str, poll: Callable[[], None], timeout: float) -> int:
    """Stream ``url`` on a thread, calling ``poll`` every 0.1 s until it is done; its length."""
    streamed: list[int] = []
    reader = threading.Thread(target=lambda: streamed.append(stream_length(url, token)))
    reader.daemon = True
    reader.start()

    def done() -> bool:
        poll()
        return not reader.is_alive()

    wait_for(done, timeout, f"{url} to stream", interval=0.1)
    assert streamed, f"streaming {url} failed (see the thread's traceback above)"
    return streamed[0]


def log_tail(path: Path, size: int = 4096) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - size))
        return f.read().decode(errors="replace")


def test_output_flood(corral_home: CorralHome) -> None:
    """A replica writing hundreds of MB to stdout fast: its output goes to its log file
    (the daemon never reads it), the daemon's API keeps answering, the other service keeps
    serving, and the flooding replica itself stays READY."""
    home = corral_home
    # The whole flood on disk, unrotated: what this test measures is the daemon and the API
    # under it. The size cap (CORRAL_LOG_MAX_BYTES) is tested in tests/test_logfiles.py.
    home.env["CORRAL_LOG_MAX_BYTES"] = "0"
    home.start_daemon()
    steady = start_steady(home)
    n_rounds = rounds(1, 2)
    mib = int(seconds(80, 300))
    api_latencies: list[float] = []
    api_failures: list[str] = []
    sizes: list[int] = []
    with Traffic(steady, threads=2) as traffic:
        for round_no in range(n_rounds):
            name = f"flood{round_no}"
            create(home, name, spec_text(faulty("--mode flood --mb", mib), 1))
            svc = until(home, name, lambda s: bool(s["replicas"]), 30, "a replica row")
            rid = svc["replicas"][0]["id"]
            log = home.path / "services" / name / "logs" / f"replica_{rid}.log"

            def poll_api() -> None:
                """The daemon's API must answer every poll within its deadline (10 s)."""
                started = time.monotonic()
                try:
                    answer = home.api("GET", "/v1/services/steady", timeout=10)
                    if answer.status != 200:
                        api_failures.append(f"HTTP {answer.status}")
                except OSError as exc:
                    api_failures.append(repr(exc))
                api_latencies.append(time.monotonic() - started)

            def flooded(log: Path = log) -> bool:
                poll_api()
                return log.exists() and "FLOOD DONE" in log_tail(log)

            wait_for(flooded, 180, f"{name} to write {mib} MiB", interval=0.2)
            size = log.stat().st_size
            sizes.append(size)
            # No rotation and no cap: the whole flood is on disk (a limit, see the report).
            assert size >= mib << 20, (size, mib)
            # The flooding replica served all along and still does; its log's tail can be read
            # through the API without streaming the whole file.
            svc = home.wait_replicas(name, 1, timeout=READY_WITHIN)
            assert not [e for e in events(home, name) if e["action"] == "replica.failed"]
            answer = home.api(
                "GET",
                f"/v1/services/{name}/logs?replica={rid}&offset={size - 2000}",
                timeout=30,
            )
            assert answer.status == 200 and b"FLOOD DONE" in answer.body, answer.body[-300:]
            assert http(svc["endpoint"] + "/", timeout=15).status == 200

            # The whole log streamed through the API (what `corral logs NAME ID` does) while
            # the API is polled: the daemon reads it in chunks off its loop, and keeps answering.
            url = f"{home.api_url}/v1/services/{name}/logs?replica={rid}"
            streamed = stream_while_polling(url, home.token, poll_api, 180)
            assert streamed == size, (streamed, size)
            down(home, name)
            log.unlink()  # hundreds of MB: do not keep them in pytest's kept tmp dirs

    assert_steady_served(traffic, "an output flood")
    assert not api_failures, api_failures[:5]
    record(
        "replica output flood",
        rounds=n_rounds,
        lost=len(traffic.failures) + len(api_failures),
        healthy_requests=traffic.sent,
        flood_mib_per_round=mib,
        log_bytes_on_disk=max(sizes),
        api_polls=len(api_latencies),
        api_slowest_seconds=round(max(api_latencies), 3),
        rotation="off here (CORRAL_LOG_MAX_BYTES=0); the cap: tests/test_logfiles.py",
    )


# -- 4. child trees -------------------------------------------------------------------------------


def pids_in(pidfile: Path) -> list[int]:
    try:
        return [int(x) for x in pidfile.read_text().split()]
    except OSError:
        return []


def tree_size(children: int, depth: int) -> int:
    """Processes in a tree of ``depth`` levels of ``children`` each, leader included."""
    return sum(children**level for level in range(depth + 1))


def test_child_trees_are_killed(corral_home: CorralHome, tmp_path: Path) -> None:
    """Replicas that start trees of children and grandchildren, every node ignoring SIGTERM,
    half of them in sessions of their own (out of the replica's process group), respawning
    children that die: a teardown leaves none of them, whether the replica is taken down or
    its leader crashes and leaves the tree behind."""
    home = corral_home
    home.start_daemon()
    steady = start_steady(home)
    n_rounds = rounds(1, 3)
    children = 2 if not LONG else 3
    tree_replicas = 1 if not LONG else 2
    size = tree_size(children, 2)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    killed = 0
    with Traffic(steady, threads=2) as traffic:
        for round_no in range(n_rounds):
            tree, orphaner = f"tree{round_no}", f"orphaner{round_no}"
            pidfile = f"{pid_dir}/{{name}}-$CORRAL_REPLICA_ID.pids"
            base = f"--mode tree --children {children} --depth 2 --respawn"
            create(
                home,
                tree,
                spec_text(faulty(base, "--pidfile", pidfile.format(name=tree)), tree_replicas),
            )
            # Its leader exits after 2 s, leaving its tree: FAILED (code 5), then replaced.
            create(
                home,
                orphaner,
                spec_text(
                    faulty(base, "--leader-exit-after 2 --pidfile", pidfile.format(name=orphaner)),
                    1,
                ),
            )
            svc = home.wait_replicas(tree, tree_replicas, timeout=READY_WITHIN)
            files = [pid_dir / f"{tree}-{r['id']}.pids" for r in svc["replicas"]]
            for f in files:
                wait_for(lambda f=f: len(pids_in(f)) >= size, 60, f"the tree of {f.name}")

            # The orphaner: its leader crashed; the teardown of that replica kills its tree.
            svc = until(
                home,
                orphaner,
                lambda s: any(r["status"] == "FAILED" for r in s["replicas"]),
                60,
                "the leader to exit",
            )
            first = next(r for r in svc["replicas"] if r["status"] == "FAILED")
            assert first["exit_code"] == 5, first
            until(
                home,
                orphaner,
                lambda s, i=first["id"], n=orphaner: any(
                    e["action"] == "replica.terminated" and e["replica_id"] == i
                    for e in events(home, n)
                ),
                60,
                f"replica {first['id']}'s teardown",
            )
            orphaned = pids_in(pid_dir / f"{orphaner}-{first['id']}.pids")
            assert len(orphaned) >= size, orphaned
            alive = [p for p in orphaned if pid_alive(p)]
            assert not alive, f"the crashed replica's tree outlived its teardown: {alive}"

            down(home, tree, orphaner)
            every = [p for f in pid_dir.glob(f"*{round_no}-*.pids") for p in pids_in(f)]
            alive = [p for p in every if pid_alive(p)]
            assert not alive, f"processes of the trees outlived `down`: {alive}"
            killed += len(every)

    assert_steady_served(traffic, "child trees")
    record(
        "replica child trees",
        rounds=n_rounds,
        lost=len(traffic.failures),
        healthy_requests=traffic.sent,
        tree_processes_killed=killed,
    )


# -- 5. the local port race -----------------------------------------------------------------------


class _Foreign(BaseHTTPRequestHandler):
    """Another program that took the replica's port: answers 200 to everything."""

    hits: list[str] = []

    def do_GET(self) -> None:
        type(self).hits.append(self.path)
        body = b'{"foreign": true}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_port_taken_before_the_replica_binds_is_not_ready(corral_home: CorralHome) -> None:
    """LocalInfra hands a replica a free port that the app binds later. Another process that
    binds it first answers the probes: the replica must not become READY on its answers (nor
    get traffic routed there); it fails when it cannot bind, and its replacement serves."""
    home = corral_home
    home.start_daemon()
    n_rounds = rounds(1, 3)
    conflicts = 0
    for round_no in range(n_rounds):
        name = f"late{round_no}"
        create(home, name, spec_text(faulty("--mode slow-start --delay 3"), 1))
        svc = until(
            home, name, lambda s: bool(s["replicas"] and s["replicas"][0]["endpoint"]), 30, "port"
        )
        victim = svc["replicas"][0]
        port = int(victim["endpoint"].rsplit(":", 1)[1])
        _Foreign.hits = []
        try:
            foreign = ThreadingHTTPServer(("127.0.0.1", port), _Foreign)
        except OSError as exc:  # the app bound first: it sleeps 3 s, so this is not expected
            raise AssertionError(f"could not take port {port} before the replica: {exc}") from None
        thread = threading.Thread(target=foreign.serve_forever, daemon=True)
        thread.start()
        try:
            with Traffic(svc["endpoint"], pace=0.1, timeout=70) as traffic:
                # The app wakes up, cannot bind (EADDRINUSE) and exits: FAILED.
                until(
                    home,
                    name,
                    lambda s: s["replicas"][0]["status"] == "FAILED",
                    60,
                    "the replica to fail to bind",
                )
            evs = [e for e in events(home, name) if e["replica_id"] == victim["id"]]
            actions = [e["action"] for e in evs]
            assert "replica.ready" not in actions, evs
            conflict = [e for e in evs if e["action"] == "replica.endpoint_conflict"]
            assert conflict and f"port {port}" in conflict[0]["reason"], evs
            assert f"pid {os.getpid()}" in conflict[0]["reason"], conflict
            assert "/health" in _Foreign.hits, "the probe never reached the foreign listener"
            routed = [h for h in _Foreign.hits if h != "/health"]
            assert not routed, f"the balancer sent {len(routed)} requests to the foreign process"
            assert traffic.sent > 0
            conflicts += len(conflict)
        finally:
            foreign.shutdown()
            foreign.server_close()
            thread.join(timeout=10)
        # The replacement gets a port of its own and serves.
        svc = home.wait_replicas(name, 1, timeout=READY_WITHIN, exact=False)
        answer = http(svc["endpoint"] + "/", timeout=15)
        assert answer.status == 200 and answer.json()["mode"] == "slow-start", answer.body
        down(home, name)

    record(
        "local port race (foreign listener on a replica's port)",
        rounds=n_rounds,
        lost=0,
        conflicts_detected=conflicts,
    )
