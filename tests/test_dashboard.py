"""The dashboard's server side against a real daemon (HTTP, no browser), and its pure parts.

What is checked here is what docs/dashboard.md promises about access and the numbers: the
one-time link works once, the cookie is HttpOnly + SameSite=Strict, nothing under /ui/api
answers without a session, actions need the page's header and origin, every tab gets the same
encoded state, and the figures match /metrics. The browser tests are in
test_dashboard_browser.py.
"""

from __future__ import annotations

import json
import threading
from http.client import HTTPConnection, HTTPMessage
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES, CorralHome, get_json, http, spec_text, wait_for, write_spec

from corral.balancer.metrics import LATENCY_BUCKETS
from corral.dashboard.actions import scaled_spec
from corral.dashboard.history import (
    POINTS,
    History,
    Point,
    Reading,
    Readings,
    figures,
    quantile,
)
from corral.dashboard.session import CODE_SECONDS, MAX_SESSIONS, SESSION_IDLE_SECONDS, Sessions
from corral.spec import parse_spec

# -- pure parts -----------------------------------------------------------------------------------


def test_quantile_interpolates_inside_the_bucket_like_prometheus() -> None:
    buckets = [0] * (len(LATENCY_BUCKETS) + 1)
    i = LATENCY_BUCKETS.index(0.01)
    buckets[i] = 100  # every answer between 5 ms and 10 ms
    assert quantile(0.5, buckets) == pytest.approx(0.0075)
    assert quantile(0.99, buckets) == pytest.approx(0.00995)
    assert quantile(0.5, [0] * len(buckets)) is None
    buckets[-1] = 1000  # most answers beyond the last bound: the last bound is all it knows
    assert quantile(0.99, buckets) == LATENCY_BUCKETS[-1]


def _stats(codes: dict[str, int], fast: int) -> dict[str, Any]:
    buckets = [0] * (len(LATENCY_BUCKETS) + 1)
    buckets[0] = fast
    return {"codes": codes, "latency": {"buckets": buckets}}


def test_figures_between_two_readings_and_after_a_counter_reset() -> None:
    old = Reading.of(100.0, _stats({"200": 10}, 10))
    new = Reading.of(110.0, _stats({"200": 48, "502": 2}, 50))
    got = figures(old, new)
    assert got.qps == pytest.approx(4.0)
    assert got.error_rate == pytest.approx(0.05)
    assert got.answered_total == 50
    assert got.p50 is not None and got.p50 <= LATENCY_BUCKETS[0]
    # A restarted worker starts from 0: no negative traffic, never an exception.
    reset = figures(new, Reading.of(115.0, _stats({"200": 3}, 3)))
    assert reset.qps == 0 and reset.error_rate is None and reset.p99 is None


def test_an_llm_services_ttft_and_hit_rate_are_over_the_interval() -> None:
    """What the charts show is what happened between two readings, not since the start: a
    slow past does not hide fast streams now, and the hit rate is of this interval's lookups."""
    slow = [0] * (len(LATENCY_BUCKETS) + 1)
    slow[LATENCY_BUCKETS.index(5.0)] = 50  # 50 streams of 2.5-5 s before
    fast = list(slow)
    fast[LATENCY_BUCKETS.index(0.05)] = 10  # then 10 of 25-50 ms
    engines = {"1": {"prefix_hits": 100.0, "prefix_queries": 1000.0}}
    old = Reading.of(100.0, {"ttft": {"buckets": slow}, "engines": engines})
    engines = {"1": {"prefix_hits": 190.0, "prefix_queries": 1100.0}}
    new = Reading.of(105.0, {"ttft": {"buckets": fast}, "engines": engines})
    got = figures(old, new)
    assert got.ttft_p99 is not None and 0.025 <= got.ttft_p99 <= 0.05
    assert got.hit_rate == pytest.approx(0.9)  # 90 of the last 100, not 190 of 1100
    quiet = figures(new, Reading.of(110.0, {"ttft": {"buckets": fast}, "engines": engines}))
    assert quiet.ttft_p50 is None and quiet.hit_rate is None


def test_the_hit_rate_over_an_interval_is_of_the_engines_read_at_both_ends() -> None:
    """A replica that leaves the ready set between two readings (a scale-down) takes its
    lookups since it started out of a sum over the ready set, and one that joins it (a probe
    that passes again) brings them in: the chart showed 2.25 for a true 0.9. Only the engines
    read at both ends count, and an engine whose counters went back (restarted) does not."""

    def engines(**counts: tuple[float, float]) -> dict[str, Any]:
        lookups = {k: {"prefix_hits": h, "prefix_queries": q} for k, (h, q) in counts.items()}
        return {"engines": lookups}

    old = Reading.of(100.0, engines(r2=(9000.0, 10000.0), r3=(0.0, 300.0)))
    left = Reading.of(105.0, engines(r2=(9450.0, 10500.0)))
    assert figures(old, left).hit_rate == pytest.approx(0.9)
    back = Reading.of(110.0, engines(r2=(9500.0, 10600.0), r3=(0.0, 300.0)))
    assert figures(left, back).hit_rate == pytest.approx(0.5)
    restarted = Reading.of(115.0, engines(r2=(9560.0, 10700.0), r3=(10.0, 20.0)))
    assert figures(back, restarted).hit_rate == pytest.approx(0.6)
    assert figures(back, Reading.of(120.0, engines(r3=(0.0, 400.0)))).hit_rate == 0.0


def test_live_window_uses_the_reading_that_old() -> None:
    readings = Readings()
    for second in range(20):
        readings.add("a", Reading.of(float(second), _stats({"200": second * 2}, second * 2)))
    got = readings.since("a", 10.0)
    assert got is not None and got.qps == pytest.approx(2.0)
    readings.keep_only([])
    assert readings.since("a", 10.0) is None


def test_history_is_bounded_to_six_hours_per_service() -> None:
    history = History()
    assert POINTS == 4320  # six hours at one point per 5 s
    for i in range(POINTS + 50):
        history.add("a", Point(float(i), 1.0, None, None, None, 1, 1))
    series = history.series("a")
    assert len(series) == POINTS and series[0]["t"] == 50.0
    history.keep_only(["b"])
    assert len(history) == 0


def test_sessions_codes_are_single_use_and_expire() -> None:
    now = [1000.0]
    sessions = Sessions("the-token-" + "x" * 30, clock=lambda: now[0])
    code = sessions.new_code()
    session = sessions.redeem(code)
    assert session and sessions.valid(session)
    assert sessions.redeem(code) is None  # used
    late = sessions.new_code()
    now[0] += CODE_SECONDS + 1
    assert sessions.redeem(late) is None  # expired
    assert sessions.login("wrong") is None and sessions.login("") is None
    assert sessions.login("the-token-" + "x" * 30)
    now[0] += SESSION_IDLE_SECONDS + 1
    assert not sessions.valid(session)  # idle too long
    for _ in range(MAX_SESSIONS + 10):
        sessions.login("the-token-" + "x" * 30)
    assert sessions.counts()[1] == MAX_SESSIONS


def test_scaled_spec_keeps_everything_but_the_count(tmp_path: Path) -> None:
    text = spec_text("s", 3, workdir=tmp_path)
    scaled = parse_spec(scaled_spec(text, 5))
    original = parse_spec(text)
    assert scaled.service.replica_policy.min_replicas == 5
    assert scaled.service.replica_policy.max_replicas == 5
    assert scaled.model_dump(exclude={"service"}) == original.model_dump(exclude={"service"})
    assert scaled.service.readiness_probe == original.service.readiness_probe


# -- against a real daemon ------------------------------------------------------------------------


def request(
    port: int,
    method: str,
    path: str,
    *,
    headers: dict[str, str] | None = None,
    body: bytes | None = None,
) -> tuple[int, HTTPMessage, bytes]:
    """One request to the daemon, redirects not followed (urllib would)."""
    conn = HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        answer = conn.getresponse()
        return answer.status, answer.headers, answer.read()
    finally:
        conn.close()


def port_of(home: CorralHome) -> int:
    info = home.daemon_info()
    assert info is not None
    return int(info["port"])


def sign_in(home: CorralHome) -> tuple[str, str]:
    """(cookie name, session) from the one-time link `corral dashboard` prints."""
    url = home.run("dashboard").stdout.strip()
    assert url.startswith(f"http://127.0.0.1:{port_of(home)}/ui/login?once="), url
    status, headers, _ = request(port_of(home), "GET", url.split(str(port_of(home)), 1)[1])
    assert status == 303 and headers["Location"] == "/ui/"
    cookie = SimpleCookie(headers["Set-Cookie"])
    (name,) = cookie.keys()
    return name, cookie[name].value


def read_states(port: int, cookie: str, count: int) -> list[bytes]:
    """The first ``count`` raw state events of one feed stream (bytes exactly as sent)."""
    conn = HTTPConnection("127.0.0.1", port, timeout=15)
    conn.request("GET", "/ui/api/feed", headers={"Cookie": cookie})
    answer = conn.getresponse()
    assert answer.status == 200, answer.status
    assert answer.headers["Content-Type"].startswith("text/event-stream")
    events: list[bytes] = []
    current = b""
    try:
        while len(events) < count:
            line = answer.readline()
            assert line, "the stream ended"
            current += line
            if line == b"\n":
                if current.startswith(b"event: state"):
                    events.append(current)
                current = b""
    finally:
        conn.close()
    return events


def test_one_time_link_cookie_and_every_route_behind_the_session(corral_home: CorralHome) -> None:
    home = corral_home
    home.start_daemon()
    port = port_of(home)
    assert request(port, "POST", "/v1/dashboard/login")[0] == 401  # the code needs the token
    answer = home.api("POST", "/v1/dashboard/login")
    assert answer.status == 200
    once = answer.json()["path"]
    status, headers, _ = request(port, "GET", once)
    assert status == 303 and headers["Location"] == "/ui/"
    raw_cookie = headers["Set-Cookie"]
    assert "HttpOnly" in raw_cookie and "SameSite=Strict" in raw_cookie and "Path=/" in raw_cookie
    assert raw_cookie.startswith(f"corral_session_{port}=")
    cookie = raw_cookie.split(";", 1)[0]
    # Used once: the same link again is refused.
    status, _, body = request(port, "GET", once)
    assert status == 401 and b"used already or has expired" in body

    # Without a session: pages go to the login page, data and actions answer 401.
    for path in ("/ui/", "/ui/services/x", "/ui/services/x/replicas/1"):
        status, headers, _ = request(port, "GET", path)
        assert (status, headers["Location"]) == (303, "/ui/login"), path
    for method, path in (
        ("GET", "/ui/api/feed"),
        ("GET", "/ui/api/services/x/history"),
        ("GET", "/ui/api/services/x/replicas/1/log"),
        ("POST", "/ui/api/services/x/down"),
        ("POST", "/ui/api/services/x/scale"),
        ("POST", "/ui/api/services/x/rollback"),
    ):
        status, _, body = request(port, method, path, headers={"X-Corral-UI": "1"})
        assert status == 401 and b"not signed in" in body, (method, path, status, body)
        # The bearer token is not a dashboard session, and a session is not the API token.
        bearer = {"Authorization": f"Bearer {home.token}", "X-Corral-UI": "1"}
        assert request(port, method, path, headers=bearer)[0] == 401
    assert request(port, "GET", "/v1/services", headers={"Cookie": cookie})[0] == 401
    # A HEAD of a stream would hold it open without a byte to write: not a route.
    assert request(port, "HEAD", "/ui/api/feed", headers={"Cookie": cookie})[0] in (404, 405)

    # With it: the shell, with a strict content security policy.
    status, headers, body = request(port, "GET", "/ui/", headers={"Cookie": cookie})
    assert status == 200 and b'<main id="main"' in body
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    assert headers["Referrer-Policy"] == "same-origin" and headers["Cache-Control"] == "no-store"
    # The static files hold no data and are open (the login page needs the styles).
    status, headers, body = request(port, "GET", "/ui/static/app.js")
    assert status == 200 and headers["Content-Type"].startswith("text/javascript")
    assert request(port, "GET", "/ui/static/nope.js")[0] == 404

    # The login form: a wrong token is refused, the right one signs in.
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    status, _, body = request(port, "POST", "/ui/login", headers=form, body=b"token=nope")
    assert status == 401 and b"not this daemon" in body
    status, headers, _ = request(
        port, "POST", "/ui/login", headers=form, body=f"token={home.token}".encode()
    )
    assert status == 303 and "HttpOnly" in headers["Set-Cookie"]
    evil = {**form, "Origin": "http://evil.example"}
    body = f"token={home.token}".encode()
    assert request(port, "POST", "/ui/login", headers=evil, body=body)[0] == 403


def test_a_login_form_that_cannot_be_read_is_a_400(corral_home: CorralHome) -> None:
    # The login page needs no token, so anyone who reaches the port could post these: each
    # was a 500 with a traceback in the daemon log.
    corral_home.start_daemon()
    port = port_of(corral_home)
    form = "application/x-www-form-urlencoded"
    for content_type, body, extra in [
        ("multipart/form-data; boundary=x", b"token=abc", {}),  # no starting boundary
        ("multipart/form-data", b"token=abc", {}),  # no boundary at all
        ("multipart/form-data; boundary=x", b"--x\r\n\r\na\r\n--x--\r\n", {}),  # no name
        (f"{form}; charset=bogus", b"token=abc", {}),
        (form, b"\xff\xfe=abc", {}),
        (form, b"token=abc", {"Content-Encoding": "gzip"}),
    ]:
        headers = {"Content-Type": content_type, **extra}
        status, _, answer = request(port, "POST", "/ui/login", headers=headers, body=body)
        assert status == 400, (content_type, body, answer)
        assert json.loads(answer) == {"error": "the login form cannot be read"}
    status, _, _ = request(port, "POST", "/ui/login", headers={"Content-Type": form}, body=b"x")
    assert status == 401  # a readable form without the token: still the login page


def test_actions_need_the_pages_header_and_origin(corral_home: CorralHome, tmp_path: Path) -> None:
    home = corral_home
    home.run("up", str(write_spec(tmp_path / "a.yaml", spec_text("a", 1))))
    home.wait_replicas("a", 1)
    port = port_of(home)
    name, session = sign_in(home)
    cookie = f"{name}={session}"
    body = json.dumps({"replicas": 2}).encode()
    scale = "/ui/api/services/a/scale"
    json_type = {"Cookie": cookie, "Content-Type": "application/json"}
    for headers in (
        json_type,  # no X-Corral-UI: a cross-site form could send this
        {**json_type, "X-Corral-UI": "1", "Origin": "http://evil.example"},
        {**json_type, "X-Corral-UI": "1", "Sec-Fetch-Site": "cross-site"},
    ):
        status, _, answer = request(
            port, "POST", "/ui/api/services/a/scale", headers=headers, body=body
        )
        assert status == 403 and b"dashboard's page only" in answer, (headers, status)
    page = {**json_type, "X-Corral-UI": "1", "Origin": f"http://127.0.0.1:{port}"}
    # Bad input: 4xx naming the field.
    for bad in (b"[]", b'{"replicas": -1}', b'{"replicas": "2"}', b"{"):
        status, _, answer = request(
            port, "POST", "/ui/api/services/a/scale", headers=page, body=bad
        )
        assert 400 <= status < 500 and b"error" in answer, (bad, status, answer)
    # The range said is the real one (it read "0 to 9223372036854775807", the limit 10000).
    status, _, answer = request(
        port, "POST", "/ui/api/services/a/scale", headers=page, body=b'{"replicas": "3"}'
    )
    assert status == 400 and b"a whole number from 0 to 10000" in answer, answer
    status, _, answer = request(
        port, "POST", "/ui/api/services/a/rollback", headers=page, body=b'{"version": 9}'
    )
    assert status == 404 and b"no version 9" in answer
    status, _, answer = request(port, "POST", scale, headers=page, body=body)
    assert status == 201, answer
    assert json.loads(answer)["version"] == 2
    home.wait_replicas("a", 2)
    svc = home.service("a")
    assert svc is not None and svc["policy"]["min_replicas"] == 2
    # Scaling kept the running replica (only the service section changed).
    assert 1 in [r["id"] for r in svc["replicas"] if r["status"] == "READY"]
    follow_a_log_across_a_rotation(home, port, cookie, svc)


def test_a_scale_keeps_the_running_code_and_secrets(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """docs/dashboard.md: a scale changes only `service:`, so the running replica is kept and
    a new one runs what it runs. It once re-copied the workdir from its source directory (an
    edit made since reached the service, the running replica was replaced) and launched the
    new replica with the stored spec's '<redacted>' as the secret's value."""
    home = corral_home
    workdir = tmp_path / "app"
    workdir.mkdir()
    app = workdir / "app.py"
    app.write_text((EXAMPLES / "app.py").read_text())
    extra = "secrets:\n  APP_VERSION: from-the-secret\n"
    home.run(
        "up", str(write_spec(tmp_path / "s.yaml", spec_text("s", 1, workdir=workdir, extra=extra)))
    )
    (first,) = home.wait_replicas("s", 1)["replicas"]
    assert get_json(first["endpoint"])["version"] == "from-the-secret"
    # Edited after up: only `corral update` may deploy it.
    app.write_text(app.read_text().replace('os.environ.get("APP_VERSION", "1")', '"edited"'))
    port = port_of(home)
    name, session = sign_in(home)
    page = {"Cookie": f"{name}={session}", "Content-Type": "application/json", "X-Corral-UI": "1"}
    body = json.dumps({"replicas": 2}).encode()
    status, _, answer = request(port, "POST", "/ui/api/services/s/scale", headers=page, body=body)
    assert status == 201, answer
    svc = home.wait_replicas("s", 2)
    kept = [r for r in svc["replicas"] if r["id"] == first["id"]]
    assert kept and kept[0]["pid"] == first["pid"] and kept[0]["status"] == "READY", svc
    (added,) = [r for r in svc["replicas"] if r["id"] != first["id"]]
    assert get_json(added["endpoint"])["version"] == "from-the-secret"


def follow_a_log_across_a_rotation(
    home: CorralHome, port: int, cookie: str, svc: dict[str, Any]
) -> None:
    """A followed log pushes new lines; emptied in place, it is followed again from 0."""
    replica = next(r for r in svc["replicas"] if r["id"] == 1)
    conn = HTTPConnection("127.0.0.1", port, timeout=15)
    conn.request(
        "GET", "/ui/api/services/a/replicas/1/log?kind=replica", headers={"Cookie": cookie}
    )
    answer = conn.getresponse()
    assert answer.status == 200 and answer.headers["Content-Type"] == "text/event-stream"
    seen = b""

    def until(needle: bytes) -> None:
        nonlocal seen
        while needle not in seen:
            line = answer.readline()
            assert line, f"the stream ended before {needle!r}"
            seen += line

    try:
        until(b"listening on")
        log = home.path / "services" / "a" / "logs" / "replica_1.log"
        with open(log, "r+b") as f:  # what corral.logfiles does after copying it to .1
            f.truncate(0)
        until(b"event: rotated")
        assert http(f"{replica['endpoint']}/after-rotation").status == 200
        until(b"GET /after-rotation")
    finally:
        conn.close()


def test_every_tab_gets_the_same_bytes_and_the_numbers_of_metrics(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    home = corral_home
    home.run("up", str(write_spec(tmp_path / "m.yaml", spec_text("m", 1))))
    svc = home.wait_replicas("m", 1)
    for _ in range(9):
        assert http(svc["endpoint"] + "/x").status == 200

    def counted() -> bool:
        return (
            'corral_lb_requests_total{code="200",service="m"} 9.0'
            in home.api("GET", "/metrics").body.decode()
        )

    wait_for(counted, 10, "9 requests in /metrics")
    name, session = sign_in(home)
    cookie = f"{name}={session}"
    port = port_of(home)

    def state_with_nine() -> Any:
        for raw in read_states(port, cookie, 3):
            state = json.loads(raw.split(b"data: ", 1)[1])
            (m,) = state["services"]
            if m["live"] and m["live"]["answered_total"] == 9:
                return m
        return None

    m = wait_for(state_with_nine, 20, "a state counting 9 answers")
    assert m["ready"] == 1 and m["target"] == 1 and m["serving_versions"] == [1]
    assert m["endpoint"] == svc["endpoint"]
    assert m["replicas"][0]["traffic"]["served"] == 9
    assert any(e["action"] == "service.create" for e in m["events"])
    history = get_json_with_cookie(port, "/ui/api/services/m/history", cookie)
    assert history["sample_seconds"] == 5 and history["keep_seconds"] == 6 * 3600
    # Several tabs at once: each is handed the very same encoded state.
    results: list[list[bytes]] = []

    def tab() -> None:
        # 6 ticks each: tabs started a few ticks apart on a loaded machine still overlap
        results.append(read_states(port, cookie, 6))

    threads = [threading.Thread(target=tab) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(results) == 4
    # Tabs opened together overlap by at least one tick: that state is byte for byte the same.
    shared = set(results[0]).intersection(*results[1:])
    assert shared, "the tabs got no state in common: each was encoded for one tab"
    assert get_json(home.api_url + "/v1/health")["ok"]
    streams_are_bounded(port, cookie)


def streams_are_bounded(port: int, cookie: str) -> None:
    """Past MAX_LISTENERS open state streams the next one is refused (503), not served."""
    from corral.dashboard.feed import MAX_LISTENERS

    bounded_streams(port, cookie, "/ui/api/feed", MAX_LISTENERS, b"too many dashboard streams")


def bounded_streams(port: int, cookie: str, path: str, limit: int, refusal: bytes) -> None:
    """``limit`` streams of ``path`` are served at once, the next one is a 503 saying
    ``refusal``, and one is served again once the others closed."""
    opened: list[HTTPConnection] = []
    try:
        for _ in range(limit):
            conn = HTTPConnection("127.0.0.1", port, timeout=15)
            conn.request("GET", path, headers={"Cookie": cookie})
            assert conn.getresponse().status == 200
            opened.append(conn)
        status, _, body = request(port, "GET", path, headers={"Cookie": cookie})
        assert status == 503 and refusal in body, (status, body)
    finally:
        for conn in opened:
            conn.close()

    def served_again() -> bool:
        conn = HTTPConnection("127.0.0.1", port, timeout=15)
        try:
            conn.request("GET", path, headers={"Cookie": cookie})
            return conn.getresponse().status == 200
        finally:
            conn.close()

    wait_for(served_again, 15, f"{path} to be served once the others closed")


def get_json_with_cookie(port: int, path: str, cookie: str) -> Any:
    status, _, body = request(port, "GET", path, headers={"Cookie": cookie})
    assert status == 200, (path, status, body)
    return json.loads(body)


def test_followed_logs_are_bounded(corral_home: CorralHome, tmp_path: Path) -> None:
    """docs/dashboard.md: at most MAX_FOLLOWERS followed logs at once, the next one a 503;
    a slot frees once a tab's stream is closed."""
    from corral.dashboard.logs import MAX_FOLLOWERS

    home = corral_home
    home.run("up", str(write_spec(tmp_path / "b.yaml", spec_text("b", 1))))
    home.wait_replicas("b", 1)
    port = port_of(home)
    name, session = sign_in(home)
    path = "/ui/api/services/b/replicas/1/log?kind=replica"
    bounded_streams(port, f"{name}={session}", path, MAX_FOLLOWERS, b"too many logs followed")


def test_a_scale_that_waited_behind_an_update_does_not_undo_it(tmp_path: Path) -> None:
    """The scale reads the running version, then waits for the service's deploy lock; an
    update holding it meanwhile makes another version current. Going on would store the older
    version's spec and files (its workdir copy, values) as the newest: the update undone,
    silently. The scale is refused instead (409), and nothing is stored."""
    import asyncio
    from unittest import mock

    from corral.daemon import Daemon
    from corral.dashboard.actions import scale
    from corral.errors import Conflict
    from corral.state import Store

    store = Store(tmp_path / "state.db")
    first, second = spec_text("s", 1), spec_text("s", 1, envs={"CODE": "new"})
    store.create_service("s", first, source=None, base_dir=None, lb_port=None)
    parsed = {1: parse_spec(first, source="<t>"), 2: parse_spec(second, source="<t>")}
    daemon = Daemon(tmp_path, store, mock.MagicMock(capacity=None, infras={"local": None}))
    controller = daemon.controllers["s"] = mock.MagicMock()
    controller.spec.side_effect = lambda version: parsed[version]
    update, asked = daemon.update, asyncio.Event()

    async def update_once_asked(name: str, request: Any) -> Any:
        asked.set()  # the scale has read the running version: 1
        return await update(name, request)

    async def main() -> None:
        lock = daemon._deploy_lock("s")
        await lock.acquire()  # an update under way
        with mock.patch.object(daemon, "update", update_once_asked):
            scaling = asyncio.ensure_future(scale(daemon, "s", 3))
            await asyncio.wait_for(asked.wait(), 10)
        store.add_version("s", second, source=None, base_dir=None, mode="rolling", adopt_live=False)
        lock.release()
        with pytest.raises(Conflict, match="updated meanwhile"):
            await asyncio.wait_for(scaling, 10)

    asyncio.run(main())
    assert [v.version for v in store.versions("s")] == [1, 2]
