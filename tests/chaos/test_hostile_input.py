"""Hostile values against a real daemon and a real balancer: refused cleanly, nothing leaks.

* Service names with path separators, shell metacharacters, encoded dots, NUL, huge lengths and
  unicode lookalikes: a 4xx naming the problem, through the API and through the CLI, and nothing
  created on disk outside the home (nor a service directory inside it).
* Replica ids that are not numbers (or are numbers SQLite cannot hold): 400/404, never a 500.
* Log requests aiming outside the service's directory (kind, replica, encoded ``../``): a 4xx,
  never another file's bytes (the token, the state file).
* Huge headers and bodies through a service's balancer: 431 / 413, and the balancer keeps
  serving everyone else meanwhile.
* Slowloris: a few dozen sockets trickling header bytes to the balancer and to the daemon API
  are cut off by the header timeout, while normal requests keep succeeding.

Every wait has a deadline; the numbers (sockets, bytes, seconds) are small and bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import textwrap
import threading
import time
from http.client import HTTPConnection
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from chaos_support import record, rounds, seconds
from conftest import EXAMPLES, CorralHome, http, wait_for, write_spec

pytestmark = pytest.mark.timeout(300)

HOSTILE_NAMES = [
    "../x",
    "a/b",
    "/etc",
    "..",
    ".",
    "$(touch pwned)",
    "`touch pwned`",
    "a;b",
    "a && touch pwned",
    "a|b",
    "%2e%2e",
    "..%2fx",
    "a\x00b",
    "web\n",
    "-rf",
    "~root",
    "x" * 300,
    "w\u0435b",  # Cyrillic e
    "\uff57\uff45\uff42",  # fullwidth "web"
    "Web",
    "",
]
# Through the CLI (argv cannot hold NUL; each CLI run costs a Python start, so a sample).
CLI_NAMES = ["../x", "$(touch pwned)", "a;b", "%2e%2e", "x" * 300, "w\u0435b"]

SAFE_SPEC = "run: exec sleep 30\n"


def files_outside(root: Path, home: Path) -> set[str]:
    """Every path under ``root`` except the home (which the daemon owns)."""
    found = set()
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if here / d != home]
        for name in dirnames + filenames:
            found.add(str((here / name).relative_to(root)))
    return found


def app_spec(directory: Path, name: str) -> Path:
    return write_spec(
        directory / f"{name}.yaml",
        textwrap.dedent(
            f"""\
            name: {name}
            workdir: {EXAMPLES}
            run: exec {sys.executable} app.py
            service:
              readiness_probe: {{path: /health, period_seconds: 0.5, initial_delay_seconds: 60}}
              replicas: 1
              load_balancer:
                max_body_bytes: 1048576
                header_timeout_seconds: 2
            """
        ),
    )


def up_web(home: CorralHome, tmp_path: Path) -> str:
    """Start the daemon (header timeout of 2 s) and the service ``web``; return its URL."""
    home.env["CORRAL_API_HEADER_TIMEOUT"] = "2"
    home.start_daemon()
    home.run("up", str(app_spec(tmp_path, "web")), "--detach")
    service = home.wait_replicas("web", 1, timeout=60)
    endpoint = str(service["endpoint"])
    assert http(endpoint + "/").status == 200
    return endpoint


def assert_refused_name(answer: Any, what: str) -> None:
    assert 400 <= answer.status < 500, (what, answer.status, answer.body[:300])
    text = answer.body.decode(errors="replace")
    assert "name" in text, (what, text[:300])


# -- names ----------------------------------------------------------------------------------------


def test_hostile_service_names(corral_home: CorralHome, tmp_path: Path) -> None:
    pwn_before = Path("/tmp/pwned").exists()
    corral_home.start_daemon()
    spec_file = write_spec(tmp_path / "safe.yaml", SAFE_SPEC)
    before = files_outside(tmp_path, corral_home.path)
    refused = 0
    for name in HOSTILE_NAMES:
        # The name given beside the spec, and the name inside the spec.
        answer = corral_home.api("POST", "/v1/services", body={"spec": SAFE_SPEC, "name": name})
        assert answer.status == 400, (name, answer.status, answer.body[:300])
        assert_refused_name(answer, f"POST name={name!r}")
        spec = f"name: {json.dumps(name)}\n{SAFE_SPEC}"
        answer = corral_home.api("POST", "/v1/services", body={"spec": spec})
        assert answer.status == 400, (name, answer.status, answer.body[:300])
        issues = answer.json().get("issues") or []
        assert any(issue["loc"] == "name" for issue in issues), (name, answer.body[:300])
        # The name in the URL of every route that takes one.
        path = "/v1/services/" + quote(name, safe="")
        for method, route, body in [
            ("GET", path, None),
            ("DELETE", path, None),
            ("GET", path + "/events", None),
            ("GET", path + "/logs?kind=controller", None),
            ("POST", path + "/versions", {"spec": SAFE_SPEC}),
        ]:
            answer = corral_home.api(method, route, body=body)
            if name == "":  # /v1/services/ + suffix: no such route, or the list itself
                assert answer.status < 500, (method, route, answer.status)
                continue
            assert_refused_name(answer, f"{method} {route}")
            refused += 1
    assert corral_home.api("GET", "/v1/services").json()["services"] == []

    for name in CLI_NAMES:
        result = corral_home.run("up", str(spec_file), "-n", name, "--detach", check=False)
        assert result.returncode != 0, (name, result.stdout)
        out = result.stdout + result.stderr
        assert "not a valid service name" in out, (name, out)
        assert "Traceback" not in out, out
        refused += 1
    for command in (["down"], ["status"], ["logs", "--controller", "--no-follow"]):
        for name in ("../x", "$(touch pwned)"):
            result = corral_home.run(*command, name, check=False)
            out = result.stdout + result.stderr
            assert result.returncode != 0, (command, name, out)
            assert "name" in out and "Traceback" not in out, (command, name, out)
            refused += 1

    # Nothing was created: no file beside the home, no service directory in it, no shell ran.
    assert files_outside(tmp_path, corral_home.path) == before
    services_dir = corral_home.path / "services"
    assert not services_dir.exists() or not any(services_dir.iterdir())
    assert not list(tmp_path.rglob("pwned*"))
    assert Path("/tmp/pwned").exists() == pwn_before
    assert corral_home.db_rows("SELECT name FROM services") == []
    record("hostile names", rounds=refused, lost=0, names=len(HOSTILE_NAMES))


# -- replica ids and log paths --------------------------------------------------------------------

BAD_REPLICA_IDS = [
    "abc", "-1", "1e9", str(2**70), str(2**63), "1.5", "0x10", "\u0661", " 1", "", "9" * 400,
    "1;ls", "../1", "1/../../token", "%2e%2e",
]  # fmt: skip


def test_replica_ids_and_log_paths(corral_home: CorralHome, tmp_path: Path) -> None:
    up_web(corral_home, tmp_path)
    token = corral_home.token
    state_magic = b"SQLite format 3"
    secrets = (token.encode(), state_magic)
    checked = 0

    def no_leak(answer: Any, what: str) -> None:
        for secret in secrets:
            assert secret not in answer.body, f"{what} returned another file's bytes"

    for value in BAD_REPLICA_IDS:
        for kind in ("replica", "launch"):
            route = f"/v1/services/web/logs?kind={kind}&replica={quote(value, safe='')}"
            answer = corral_home.api("GET", route)
            assert answer.status in (400, 404), (value, answer.status, answer.body[:300])
            assert "error" in answer.json()
            no_leak(answer, route)
            checked += 1
    for route in [
        "/v1/services/web/logs?kind=../../token",
        "/v1/services/web/logs?kind=..%2F..%2Ftoken&replica=1",
        "/v1/services/web/logs?kind=controller%2F..%2F..%2F..%2Ftoken",
        "/v1/services/web/logs?kind=%2e%2e%2fstate.db&replica=1",
        "/v1/services/web/logs?kind=/etc/passwd&replica=1",
        "/v1/services/web%2F..%2F..%2Ftoken/logs?kind=controller",
        "/v1/services/..%2F..%2Ftoken/logs?kind=controller",
        "/v1/services/web/logs/..%2F..%2F..%2Ftoken",
        "/v1/services/web/events?after=" + str(2**70),
        "/v1/services/web/logs?kind=controller&offset=" + str(2**70),
        "/v1/services/web/logs?kind=controller&offset=-5",
    ]:
        answer = corral_home.api("GET", route)
        assert 400 <= answer.status < 500, (route, answer.status, answer.body[:300])
        no_leak(answer, route)
        checked += 1
    # A real log still comes back, and an offset past its end is an empty answer, not an error.
    answer = corral_home.api("GET", "/v1/services/web/logs?kind=controller")
    assert answer.status == 200 and answer.body
    answer = corral_home.api("GET", f"/v1/services/web/logs?kind=controller&offset={2**62}")
    assert answer.status == 200 and answer.body == b""

    # Bodies the API refuses: over its 1 MB limit (413), a spec over the spec limit (400 naming
    # the line where it went over), and a body announced but never sent (408, bounded).
    answer = corral_home.api("POST", "/v1/services", raw=b"{" + b" " * (2 << 20) + b"}")
    assert answer.status == 413 and "error" in answer.json(), answer.status
    answer = corral_home.api("POST", "/v1/services", body={"spec": "run: x\n" + "#" * 300_000})
    assert answer.status == 400, answer.body[:300]
    (issue,) = answer.json()["issues"]
    assert "characters long" in issue["message"] and issue["line"] == 2, issue
    port = int(corral_home.api_url.rsplit(":", 1)[1])
    status, _ = raw_request(
        port,
        b"POST /v1/services HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {token}\r\nContent-Length: 1000\r\n\r\n{{".encode(),
        timeout=30,
    )
    assert status == 408, status
    checked += 3

    # Through the CLI: click refuses what is not a number; a number SQLite cannot hold is a 400.
    result = corral_home.run("logs", "web", "abc", "--no-follow", check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result
    result = corral_home.run("logs", "web", str(2**70), "--no-follow", check=False)
    out = result.stdout + result.stderr
    assert result.returncode == 1 and "at most" in out and "Traceback" not in out, out
    checked += 2
    record("hostile replica ids and log paths", rounds=checked, lost=0)


# -- balancer: huge headers and bodies, slowloris -------------------------------------------------


def raw_request(port: int, data: bytes, timeout: float = 15.0) -> tuple[int, bytes]:
    """Send raw bytes to 127.0.0.1:port; return the status of the answer and its first bytes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        with contextlib.suppress(OSError):  # the server may answer and close before all is sent
            sock.sendall(data)
        received = b""
        with contextlib.suppress(OSError):
            while b"\r\n" not in received:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                received += chunk
    assert received.startswith(b"HTTP/1."), received[:200]
    return int(received.split()[1]), received


class Traffic:
    """Normal GETs in a loop on a thread (bounded); counts what succeeded and what failed."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.ok = 0
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for url in self.urls:
                try:
                    status = http(url, timeout=10).status
                except OSError as exc:
                    self.failed.append(f"{url}: {exc}")
                    continue
                if status == 200:
                    self.ok += 1
                else:
                    self.failed.append(f"{url}: {status}")
            self._stop.wait(0.05)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=20)


def test_huge_headers_and_bodies_through_the_balancer(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    endpoint = up_web(corral_home, tmp_path)
    port = int(endpoint.rsplit(":", 1)[1])
    head = b"Host: 127.0.0.1\r\n"
    attacks = {
        "64 KB header": (
            b"GET / HTTP/1.1\r\n" + head + b"X-Big: " + b"a" * 65536 + b"\r\n\r\n",
            431,
        ),
        "300 headers": (
            b"GET / HTTP/1.1\r\n"
            + head
            + b"".join(b"X-%d: v\r\n" % i for i in range(300))
            + b"\r\n",
            431,
        ),
        "20 KB request line": (b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n" + head + b"\r\n", 431),
        "5 MB body announced": (
            b"POST / HTTP/1.1\r\n" + head + b"Content-Length: 5242880\r\n\r\n" + b"x" * 65536,
            413,
        ),
        "5 MB body chunked": (
            b"POST / HTTP/1.1\r\n"
            + head
            + b"Transfer-Encoding: chunked\r\n\r\n"
            + b"".join(b"10000\r\n" + b"x" * 65536 + b"\r\n" for _ in range(80))
            + b"0\r\n\r\n",
            413,
        ),
    }
    sent = 0
    with Traffic([endpoint + "/"]) as traffic:
        for _ in range(rounds(2, 10)):
            for what, (data, expected) in attacks.items():
                status, answer = raw_request(port, data)
                assert status == expected, (what, status, answer[:300])
                sent += 1
                # The balancer is still there for everyone else.
                assert http(endpoint + "/").status == 200, what
        wait_for(lambda: traffic.ok >= 5, 30, "normal requests during the attacks")
    assert traffic.failed == [], traffic.failed[:5]
    assert corral_home.service("web")["status"] == "READY"
    record("huge headers and bodies", rounds=sent, lost=len(traffic.failed), served=traffic.ok)


def test_slowloris_is_cut_off(corral_home: CorralHome, tmp_path: Path) -> None:
    endpoint = up_web(corral_home, tmp_path)
    targets = {
        "balancer": int(endpoint.rsplit(":", 1)[1]),
        "api": int(corral_home.api_url.rsplit(":", 1)[1]),
    }
    per_target = rounds(20, 40)
    trickle_for = seconds(10.0, 20.0)  # far longer than the 2 s header timeouts
    sockets: list[tuple[str, socket.socket]] = []
    for target, port in targets.items():
        for _ in range(per_target):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(b"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            sock.setblocking(False)
            sockets.append((target, sock))
    cut: dict[int, float] = {}
    started = time.monotonic()
    try:
        with Traffic([endpoint + "/", corral_home.api_url + "/v1/health"]) as traffic:
            while len(cut) < len(sockets) and time.monotonic() - started < trickle_for:
                for index, (_, sock) in enumerate(sockets):
                    if index in cut:
                        continue
                    try:
                        sock.send(b"X")  # one byte of a never-ending header line
                        if sock.recv(4096) == b"":
                            cut[index] = time.monotonic() - started
                    except BlockingIOError:
                        pass  # still open, nothing to read
                    except OSError:
                        cut[index] = time.monotonic() - started
                time.sleep(0.2)
            during = traffic.ok
    finally:
        for _, sock in sockets:
            sock.close()
    held = [target for index, (target, _) in enumerate(sockets) if index not in cut]
    assert held == [], f"{len(held)} slowloris sockets still open after {trickle_for:g}s: {held}"
    assert traffic.failed == [], traffic.failed[:5]
    assert during >= 5, f"only {during} normal requests succeeded during the attack"
    # Both still answer a normal request at once, and a keep-alive client that sends whole
    # requests is not cut off by the header timeout.
    assert http(endpoint + "/").status == 200
    assert corral_home.healthy()
    for port in targets.values():
        conn = HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            for _ in range(3):
                conn.request("GET", "/v1/health" if port == targets["api"] else "/")
                response = conn.getresponse()
                assert response.status == 200
                response.read()
        finally:
            conn.close()
    record(
        "slowloris",
        rounds=len(sockets),
        lost=len(traffic.failed),
        served_meanwhile=during,
        slowest_cut_seconds=round(max(cut.values()), 1),
    )
