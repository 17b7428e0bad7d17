"""The demo behind `make demo`: a 3-replica service on local processes, end to end.

It brings the service up through the real CLI, sends traffic through corral's load balancer,
kills one replica with SIGKILL and shows it replaced, then leaves the service running and says
how to look at it and take it down. Its corral home is `.corral-demo/` in the repository (or
$CORRAL_HOME), so it never touches ~/.corral.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
HOME = Path(os.environ.get("CORRAL_HOME") or HERE.parent / ".corral-demo")
ENV = {**os.environ, "CORRAL_HOME": str(HOME)}


def corral(*args: str, capture: bool = False) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "corral", *args],
        env=ENV,
        cwd=HERE.parent,  # the spec's relative workdir is taken from here, as in SkyPilot
        check=True,
        text=True,
        stdout=subprocess.PIPE if capture else None,
    )
    return result.stdout or ""


def status() -> dict:
    return json.loads(corral("status", "demo", "--json", capture=True))["services"][0]


def hit(endpoint: str, n: int) -> Counter[str]:
    seen: Counter[str] = Counter()
    for _ in range(n):
        with urllib.request.urlopen(endpoint + "/", timeout=5) as response:
            seen["replica " + json.load(response)["replica"]] += 1
    return seen


def main() -> None:
    print(f"== corral home: {HOME}")
    running = (HOME / "daemon.json").exists()
    listing = json.loads(corral("status", "--json", capture=True)) if running else {}
    if "demo" in {s["name"] for s in listing.get("services", [])}:
        print("== a demo service is already up; taking it down first")
        corral("down", "demo")
    print("== corral up examples/demo.yaml")
    corral("up", str(HERE / "demo.yaml"))
    svc = status()
    endpoint = svc["endpoint"]
    print(f"== 12 requests through the load balancer at {endpoint}:")
    for who, count in sorted(hit(endpoint, 12).items()):
        print(f"   {who}: {count}")
    victim = next(r for r in svc["replicas"] if r["status"] == "READY")
    print(f"== kill -9 replica {victim['id']} (pid {victim['pid']})")
    os.kill(victim["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        svc = status()
        ready = [r for r in svc["replicas"] if r["status"] == "READY"]
        if len(ready) == 3 and victim["id"] not in {r["id"] for r in ready}:
            break
        time.sleep(0.2)
    else:
        sys.exit("the killed replica was not replaced within 60 s")
    print("== replaced; 12 more requests:")
    for who, count in sorted(hit(endpoint, 12).items()):
        print(f"   {who}: {count}")
    corral("status")
    # The `corral` of the venv running this (`make demo` builds .venv-demo), as typed from here.
    cli = Path(sys.executable).parent / "corral"
    with contextlib.suppress(ValueError):
        cli = cli.relative_to(Path.cwd())
    print(
        f"\nThe demo service keeps running at {endpoint}.\n"
        f"  look:       CORRAL_HOME={HOME} {cli} status\n"
        f"  logs:       CORRAL_HOME={HOME} {cli} logs demo <ID> --no-follow\n"
        f"  take down:  make demo-down"
    )


if __name__ == "__main__":
    main()
