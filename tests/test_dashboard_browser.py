"""The dashboard in a real headless Chromium (Debian's, driven by Playwright; no browser is
downloaded) against a real daemon with real replicas.

Waits are Playwright's ``expect`` with a deadline: the page must get there by itself, through
the daemon's pushed state, without a reload (each test checks a marker set in the page at the
start is still there). The pages are also saved as PNGs into the test's tmp_path (a look
after a failure); the screenshots in docs/img/ come from bench/dashboard_screens.py, which runs
long enough for the charts to fill.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import CorralHome, http, spec_text, wait_for, write_spec

CHROMIUM = next(
    (p for p in (shutil.which("chromium"), "/usr/lib/chromium/chromium") if p and Path(p).exists()),
    None,
)
WAIT_MS = 30_000  # a generous deadline on a loaded 2-core machine; a healthy run takes ~1 s


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if CHROMIUM is None:
        pytest.skip(
            "chromium is not installed (.ci/run installs Debian's: apt-get install chromium)"
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


def shots(tmp_path: Path) -> Path:
    return tmp_path


def open_page(browser: Any, width: int = 1280, height: int = 900) -> tuple[Any, list[str]]:
    """A page in a fresh context (its own cookies), and the script errors it will collect."""
    context = browser.new_context(viewport={"width": width, "height": height})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    return page, errors


@contextlib.contextmanager
def steady_traffic(endpoint: str, per_second: float = 8.0, limit: float = 180.0) -> Iterator[None]:
    """GETs to ``endpoint`` on a thread while the block runs (bounded: at most ``limit`` s)."""
    stop = threading.Event()

    def send() -> None:
        deadline = time.monotonic() + limit
        while not stop.is_set() and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                http(f"{endpoint}/steady", timeout=5)
            stop.wait(1 / per_second)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


def up(home: CorralHome, tmp_path: Path, name: str, replicas: int) -> dict[str, Any]:
    home.run("up", str(write_spec(tmp_path / f"{name}.yaml", spec_text(name, replicas))))
    return home.wait_replicas(name, replicas)


def test_pages_show_the_numbers_and_follow_a_replica_dying_and_its_log(
    corral_home: CorralHome, tmp_path: Path, browser: Any
) -> None:
    from playwright.sync_api import expect

    home = corral_home
    svc = up(home, tmp_path, "web", 2)
    for i in range(7):
        assert http(f"{svc['endpoint']}/hello/{i}").status == 200
    page, errors = open_page(browser)
    page.goto(home.run("dashboard").stdout.strip())  # the one-time link signs in
    expect(page).to_have_url(re.compile(r"/ui/$"))
    page.evaluate("window.sameDocument = true")

    row = page.locator("tr[data-service=web]")
    expect(row.locator(".c-requests")).to_have_text("7", timeout=WAIT_MS)
    expect(row.locator(".c-ready")).to_have_text("2 / 2")
    expect(row.locator(".c-status")).to_have_text("READY")
    expect(row.locator(".c-serving")).to_have_text("v1")
    expect(row.locator(".c-endpoint a")).to_have_text(svc["endpoint"])
    expect(row.locator(".c-endpoint a")).to_have_attribute("href", svc["endpoint"])

    with steady_traffic(svc["endpoint"]):  # figures and charts that show something
        expect(row.locator(".c-latency")).not_to_have_text("— / —", timeout=WAIT_MS)
        page.screenshot(path=str(shots(tmp_path) / "services.png"))
        follow_the_service(page, home, svc, shots(tmp_path), errors, browser)


def follow_the_service(
    page: Any,
    home: CorralHome,
    svc: dict[str, Any],
    out: Path,
    errors: list[str],
    browser: Any,
) -> None:
    """The service page while traffic flows, a replica killed, then a replica's log."""
    from playwright.sync_api import expect

    row = page.locator("tr[data-service=web]")
    row.get_by_role("link", name="web").click()
    expect(page).to_have_url(re.compile(r"/ui/services/web$"))
    expect(page.locator("#fact-ready")).to_have_text("2 / 2", timeout=WAIT_MS)
    ready = page.locator("tr[data-status=READY]")
    expect(ready).to_have_count(2)
    victim = svc["replicas"][0]
    os.kill(int(victim["pid"]), signal.SIGKILL)
    dead = page.locator(f"tr[data-replica='{victim['id']}']")
    expect(dead).to_have_attribute("data-status", re.compile("^FAILED"), timeout=WAIT_MS)
    expect(dead).to_have_class("tone-bad")
    expect(dead.locator(".badge")).to_have_css("color", "rgb(163, 22, 27)")  # red
    expect(dead.locator(".c-do button")).to_be_hidden()  # a failed replica is not replaced
    expect(ready).to_have_count(2, timeout=WAIT_MS)  # its replacement, READY
    new_ids = [int(x) for x in ready.evaluate_all("rows => rows.map(r => r.dataset.replica)")]
    assert victim["id"] not in new_ids
    assert page.evaluate("window.sameDocument") is True, "the page was reloaded"
    expect(page.locator(".chart:visible")).to_have_count(3)  # no LLM charts for a web app
    page.screenshot(path=str(out / "service.png"), full_page=True)

    # One replica's output, followed live.
    live = next(r for r in home.service("web")["replicas"] if r["id"] == new_ids[0])  # type: ignore[index]
    page.locator(f"tr[data-replica='{live['id']}'] .c-id a").click()
    log = page.locator("#log-replica")
    expect(log).to_contain_text("listening on", timeout=WAIT_MS)
    expect(page.locator("#log-launch")).to_contain_text("[corral] run:")
    marker = f"marker-{uuid.uuid4().hex[:10]}"
    assert http(f"{live['endpoint']}/{marker}").status == 200  # the app logs every request
    expect(log).to_contain_text(marker, timeout=5_000)
    page.fill("#log-search", marker)
    expect(log.locator("mark")).to_have_text([marker])
    expect(page.locator(".log-pane .count").first).to_contain_text("1 of")
    page.fill("#log-search", "")
    assert page.evaluate("window.sameDocument") is True, "the page was reloaded"
    page.screenshot(path=str(out / "replica.png"))

    # A narrow window: the service page fits its width (tables turn into cards).
    narrow, more_errors = open_page(browser, width=400, height=900)
    narrow.context.add_cookies(page.context.cookies())
    narrow.goto(page.url.rsplit("/replicas/", 1)[0])
    expect(narrow.locator("#fact-ready")).to_have_text("2 / 2", timeout=WAIT_MS)
    overflow = narrow.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"the page is {overflow}px wider than a 400px window"
    narrow.screenshot(path=str(out / "service-narrow.png"), full_page=True)
    assert errors + more_errors == []


def test_login_needs_the_token_and_actions_take_effect(
    corral_home: CorralHome, tmp_path: Path, browser: Any
) -> None:
    from playwright.sync_api import expect

    home = corral_home
    up(home, tmp_path, "shop", 1)
    page, errors = open_page(browser)
    page.on("response", lambda r: errors.append(r.url) if r.status == 404 else None)
    page.goto(home.api_url + "/ui/")
    expect(page).to_have_url(re.compile(r"/ui/login$"))
    page.fill("#token", "not-the-token")
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator("#login-error")).to_have_text("That is not this daemon's API token.")
    page.goto(home.api_url + "/ui/services/shop")
    expect(page).to_have_url(re.compile(r"/ui/login$"))  # still outside
    page.fill("#token", home.token)
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator("tr[data-service=shop] .c-ready")).to_have_text("1 / 1", timeout=WAIT_MS)
    page.evaluate("window.sameDocument = true")
    errors.clear()  # the refused sign-in above was a 401, as it should be
    page.get_by_role("link", name="shop").click()

    # Scale from 1 to 2: confirmed in a dialog, done through the daemon's update.
    page.fill("#scale-count", "2")
    page.get_by_role("button", name="Scale").click()
    expect(page.locator("#confirm")).to_be_visible()
    page.screenshot(path=str(shots(tmp_path) / "confirm.png"))
    page.locator("#confirm-ok").click()
    expect(page.locator("#action-result")).to_have_text(
        "Version 2 stored: scaling to 2.", timeout=WAIT_MS
    )
    home.wait_replicas("shop", 2)
    expect(page.locator("#fact-ready")).to_have_text("2 / 2", timeout=WAIT_MS)

    # Roll back to version 1 (one replica): a cancelled dialog does nothing first.
    page.select_option("#rollback-version", "1")
    page.get_by_role("button", name="Roll back").click()
    page.get_by_role("button", name="Cancel").click()
    expect(page.locator("#confirm")).to_be_hidden()
    assert home.service("shop")["version"] == 2  # type: ignore[index]
    page.get_by_role("button", name="Roll back").click()
    page.locator("#confirm-ok").click()
    expect(page.locator("#action-result")).to_contain_text("Version 3", timeout=WAIT_MS)
    expect(page.locator("#fact-version")).to_have_text("v3", timeout=WAIT_MS)
    home.wait_replicas("shop", 1)

    # Take it down.
    page.get_by_role("button", name="Take down…").click()
    page.locator("#confirm-ok").click()
    expect(page.locator("#action-result")).to_have_text("shop is shutting down.", timeout=WAIT_MS)
    wait_for(lambda: home.service("shop") is None, 60, "shop to be gone")
    page.get_by_role("link", name="Services").first.click()
    expect(page.locator("p.empty")).to_be_visible(timeout=WAIT_MS)
    assert page.evaluate("window.sameDocument") is True, "the page was reloaded"
    assert errors == []
    # Signing out ends the session: the pages send the browser to the login page again.
    page.get_by_role("button", name="Sign out").click()
    expect(page).to_have_url(re.compile(r"/ui/login$"))
    page.goto(home.api_url + "/ui/")
    expect(page).to_have_url(re.compile(r"/ui/login$"))


def test_service_page_resources_ranges_hover_logs_and_replacing_a_replica(
    corral_home: CorralHome, tmp_path: Path, browser: Any
) -> None:
    from playwright.sync_api import expect

    home = corral_home
    svc = up(home, tmp_path, "shop", 2)
    page, errors = open_page(browser)
    page.goto(home.run("dashboard").stdout.strip())
    expect(page.locator("tr[data-service=shop] .c-ready")).to_have_text("2 / 2", timeout=WAIT_MS)
    expect(page.locator("thead .c-qps")).to_have_text("QPS (10 s)")
    page.evaluate("window.sameDocument = true")
    page.get_by_role("link", name="shop").click()
    with steady_traffic(svc["endpoint"]):
        # Every replica's CPU and memory, read by the daemon when the page asks.
        for replica in svc["replicas"]:
            row = page.locator(f"tr[data-replica='{replica['id']}']")
            expect(row.locator(".c-cpu")).to_have_text(re.compile(r"^\d+\.\d%$"), timeout=WAIT_MS)
            expect(row.locator(".c-memory")).to_have_text(re.compile(r"^[\d.]+ (KiB|MiB|GiB)$"))
            expect(row.locator(".c-endpoint a")).to_have_attribute("href", replica["endpoint"])
            expect(row.locator(".c-served")).to_have_text(re.compile(r"^\d"))  # 0 is shown
        expect(page.locator("#fact-endpoint a")).to_have_attribute("href", svc["endpoint"])
        expect(page.locator("#fact-decision")).to_contain_text(
            "(60 s window, as of its last decision)"
        )
        expect(page.locator("section.llm")).to_be_hidden()  # not an LLM service
        expect(page.locator(".llm-charts")).to_be_hidden()
        expect(page.locator("thead .c-ttft")).to_be_hidden()
        charts_and_hover(page, shots(tmp_path))
        logs_of_the_service(page, home)
        page.screenshot(path=str(shots(tmp_path) / "service.png"), full_page=True)

    # Replace one replica: confirmed first, then it goes and another takes its place.
    victim = svc["replicas"][0]
    page.locator(f"tr[data-replica='{victim['id']}'] .c-do button").click()
    expect(page.locator("#confirm-title")).to_have_text(f"Replace replica {victim['id']} of shop?")
    page.locator("#confirm-ok").click()
    expect(page.locator("#action-result")).to_have_text(
        f"replica {victim['id']} of shop is shutting down; a replacement starts", timeout=WAIT_MS
    )
    expect(page.locator(f"tr[data-replica='{victim['id']}']")).to_have_count(0, timeout=WAIT_MS)
    expect(page.locator("tr[data-status=READY]")).to_have_count(2, timeout=WAIT_MS)
    assert page.evaluate("window.sameDocument") is True, "the page was reloaded"
    assert errors == []


def charts_and_hover(page: Any, out: Path) -> None:
    """A new service's charts fit its data (its own span, a minute at least); a range is
    chosen; hovering shows the time and the values."""
    from playwright.sync_api import expect

    fit = page.locator(".ranges button[data-range=fit]")
    expect(fit).to_have_text(re.compile(r"^Fit \(([2-9]\d|1[01]\d) s\)$"), timeout=WAIT_MS)
    expect(fit).to_have_attribute("aria-pressed", "true")
    qps = page.locator(".chart").first
    expect(qps.locator(".axis text").first).to_have_text(re.compile("^\N{MINUS SIGN}" + r"\d+ s$"))
    page.locator(".ranges button[data-range='3600']").click()
    expect(qps.locator(".axis text").first).to_have_text("\N{MINUS SIGN}60 min")
    expect(page.locator(".ranges button[data-range='3600']")).to_have_attribute(
        "aria-pressed", "true"
    )
    fit.click()
    expect(qps.locator(".axis text").first).to_have_text(re.compile("^\N{MINUS SIGN}" + r"\d+ s$"))
    # Two chart points (one each 5 s) with traffic, then the pointer over the newest.
    expect(qps.locator("path.series")).to_have_attribute(
        "d", re.compile(r"^M[\d.]+,[\d.]+L"), timeout=WAIT_MS
    )
    box = qps.locator("svg").bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.97, box["y"] + box["height"] * 0.5)
    tip = qps.locator(".chart-tip")
    expect(tip).to_be_visible()
    expect(tip.locator("time")).to_have_text(re.compile(r"^\d\d:\d\d:\d\d$"))
    expect(tip).to_contain_text(re.compile(r"QPS \d"))
    page.locator(".charts").first.screenshot(path=str(out / "hover.png"))
    page.mouse.move(0, 0)
    expect(tip).to_be_hidden()


def logs_of_the_service(page: Any, home: CorralHome) -> None:
    """The controller's log, and the load balancer's lines about the service, in the page."""
    from playwright.sync_api import expect

    log = home.path / "services" / "shop" / "logs" / "controller.log"
    first = log.read_text().splitlines()[0]
    expect(page.locator("#log-controller")).to_contain_text(first[-30:], timeout=WAIT_MS)
    page.get_by_role("button", name="Load balancer log").click()
    lb = home.run("logs", "shop", "--load-balancer", "--no-follow").stdout.strip().splitlines()
    expect(page.locator("#log-load_balancer")).to_contain_text(lb[-1][-30:], timeout=WAIT_MS)
    page.get_by_role("button", name="Controller log").click()
    expect(page.locator("#log-controller")).to_be_visible()


def test_an_llm_service_shows_its_engine_figures(
    corral_home: CorralHome, tmp_path: Path, browser: Any
) -> None:
    import json
    import sys
    import urllib.request

    from playwright.sync_api import expect

    home = corral_home
    run = f"exec {sys.executable} -m corral.llmsim --host 127.0.0.1 --port $PORT --speed 5"
    text = spec_text("chat", 1, run=run).replace(
        "service:\n", "service:\n  load_balancing_policy: prefix_affinity\n"
    )  # a policy that reads the engines' figures
    home.run("up", str(write_spec(tmp_path / "chat.yaml", text)))
    svc = home.wait_replicas("chat", 1)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    def ask() -> None:
        for stream in (True, True, False):
            request = urllib.request.Request(
                svc["endpoint"] + "/v1/chat/completions",
                data=json.dumps({**body, "stream": stream}).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=30) as answer:
                answer.read()

    ask()
    page, errors = open_page(browser)
    page.goto(home.run("dashboard").stdout.strip())
    page.goto(home.api_url + "/ui/services/chat")
    llm = page.locator("section.llm")
    expect(llm).to_be_visible(timeout=WAIT_MS)
    expect(page.locator("#llm-ttft")).to_have_text(re.compile(r"^[\d.]+ ms / [\d.]+ ms$"))
    expect(page.locator("#llm-waiting")).to_have_text("0", timeout=WAIT_MS)
    expect(page.locator("#llm-hit")).to_have_text(re.compile(r"%$"), timeout=WAIT_MS)
    row = page.locator("tr[data-replica]").first
    expect(row.locator(".c-ttft")).to_be_visible()
    expect(row.locator(".c-running")).to_have_text(re.compile(r"^\d+$"))
    expect(row.locator(".c-kv")).to_have_text(re.compile(r"%$"))
    # Tokens/s where the engines report it (vLLM's counter grows, SGLang says), else no cell.
    rates = [r["llm"].get("tokens_per_second") for r in home.service("chat")["replicas"]]  # type: ignore[index]
    tps = page.locator("#llm-tps")
    if any(isinstance(v, (int, float)) for v in rates):
        expect(tps).to_have_text(re.compile(r"^[\d.]+$"))
    else:
        expect(tps).to_be_hidden()
        expect(row.locator(".c-tps")).to_be_hidden()
    # A chart per signal; a chart point's TTFT and hit rate are over its 5 s (differences of
    # the counters), so these streams come after the page began reading them.
    ask()
    charts = page.locator(".llm-charts .chart")
    expect(charts).to_have_count(4)
    expect(page.locator(".llm-charts")).to_be_visible()
    ttft = charts.filter(has_text="Time to first token").locator("svg")
    expect(ttft).to_have_attribute("aria-label", re.compile(r"now: p50 [\d.]+ ms"), timeout=WAIT_MS)
    hits = charts.filter(has_text="Prefix-cache hit rate").locator("svg")
    # A point's hit rate is a difference of the engines' counters, read once a second: it may
    # first show in the next 5 s interval, so these wait as long as the TTFT's.
    expect(hits).to_have_attribute(
        "aria-label", re.compile(r"now: hit rate [\d.]+%"), timeout=WAIT_MS
    )
    queue = charts.filter(has_text="Queue").locator("svg")
    expect(queue).to_have_attribute(
        "aria-label", re.compile(r"now: waiting 0, running 0, held 0"), timeout=WAIT_MS
    )
    page.screenshot(path=str(shots(tmp_path) / "llm.png"), full_page=True)
    # A slow service's axis labels fit the charts' margin: "50000 ms" was cut to "0000 ms".
    shown = page.evaluate(
        "import('/ui/static/dom.js').then(m => [0.25, 9.5, 50, 120].map(m.fmt.ms))"
    )
    assert shown == ["250 ms", "9500 ms", "50.0 s", "120 s"]
    assert errors == []
