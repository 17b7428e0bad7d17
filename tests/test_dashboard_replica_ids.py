"""The dashboard's log panes with two services (issue 25), in a real headless Chromium (set up
as in test_dashboard_browser.py): with alpha (2 replicas) and beta (3), each replica's page
streams its own output and launch log, the service page's events name replicas as its table
does, and a replacement's page shows the replacement's output. One service alone would not
catch a mix-up: there the internal ids and the per-service ones agree.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import CorralHome, spec_text, wait_for, write_spec
from test_dashboard_browser import WAIT_MS, browser  # noqa: F401 (a fixture: Chromium, once)

RUN = 'echo "I am $CORRAL_SERVICE replica $CORRAL_REPLICA_ID pid $$"; exec {python} app.py'


def up(home: CorralHome, tmp_path: Path, name: str, replicas: int) -> dict[str, Any]:
    text = spec_text(name, replicas, run=RUN.format(python=sys.executable))
    home.run("up", str(write_spec(tmp_path / f"{name}.yaml", text)))
    return home.wait_replicas(name, replicas, timeout=60)


def whoami(service: str, replica: dict[str, Any]) -> str:
    return f"I am {service} replica {replica['id']} pid {replica['pid']}"


def panes_show_their_own(
    page: Any, base: str, service: str, replica: dict[str, Any], everyone: list[str]
) -> None:
    from playwright.sync_api import expect

    page.goto(f"{base}/ui/services/{service}/replicas/{replica['id']}")
    output = page.locator("#log-replica")
    expect(output).to_contain_text(whoami(service, replica), timeout=WAIT_MS)
    expect(page.locator("#log-launch")).to_contain_text(
        f"[corral] launching replica {service}/{replica['id']} ", timeout=WAIT_MS
    )
    text = output.inner_text()
    assert [o for o in everyone if o in text] == [whoami(service, replica)], (service, text)


@pytest.mark.timeout(300)
def test_each_log_pane_shows_its_own_replica_with_two_services_and_a_replacement(
    corral_home: CorralHome,
    tmp_path: Path,
    browser: Any,  # noqa: F811 (the fixture)
) -> None:
    from playwright.sync_api import expect

    home = corral_home
    alpha = up(home, tmp_path, "alpha", 2)
    beta = up(home, tmp_path, "beta", 3)
    everyone = [whoami("alpha", r) for r in alpha["replicas"]]
    everyone += [whoami("beta", r) for r in beta["replicas"]]
    page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(home.run("dashboard").stdout.strip())  # the one-time link signs in
    expect(page).to_have_url(re.compile(r"/ui/$"))
    base = home.api_url
    for name, svc in (("alpha", alpha), ("beta", beta)):
        for replica in svc["replicas"]:
            panes_show_their_own(page, base, name, replica, everyone)

    # The service page's events name beta's replicas 1 to 3 (its rows 3 to 5 inside).
    page.goto(f"{base}/ui/services/beta")
    ready_events = page.locator("li.event", has=page.locator(".action", has_text="replica.ready"))
    expect(ready_events).to_have_count(3, timeout=WAIT_MS)
    shown = sorted(ready_events.locator(".replica").all_inner_texts())
    assert shown == ["#1", "#2", "#3"], shown

    # Replace beta's replica 2 (killed): replica 4 takes its place; its page shows its own
    # output, and the failed one's page still shows replica 2's.
    victim = next(r for r in beta["replicas"] if r["id"] == 2)
    os.kill(int(victim["pid"]), signal.SIGKILL)

    def replaced() -> dict[str, Any] | None:
        svc = home.service("beta")
        assert svc is not None
        by_id = {r["id"]: r for r in svc["replicas"]}
        return svc if by_id.get(4, {}).get("status") == "READY" else None

    beta = wait_for(replaced, 60, "beta's replica 4 READY in place of replica 2")
    new = next(r for r in beta["replicas"] if r["id"] == 4)
    everyone.append(whoami("beta", new))
    panes_show_their_own(page, base, "beta", new, everyone)
    panes_show_their_own(page, base, "beta", victim, everyone)
    page.goto(f"{base}/ui/services/beta")
    failed = page.locator("li.event", has=page.locator(".action", has_text="replica.failed"))
    expect(failed.locator(".replica")).to_have_text(["#2"], timeout=WAIT_MS)
    assert errors == []
