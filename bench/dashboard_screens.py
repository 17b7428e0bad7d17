"""Screenshots of the dashboard's pages for the docs (docs/img/), from a real daemon.

Not a benchmark: it lives here because, like the benchmarks, it runs a daemon for minutes with
traffic (so the charts have something to show), which the tests must not. What it does: two
services (``web`` with 2 replicas, ``api`` with 1) under paced traffic whose rate changes every
minute; half-way ``web`` is scaled to 3 (a ``service:``-only update); near the end ``api`` gets a
new version whose ``setup`` takes 90 s, so the update in progress is on screen; then headless
Chromium (Debian's, through Playwright) signs in with a one-time link and saves each page.

Run: ``.venv/bin/python bench/dashboard_screens.py`` (8 minutes; ``--minutes 2`` for a trial,
``--out DIR`` to write elsewhere). All traffic is to 127.0.0.1; everything started is stopped
by pid in ``finally`` (the harness).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import threading
import time
import urllib.request
from pathlib import Path

from _ctrl_harness import REPO, corral_home, progress, ready_count, spec_yaml

from corral.dashboard.cli import login_link

RATES = (4.0, 12.0, 20.0, 8.0, 16.0, 6.0)  # requests/s to web, one per minute, in a loop


def _traffic(endpoints: dict[str, str], stop: threading.Event, deadline: float) -> None:
    started = time.monotonic()
    while not stop.is_set() and time.monotonic() < deadline:
        rate = RATES[int((time.monotonic() - started) // 60) % len(RATES)]
        for name, url in endpoints.items():
            if name == "api" and int(time.monotonic() * rate) % 3:
                continue  # api gets a third of web's rate
            with contextlib.suppress(OSError):
                urllib.request.urlopen(url + "/page", timeout=5).read()
        stop.wait(1.0 / rate)


def _shoot(link: str, out: Path, chromium: str) -> None:
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True)
        try:
            page = browser.new_context(viewport={"width": 1280, "height": 560}).new_page()
            page.goto(link)
            expect(page.locator("tr[data-service=web] .c-ready")).to_have_text("3 / 3")
            page.wait_for_timeout(1500)
            page.screenshot(path=str(out / "services.png"))
            page.set_viewport_size({"width": 1280, "height": 900})
            page.get_by_role("link", name="web").click()
            expect(page.locator(".chart")).to_have_count(3)
            page.wait_for_timeout(1500)
            page.screenshot(path=str(out / "service.png"), full_page=True)
            page.fill("#scale-count", "4")
            page.get_by_role("button", name="Scale").click()
            page.screenshot(path=str(out / "confirm.png"))
            page.get_by_role("button", name="Cancel").click()
            page.get_by_role("link", name="Services").first.click()
            page.get_by_role("link", name="api").click()
            expect(page.locator(".rollout")).to_be_visible()
            page.wait_for_timeout(1500)
            page.screenshot(path=str(out / "service-update.png"), full_page=True)
            page.get_by_role("link", name="Services").first.click()
            page.get_by_role("link", name="web").click()
            page.locator("tr[data-status=READY] a").first.click()
            expect(page.locator("#log-replica")).to_contain_text("GET /page")
            page.fill("#log-search", "replica")
            page.wait_for_timeout(1500)
            page.screenshot(path=str(out / "replica.png"), full_page=True)
            narrow = browser.new_context(viewport={"width": 400, "height": 900})
            narrow.add_cookies(page.context.cookies())
            small = narrow.new_page()
            small.goto(page.url.split("/ui/")[0] + "/ui/services/web")
            expect(small.locator("#fact-ready")).to_have_text("3 / 3")
            small.wait_for_timeout(1500)
            small.screenshot(path=str(out / "service-narrow.png"))
        finally:
            browser.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=8.0)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img")
    args = parser.parse_args()
    if not 1 <= args.minutes <= 60:
        parser.error("--minutes must be 1-60 (the run is bounded)")
    chromium = shutil.which("chromium")
    if chromium is None:
        raise SystemExit("chromium is missing: apt-get install chromium")
    args.out.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    with corral_home("screens", problems) as h:
        for name, replicas in (("web", 2), ("api", 1)):
            result = h.cli("up", str(h.write_spec(name, replicas, 0.5)), "--timeout", "60")
            if result.returncode != 0:
                raise SystemExit(f"corral up {name} failed: {result.stderr}")
        endpoints = {s["name"]: s["endpoint"] for s in h.services()}
        stop = threading.Event()
        seconds = args.minutes * 60
        traffic = threading.Thread(
            target=_traffic, args=(endpoints, stop, time.monotonic() + seconds + 120), daemon=True
        )
        traffic.start()
        try:
            progress(f"traffic for {args.minutes:g} min")
            time.sleep(seconds / 2)
            h.client.update("web", spec_yaml("web", 3, 0.5), mode="rolling")
            time.sleep(seconds / 2 - 20)
            slow = spec_yaml("api", 1, 0.5).replace("service:", "setup: sleep 90\nservice:")
            h.client.update("api", slow, mode="rolling")
            h.wait_until(lambda ss: any(ready_count(s) == 3 for s in ss), timeout=60)
            time.sleep(20)
            _shoot(login_link(h.client), args.out, chromium)
            progress(f"screenshots written to {args.out}")
        finally:
            stop.set()
            traffic.join(10)
            h.down_all(problems)
            h.cli("daemon", "stop", "--all", timeout=60)
    for line in problems:
        progress(f"problem: {line}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
