"""The service page's data routes against a real daemon (HTTP, no browser): each replica's CPU
and memory read on demand, one replica replaced, the controller's and the load balancer's logs
followed live. The page itself is tested in test_dashboard_browser.py."""

from __future__ import annotations

import json
import time
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

import psutil
from conftest import CorralHome, spec_text, wait_for, write_spec
from test_dashboard import get_json_with_cookie, port_of, request, sign_in


def signed_in(home: CorralHome) -> tuple[int, str]:
    name, session = sign_in(home)
    return port_of(home), f"{name}={session}"


def test_each_replica_cpu_and_memory_are_read_when_asked(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    home = corral_home
    home.run("up", str(write_spec(tmp_path / "u.yaml", spec_text("u", 2))))
    svc = home.wait_replicas("u", 2)
    port, cookie = signed_in(home)
    path = "/ui/api/services/u/resources"
    status, _, _ = request(port, "GET", path)
    assert status == 401  # behind the session like every /ui/api route
    first = get_json_with_cookie(port, path, cookie)
    assert set(first["replicas"]) == {str(r["id"]) for r in svc["replicas"]}
    for replica in svc["replicas"]:
        got = first["replicas"][str(replica["id"])]
        rss = sum(p.memory_info().rss for p in _group(replica["pid"]))
        assert 0.5 * rss < got["rss_bytes"] < 2 * rss, (got, rss)
        assert got["processes"] >= 1
        assert got["cpu_percent"] is not None  # read twice a moment apart: a figure at once
    assert get_json_with_cookie(port, path, cookie) == first  # within a second: the same answer
    time.sleep(1.1)
    second = get_json_with_cookie(port, path, cookie)
    for replica in svc["replicas"]:
        cpu = second["replicas"][str(replica["id"])]["cpu_percent"]
        assert cpu is not None and 0 <= cpu < 400, second


def _group(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def test_one_replica_is_replaced_from_the_page(corral_home: CorralHome, tmp_path: Path) -> None:
    home = corral_home
    home.run("up", str(write_spec(tmp_path / "r.yaml", spec_text("r", 2))))
    svc = home.wait_replicas("r", 2)
    port, cookie = signed_in(home)
    victim = svc["replicas"][0]
    path = f"/ui/api/services/r/replicas/{victim['id']}/replace"
    status, _, _ = request(port, "POST", path, headers={"Cookie": cookie})
    assert status == 403  # an action needs the page's header
    status, _, body = request(port, "POST", path, headers={"Cookie": cookie, "X-Corral-UI": "1"})
    assert status == 202, body
    assert json.loads(body)["message"] == (
        f"replica {victim['id']} of r is shutting down; a replacement starts"
    )

    def replaced() -> dict[str, Any] | None:
        now = home.service("r")
        ready = [x for x in (now or {}).get("replicas", []) if x["status"] == "READY"]
        ids = {x["id"] for x in ready}
        return now if len(ready) == 2 and victim["id"] not in ids else None

    wait_for(replaced, 60, "a replacement READY and the victim gone")
    status, _, body = request(
        port,
        "POST",
        "/ui/api/services/r/replicas/999/replace",
        headers={"Cookie": cookie, "X-Corral-UI": "1"},
    )
    assert status == 404 and b"no replica 999" in body


def read_events(
    port: int, path: str, cookie: str, needles: list[bytes], between: Any = None
) -> bytes:
    """The stream's bytes until each of ``needles`` showed up in turn; ``between`` runs after
    the first (e.g. to write a line the stream must then push)."""
    conn = HTTPConnection("127.0.0.1", port, timeout=20)
    seen = b""
    try:
        conn.request("GET", path, headers={"Cookie": cookie})
        answer = conn.getresponse()
        assert answer.status == 200 and answer.headers["Content-Type"] == "text/event-stream"
        for i, needle in enumerate(needles):
            deadline = time.monotonic() + 20
            while needle not in seen:
                assert time.monotonic() < deadline, f"no {needle!r} in {seen[-2000:]!r}"
                line = answer.readline()
                assert line, f"the stream ended before {needle!r}: {seen[-2000:]!r}"
                seen += line
            if i == 0 and between is not None:
                between()
    finally:
        conn.close()
    return seen


def test_the_controller_and_load_balancer_logs_are_followed(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    home = corral_home
    home.run("up", str(write_spec(tmp_path / "l.yaml", spec_text("l", 1))))
    home.wait_replicas("l", 1)
    port, cookie = signed_in(home)
    base = "/ui/api/services/l/log"
    log = home.path / "services" / "l" / "logs" / "controller.log"
    first_line = log.read_bytes().splitlines()[0]

    def write_marker() -> None:
        with open(log, "ab") as f:
            f.write(b"marker-of-the-test\n")

    got = read_events(
        port,
        f"{base}?kind=controller",
        cookie,
        [first_line[-40:], b"marker-of-the-test"],
        write_marker,
    )
    assert got.startswith(b"retry: 2000\n\nevent: log\n")
    lb = home.run("logs", "l", "--load-balancer", "--no-follow").stdout.strip().splitlines()
    assert lb, "the balancer logged nothing about the service"
    read_events(port, f"{base}?kind=load_balancer", cookie, [lb[-1][-40:].encode()])
    status, _, body = request(port, "GET", f"{base}?kind=nope", headers={"Cookie": cookie})
    assert status == 400 and b"controller or load_balancer" in body
    status, _, _ = request(port, "GET", f"{base}?kind=controller")
    assert status == 401


def test_two_tabs_reading_at_once_get_one_reading() -> None:
    """Two requests that both miss the cache read one after the other on their threads (they
    shared dictionaries: one's iteration over a dict the other changed was a 500); the second
    is answered from the first's reading, and a gone service's figures are dropped."""
    import os
    import threading

    from corral.dashboard.resources import Usage

    usage = Usage()
    replicas = [{"id": 1, "uid": 9, "pid": os.getpid()}]
    usage.read("gone", replicas, keep=["gone"])
    answers: list[dict[str, Any]] = []
    errors: list[BaseException] = []

    def read() -> None:
        try:
            answers.append(usage.read("web", replicas, keep=["web"]))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=read) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors and len(answers) == 8
    assert all(answer is answers[0] for answer in answers)
    assert answers[0]["replicas"]["1"]["rss_bytes"] > 0
    assert usage.cached("gone", time.time()) is None
