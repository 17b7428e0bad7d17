"""The pieces under `corral status` and `corral logs` that need no daemon: replica ids per
service in the state file (and their migration), what a status row says, tailing a file."""

from __future__ import annotations

import asyncio
import socket
import sqlite3
import tracemalloc
from pathlib import Path
from typing import Any

import aiohttp

from corral import cliview
from corral.cli_wait import failed_text
from corral.home import home_problem
from corral.loglines import (
    balancer_lines,
    balancer_tail,
    names_service,
    span_chunks,
    tail_offset,
    tail_spans,
)
from corral.probe import probe
from corral.state import _MIGRATIONS, Store, _split


def test_replica_ids_count_per_service_and_are_never_reused(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    for name in ("a", "b"):
        store.create_service(name, "run: x", source=None, base_dir=None, lb_port=None)
    a = [store.add_replica("a", 1, "local", "t") for _ in range(3)]
    b = [store.add_replica("b", 1, "local", "t") for _ in range(2)]
    assert [r.seq for r in a] == [1, 2, 3] and [r.seq for r in b] == [1, 2]
    store.delete_replica(a[-1].id)  # the newest goes: its number is not handed out again
    assert store.add_replica("a", 1, "local", "t").seq == 4
    found = store.replica_by_seq("b", 2)
    assert found is not None and found.id == b[1].id
    assert store.replica_by_seq("b", 3) is None


def test_schema_3_file_gets_ids_per_service(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    db = sqlite3.connect(path)
    for migration in _MIGRATIONS[:3]:
        for statement in _split(migration):
            db.execute(statement)
    db.execute("PRAGMA user_version = 3")
    for name in ("a", "b"):
        db.execute(
            "INSERT INTO services (name, current_version, created_at, updated_at)"
            " VALUES (?, 1, 0, 0)",
            (name,),
        )
    for name in ("a", "b", "a", "a", "b"):
        db.execute(
            "INSERT INTO replicas (service, version, infra, created_at, updated_at)"
            " VALUES (?, 1, 'local', 0, 0)",
            (name,),
        )
    db.commit()
    db.close()
    store = Store(path)
    assert [r.seq for r in store.replicas("a")] == [1, 2, 3]
    assert [r.seq for r in store.replicas("b")] == [1, 2]
    assert store.add_replica("b", 1, "local", "t").seq == 3


def _service(**extra: Any) -> dict[str, Any]:
    service: dict[str, Any] = {
        "name": "s",
        "status": "READY",
        "endpoint": "http://127.0.0.1:1",
        "version": 2,
        "target": 1,
        "replicas": [],
    }
    service.update(extra)
    return service


def _replica(rid: int, version: int, status: str, **extra: Any) -> dict[str, Any]:
    return {"id": rid, "version": version, "status": status, **extra}


def test_row_names_the_version_taking_traffic() -> None:
    # Blue-green: v2 is READY but held; traffic is on v1.
    held = _service(
        replicas=[_replica(1, 1, "READY"), _replica(2, 2, "READY")], traffic_versions=[1]
    )
    assert cliview.version_text(held) == "1 (v2 starting)"
    assert cliview.ready_text(held) == "1/1"
    # A failed update: the row says v1 serves and v2 failed.
    failed = _service(
        replicas=[_replica(1, 1, "READY"), _replica(2, 2, "FAILED")],
        traffic_versions=[1],
        last_update_failure="version 2 never became ready",
    )
    assert cliview.version_text(failed) == "1 (v2 failed)"
    done = _service(replicas=[_replica(3, 2, "READY")], traffic_versions=[2])
    assert cliview.version_text(done) == "2" and cliview.ready_text(done) == "1/1"


def test_a_failed_blue_green_version_is_not_said_to_get_traffic_soon() -> None:
    """It never will: it gave up. The note said it would, next to the line that it failed."""
    failed = _service(
        replicas=[_replica(1, 1, "READY"), _replica(2, 2, "FAILED_INITIAL_DELAY")],
        traffic_versions=[1],
        traffic_held_for_version=2,
        last_update_failure="version 2 never became ready and 3 replicas failed",
    )
    texts = [text for _, text in cliview.service_notes(failed)]
    assert not any("gets traffic once" in text for text in texts)
    assert any("update failed, traffic stays on version 1" in text for text in texts)
    starting = _service(replicas=[_replica(1, 1, "READY")], traffic_held_for_version=2)
    assert any("gets traffic once" in t for _, t in cliview.service_notes(starting))


def test_failed_replicas_fold_after_the_newest_few() -> None:
    replicas = [_replica(i, 1, "FAILED") for i in range(1, 8)] + [_replica(8, 1, "READY")]
    shown, folded = cliview.shown_replicas(_service(replicas=replicas), verbose=False)
    assert folded == 7 - cliview.SHOWN_FAILED
    assert [r["id"] for r in shown] == [5, 6, 7, 8]
    shown, folded = cliview.shown_replicas(_service(replicas=replicas), verbose=True)
    assert folded == 0 and len(shown) == 8
    _, notes = cliview.replicas_table(
        [
            _service(
                replicas=[{**r, "endpoint": None, "age_seconds": 1, "pid": None} for r in replicas]
            )
        ],
        verbose=False,
    )
    assert notes == ["s: +4 older failed, see `corral status -v s`"]


def test_starting_replica_says_how_long_of_its_initial_delay() -> None:
    replica = _replica(1, 1, "STARTING", starting_seconds=35, initial_delay_seconds=1200)
    assert cliview.status_text(replica) == "STARTING (35s of 20m initial delay)"
    assert cliview.status_text(_replica(1, 1, "READY")) == "READY"


def test_tail_offset(tmp_path: Path) -> None:
    path = tmp_path / "log"
    path.write_bytes(b"one\ntwo\nthree\n")
    assert path.read_bytes()[tail_offset(path, 2) :] == b"two\nthree\n"
    assert path.read_bytes()[tail_offset(path, 9) :] == b"one\ntwo\nthree\n"
    assert tail_offset(path, 0) == path.stat().st_size
    path.write_bytes(b"one\ntwo")  # a last line still being written counts
    assert path.read_bytes()[tail_offset(path, 1) :] == b"two"
    big = b"".join(b"line %d\n" % i for i in range(50_000))  # several read blocks
    path.write_bytes(big)
    assert path.read_bytes()[tail_offset(path, 3) :] == b"line 49997\nline 49998\nline 49999\n"
    assert tail_offset(tmp_path / "missing", 3) == 0


def test_balancer_lines_of_one_service(tmp_path: Path) -> None:
    logs = tmp_path / "dataplane"
    logs.mkdir()
    (logs / "worker-0.log").write_bytes(
        b"2026-01-01 00:00:02,000 INFO worker-0 corral.balancer: balancer web listening\n"
        b"2026-01-01 00:00:03,000 INFO worker-0 corral.balancer: balancer web-2 listening\n"
        b"2026-01-01 00:00:04,000 INFO worker-0 corral.worker: service web: listening\n"
        b"2026-01-01 00:00:05,000 INFO worker-0 corral.balancer: balancer web: replica 3: x"
    )
    (logs / "worker-1.log").write_bytes(
        b"2026-01-01 00:00:01,000 INFO worker-1 corral.balancer: balancer web listening\n"
    )
    lines, positions = balancer_lines(tmp_path, "web", {})
    assert [line[:23] for line in lines] == [
        b"2026-01-01 00:00:01,000",
        b"2026-01-01 00:00:02,000",
        b"2026-01-01 00:00:04,000",
    ]
    # The unfinished last line comes once it is finished.
    with open(logs / "worker-0.log", "ab") as f:
        f.write(b"\n")
    more, _ = balancer_lines(tmp_path, "web", positions)
    assert len(more) == 1 and b"replica 3" in more[0]
    assert not names_service(b"x corral.balancer: balancer web-2 listening", "web")


def test_span_chunks_end_the_rotated_part_on_a_line_break(tmp_path: Path) -> None:
    """One rule for the API and for reading logs without a daemon: the ``.1`` part of a tail
    ends on a line break where the cap cut a line; the live log is sent as it is."""
    log = tmp_path / "replica_1.log"
    log.write_bytes(b"new and still wri")
    (tmp_path / "replica_1.log.1").write_bytes(b"old1\nold2\ncut sho")
    spans = tail_spans(log, 2)
    assert b"".join(span_chunks(spans)) == b"cut sho\nnew and still wri"
    assert b"".join(span_chunks(spans[:-1], last_as_is=False)) == b"cut sho\n"
    assert b"".join(span_chunks([(tmp_path / "gone", 0), (log, 4)])) == b"and still wri"
    assert b"".join(span_chunks([(log, 2**62)])) == b""  # no seek past what the system allows
    big = b"x" * 200_000 + b"\n"  # several chunks, the newline in the last
    log.write_bytes(big)
    assert b"".join(span_chunks([(log, 0)])) == big


def test_balancer_tail_reads_a_big_log_from_its_end(tmp_path: Path) -> None:
    """`corral logs NAME --load-balancer --tail N` on worker logs of many services: the last N
    lines of one, the same as reading the logs whole (lines long enough to cross the read
    blocks, an unfinished last line left for the follower), read from the end: the memory it
    takes is the tail's (a whole 400 MB log once took the daemon from 66 to 909 MB)."""
    logs = tmp_path / "dataplane"
    logs.mkdir()
    for worker in range(2):
        lines = [
            b"2026-01-01 00:%02d:%02d,%03d INFO worker-%d corral.balancer: balancer %b %d %b\n"
            % (
                i // 60000 % 60,
                i // 1000 % 60,
                i % 1000,
                worker,
                b"web" if i % 7 else b"api",
                i,
                b"x" * (i % 3 * 40_000),
            )
            for i in range(worker, 3000, 2)
        ]
        (logs / f"worker-{worker}.log").write_bytes(
            b"".join(lines) + b"2026-01-01 01:00:00,000 bal"
        )
    whole, positions = balancer_lines(tmp_path, "api", {})
    assert len(whole) > 400
    for count in (0, 1, 5, 200, 10_000):
        tail, after = balancer_tail(tmp_path, "api", count)
        assert tail == (whole[-count:] if count else []), count
        assert after == positions  # the follower goes on where the whole read would
    with open(logs / "worker-1.log", "ab") as f:
        f.write(b"ancer api done\n")
    more, _ = balancer_lines(tmp_path, "api", after)
    assert more == [b"2026-01-01 01:00:00,000 balancer api done\n"]
    # 40 MB of other services' lines: the tail holds a few blocks, not the log.
    with open(logs / "worker-0.log", "ab") as f:
        f.write(b"2026-01-01 02:00:00,000 INFO balancer web %b\n" % (b"y" * 200) * 160_000)
    tracemalloc.start()
    try:
        tail, _ = balancer_tail(tmp_path, "api", 3)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert tail == (whole + more)[-3:]
    assert peak < 8 << 20, peak


def test_home_problems(tmp_path: Path) -> None:
    assert home_problem(tmp_path / "new" / "home") is None
    file = tmp_path / "file"
    file.write_text("")
    assert "is a file" in (home_problem(file) or "")
    assert "not a directory" in (home_problem(file / "home") or "")
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    assert "does not exist" in (home_problem(dangling) or "")


def test_probe_failure_in_words() -> None:
    """What status shows for a replica whose port nobody listens on: no aiohttp internals."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def once() -> str | None:
        async with aiohttp.ClientSession() as session:
            result = await probe(session, f"http://127.0.0.1:{port}", path="/health", timeout=5)
        return result.error

    error = asyncio.run(once()) or ""
    assert error == f"connection refused: nothing listens on 127.0.0.1:{port} (yet)", error


def test_status_shows_the_llm_figures_and_leaves_out_what_the_engine_does_not_report() -> None:
    service: dict[str, Any] = {
        "name": "chat",
        "llm": {
            "ttft_p50_seconds": 0.044,
            "ttft_p99_seconds": 0.2,
            "streams": 12,
            "streaming": 2,
            "held": 3,
            "held_expired": 0,
            "queue": 0.0,
            "running": 2.0,
            "prefix_hit_rate": 0.81,
        },
        "replicas": [
            {"id": 1, "llm": {"ttft_p50_seconds": None, "ttft_p99_seconds": None, "streams": 0,
                              "streaming": 0, "waiting": 1.0, "running": 4.0, "kv_cache_usage": 0.5,
                              "tokens_per_second": 212.4, "prefix_hit_rate": None}},
            {"id": 2, "llm": None},
        ],
    }  # fmt: skip
    line = cliview.llm_lines(service, verbose=False)
    assert line == [
        "chat: TTFT p50 44 ms p99 200 ms over 12 streams, 2 under way; 0 waiting, 2 running; "
        "prefix-cache hit rate 0.81; 3 held in the balancer"
    ]
    verbose = cliview.llm_lines(service, verbose=True)
    assert verbose[1:] == [
        "chat replica 1: TTFT p50 - p99 - over 0 streams; 1 waiting, 4 running; KV cache 50% used;"
        " 212 tokens/s"
    ]
    assert cliview.llm_lines({"name": "web", "replicas": [{"id": 1}]}, verbose=True) == []
    # An engine that reports its waiting requests and not its running ones: no "0 running".
    service["llm"] = {"streams": 0, "queue": 3.0, "running": None}
    assert cliview.llm_lines(service, verbose=False) == [
        "chat: TTFT p50 - p99 - over 0 streams; 3 waiting"
    ]


def test_a_large_machines_memory_is_written_out_in_daemon_status() -> None:
    """A GPU server's 2 TiB read "2.05e+03 GiB" in `corral daemon status`, as in refusals."""
    from corral.cli_daemon import daemon_rows

    info = {"pid": 1, "inventory": {"source": "nvml", "cpus": 96, "memory": 2100 * 1024**3}}
    text = " ".join(value for _, value in daemon_rows(info, 0.0))
    assert "96 CPUs, 2100 GiB, 0 GPUs" in text and "e+" not in text, text


def test_daemon_status_says_who_holds_each_gpu_and_who_waits() -> None:
    """docs/troubleshooting.md sends a user whose replica is PENDING to `corral daemon status`
    to see who holds each GPU: the table said "2 GPUs" and nothing of holders or waiters."""
    from corral.cli_daemon import daemon_rows

    held = [{"service": "svc-a", "replica": 1, "share": 1.0}]
    halves = [{"service": "b", "replica": 2, "share": 0.5}]
    inventory = {
        "source": "nvml",
        "cpus": 8,
        "memory": 64 * 1024**3,
        "gpus": [
            {"index": 0, "name": "NVIDIA A100", "held_by": held},
            {"index": 1, "name": "NVIDIA A100", "held_by": halves},
            {"index": 2, "name": "NVIDIA A100", "held_by": []},
        ],
        "cpus_held": 2,
        "cpus_asked": 1.5,
        "memory_asked": 4 * 1024**3,
        "waiting": [{"service": "svc-d", "replica": 5, "reason": "needs 1x A100; the machine..."}],
    }
    rows = daemon_rows({"pid": 1, "inventory": inventory}, 0.0)
    text = [value for _, value in rows]
    assert "8 CPUs, 64 GiB, 3 GPUs" in text, text
    assert "GPU 0 (NVIDIA A100): svc-a replica 1" in text, text
    assert "GPU 1 (NVIDIA A100): b replica 2 (0.5)" in text, text
    assert "GPU 2 (NVIDIA A100): free" in text, text
    assert "replicas hold 2 CPUs of their own, ask 1.5 and 4 GiB" in text, text
    assert ("waiting", "svc-d replica 5 waits: needs 1x A100; the machine...") in rows, rows


def test_up_names_the_balancer_error_of_a_controller_failed_service() -> None:
    """A service whose workers cannot listen on its port is CONTROLLER_FAILED with no failure
    of its own: `corral up` said "is CONTROLLER_FAILED: " and nothing after it."""
    service = {
        "status": "CONTROLLER_FAILED",
        "failure": None,
        "balancer_errors": ["worker 0: cannot listen on 127.0.0.1:4000: address in use"],
        "replicas": [{"id": 1, "status": "READY", "failure": None}],
    }
    text = failed_text("svc", service)
    assert text == (
        "service svc is CONTROLLER_FAILED: "
        "worker 0: cannot listen on 127.0.0.1:4000: address in use"
    )
    failed = {**service, "status": "FAILED", "failure": "no replica became READY"}
    failed["replicas"] = [{"id": 3, "status": "FAILED_PROVISION", "failure": "x"}]
    assert failed_text("svc", failed) == (
        "service svc is FAILED: no replica became READY; see `corral logs svc 3 --launch`"
    )


def test_a_wait_ends_at_its_deadline_though_the_daemon_answers_only_its_health(
    monkeypatch: Any,
) -> None:
    """`up`/`update` waiting for READY ask again after a daemon respawn (aa2c2af); a daemon
    that answers its health check but never the service request (each one times out) made
    that a loop with no pause and no end, whatever --timeout said."""
    import time

    import pytest

    from corral import cli_wait
    from corral.apiconn import DaemonUnreachable

    class Stuck:
        asked = 0

        def service(self, name: str) -> dict[str, Any]:
            self.asked += 1
            raise DaemonUnreachable("timed out")

    monkeypatch.setattr(cli_wait, "await_respawn", lambda client, say, patience: True)
    client = Stuck()
    started = time.monotonic()
    with pytest.raises(SystemExit):
        list(cli_wait._polled(client, "svc", 0.5, lambda service: "late"))  # type: ignore[arg-type]
    assert time.monotonic() - started < 5
    assert 2 <= client.asked <= 5  # every 0.25 s, not as fast as the loop turns
