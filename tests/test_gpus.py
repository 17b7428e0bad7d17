"""GPUs, CPUs and memory on the local backend, end to end: a real daemon on a declared
inventory of 4 GPUs of two models (this machine has none), real replica processes that report
the devices they were given (tests/apps/devices.py), real SQLite.

What is shown: services with different asks fill the machine exactly, each device to one
replica; the next replica waits with the reason (one event) and starts when a device frees; a
daemon SIGKILL and restart (with replicas running, or during a launch) leaves no device
double-booked; a rolling update on a full machine completes, replacing one replica at a time
with READY never below target - 1, and a broken version costs one replica, not the service;
asks that can never fit are refused by ``validate``, ``up`` and ``update`` with the field and
the inventory; a bad declared inventory stops the daemon at start.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from conftest import APPS, CorralHome, get_json, http, spec_text, wait_for, write_spec

pytestmark = pytest.mark.timeout(170)

A100 = ("GPU-a100-0", "GPU-a100-1")
L4 = ("GPU-l4-2", "GPU-l4-3")
INVENTORY = f"""\
gpus:
  - {{index: 0, name: NVIDIA A100-SXM4-80GB, uuid: {A100[0]}, memory: 80GB}}
  - {{index: 1, name: NVIDIA A100-SXM4-80GB, uuid: {A100[1]}, memory: 80GB}}
  - {{index: 2, name: NVIDIA L4, uuid: {L4[0]}, memory: 24GB}}
  - {{index: 3, name: NVIDIA L4, uuid: {L4[1]}, memory: 24GB}}
"""


@pytest.fixture
def gpu_home(corral_home: CorralHome, tmp_path: Path) -> CorralHome:
    """A home whose daemon (started by the first `corral up`) reads the declared inventory."""
    path = tmp_path / "inventory.yaml"
    path.write_text(INVENTORY)
    corral_home.env["CORRAL_INVENTORY"] = str(path)
    return corral_home


def gpu_spec(
    directory: Path,
    name: str,
    replicas: int,
    resources: str,
    *,
    version: str = "1",
    envs: dict[str, str] | None = None,
    run: str | None = None,
) -> Path:
    extra = "resources:\n" + "".join(f"  {line}\n" for line in resources.splitlines())
    text = spec_text(
        name,
        replicas,
        run=run or f"exec {sys.executable} {APPS / 'devices.py'}",
        workdir=APPS,
        envs={"APP_VERSION": version, **(envs or {})},
        extra=extra if resources else "",
    )
    return write_spec(directory / f"{name}-v{version}.yaml", text)


def seen(home: CorralHome, name: str) -> dict[int, dict[str, Any]]:
    """What each READY replica of a service reports about itself, by replica id."""
    svc = home.service(name)
    assert svc is not None
    return {
        r["id"]: {**get_json(r["endpoint"] + "/"), "devices": r["devices"]}
        for r in svc["replicas"]
        if r["status"] == "READY"
    }


def visible(report: dict[str, Any]) -> list[str]:
    value = report["env"]["CUDA_VISIBLE_DEVICES"]
    return value.split(",") if value else []


def held_claims(home: CorralHome) -> Counter[str]:
    """How many live claims in the state file name each device (never more than 1)."""
    rows = home.db_rows(
        "SELECT p.claim_json FROM placements p JOIN replicas r ON r.id = p.replica_id"
        " WHERE r.teardown_state IS NULL OR r.teardown_state != 'succeeded'"
    )
    return Counter(address for (text,) in rows for address in json.loads(text)["gpus"])


def fill_machine(home: CorralHome, tmp_path: Path) -> None:
    """svc-a: 2x A100:1; svc-b: L4:1 pinned to 1 CPU of its own; svc-c: {A10G, L4}:1 (takes
    the L4), with its own CUDA_VISIBLE_DEVICES in the spec (corral's wins); svc-e: asks for
    nothing."""
    home.run("up", "-d", str(gpu_spec(tmp_path, "svc-a", 2, "accelerators: A100:1")))
    pinned = "accelerators: L4:1\ncpus: 1\ncpu_pinning: exclusive"
    home.run("up", "-d", str(gpu_spec(tmp_path, "svc-b", 1, pinned)))
    own = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    spec_c = gpu_spec(tmp_path, "svc-c", 1, "accelerators: {A10G: 1, L4: 1}", envs=own)
    home.run("up", "-d", str(spec_c))
    home.run("up", "-d", str(gpu_spec(tmp_path, "svc-e", 1, "")))
    for name, count in (("svc-a", 2), ("svc-b", 1), ("svc-c", 1), ("svc-e", 1)):
        home.wait_replicas(name, count, timeout=60)


def test_full_machine_waits_then_starts_and_survives_sigkill(
    gpu_home: CorralHome, tmp_path: Path
) -> None:
    home = gpu_home
    fill_machine(home, tmp_path)
    reports = {name: seen(home, name) for name in ("svc-a", "svc-b", "svc-c")}
    given = [d for svc in reports.values() for r in svc.values() for d in visible(r)]
    assert sorted(given) == sorted(A100 + L4)  # the machine exactly, each device once
    assert sorted(d for r in reports["svc-a"].values() for d in visible(r)) == sorted(A100)
    for svc in reports.values():
        for r in svc.values():
            assert r["env"]["NVIDIA_VISIBLE_DEVICES"] == r["env"]["CUDA_VISIBLE_DEVICES"]
            assert [g["uuid"] for g in r["devices"]["gpus"]] == visible(r)
    ((b_id, b),) = reports["svc-b"].items()
    assert len(b["affinity"]) == 1 and b["affinity"] == b["devices"]["cpu_ids"]
    (e,) = seen(home, "svc-e").values()  # asked for nothing: sees no GPU
    assert e["env"]["CUDA_VISIBLE_DEVICES"] == "" and e["env"]["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert e["devices"] is None
    index = 2 + L4.index(visible(b)[0])
    # DEVICES names the GPU as the replica's CUDA_VISIBLE_DEVICES does: by UUID
    assert f"{visible(b)[0]} CPU {b['affinity'][0]}" in home.run("status", "svc-b").stdout

    # what holds each device: `corral daemon status` and /metrics
    info = home.api("GET", "/v1/daemon").json()["inventory"]
    assert [len(g["held_by"]) for g in info["gpus"]] == [1, 1, 1, 1]
    assert {g["held_by"][0]["service"] for g in info["gpus"][:2]} == {"svc-a"}
    assert info["cpus_held"] == 1 and info["cpus_asked"] == 0 and info["memory_asked"] == 0
    metrics = http(
        home.api_url + "/metrics", headers={"Authorization": f"Bearer {home.token}"}
    ).body.decode()
    assert (
        f'corral_gpu_held{{gpu="{index}",model="NVIDIA L4",replica="{b_id}",service="svc-b",'
        f'uuid="{visible(b)[0]}"}} 1.0'
    ) in metrics
    assert 'corral_gpu_free{gpu="0",model="NVIDIA A100-SXM4-80GB",uuid="GPU-a100-0"} 0.0' in (
        metrics
    )

    # the next A100 replica waits, saying why, with one event
    home.run("up", "-d", str(gpu_spec(tmp_path, "svc-d", 1, "accelerators: A100:1")))
    a_ids = sorted(reports["svc-a"])
    reason = (
        f"needs 1x A100; the machine has 2 A100, both held by svc-a replicas "
        f"{a_ids[0]} and {a_ids[1]}"
    )

    def waiting() -> dict[str, Any] | None:
        svc = home.service("svc-d")
        replica = svc["replicas"][0] if svc and svc["replicas"] else None
        return replica if replica and replica.get("waiting") == reason else None

    pending = wait_for(waiting, 30, "svc-d's replica to wait for an A100")
    assert pending["status"] == "PENDING" and pending["devices"] is None
    assert reason in " ".join(home.run("status").stdout.split())
    d_id = pending["id"]
    info = home.api("GET", "/v1/daemon").json()["inventory"]
    assert info["waiting"] == [{"service": "svc-d", "replica": d_id, "reason": reason}]

    def wait_events() -> list[dict[str, Any]]:
        events = home.api("GET", "/v1/services/svc-d/events").json()["events"]
        return [e for e in events if e["action"] == "replica.waiting"]

    # Two reconcile periods (a step at least every 2 s tries the launch again): still one event.
    time.sleep(4.5)
    before = len(wait_events())
    pids = {r["pid"] for svc in ("svc-a", "svc-b", "svc-c") for r in home.service(svc)["replicas"]}

    # SIGKILL the daemon; the next one adopts every replica and books nothing twice.
    home.stop_daemon(signal.SIGKILL)
    assert max(held_claims(home).values()) == 1
    home.start_daemon()
    for name, count in (("svc-a", 2), ("svc-b", 1), ("svc-c", 1)):
        home.wait_replicas(name, count, timeout=60)
    again = {r["pid"] for svc in ("svc-a", "svc-b", "svc-c") for r in home.service(svc)["replicas"]}
    assert again == pids  # adopted, not relaunched
    after = {name: seen(home, name) for name in ("svc-a", "svc-b", "svc-c")}
    assert after == reports
    wait_for(waiting, 30, "svc-d's replica to wait again after the restart")
    assert held_claims(home) == Counter(A100 + L4)
    assert len(wait_events()) == before == 1

    # svc-a scales down to 1: its A100 goes to svc-d at once
    home.run("update", "svc-a", str(gpu_spec(tmp_path, "svc-a", 1, "accelerators: A100:1")))
    home.wait_replicas("svc-d", 1, timeout=60)
    home.wait_replicas("svc-a", 1, timeout=60)
    (d,) = seen(home, "svc-d").values()
    (a,) = seen(home, "svc-a").values()
    assert sorted(visible(d) + visible(a)) == sorted(A100)
    assert int(d["replica"]) == d_id
    assert held_claims(home) == Counter(A100 + L4)


def test_shared_cpus_run_every_replica_asked_and_say_so(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """`cpus: N+` (SkyPilot's VM size) on a machine with N cores: both replicas run, neither
    pinned, and status says they share the CPUs (it was: the second PENDING for good)."""
    cores = len(os.sched_getaffinity(0))
    spec = gpu_spec(tmp_path, "svc-s", 2, f"cpus: {cores}+")
    checked = corral_home.run("validate", str(spec))
    assert f"resources.cpus: 2 replicas x {cores} CPUs asked" in " ".join(checked.stderr.split())
    corral_home.run("up", "-d", str(spec))
    corral_home.wait_replicas("svc-s", 2, timeout=60)
    reports = seen(corral_home, "svc-s")
    assert len(reports) == 2
    for r in reports.values():
        assert r["affinity"] == sorted(os.sched_getaffinity(0))  # not pinned
        assert r["devices"]["cpus"] == cores and not r["devices"]["exclusive"]
    shown = " ".join(corral_home.run("status", "svc-s").stdout.split())
    assert f"{cores} CPUs shared ({2 * cores} CPUs asked of {cores})" in shown, shown
    info = corral_home.api("GET", "/v1/daemon").json()["inventory"]
    assert info["cpus_asked"] == 2 * cores and info["cpus_held"] == 0
    assert info["warnings"] == [f"{2 * cores} CPUs asked of {cores}"]


def test_up_and_update_leave_placement_to_the_daemon(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """The daemon runs on a declared inventory (one H100); `up` and `update` come from a shell
    without CORRAL_INVENTORY (and without a GPU). The daemon's inventory is the one that counts:
    what fits there is placed, what never fits is refused by the daemon (its 400 shown), never
    by the client reading its own shell ("the machine has no H100 ... NVML unavailable")."""
    home = corral_home
    path = tmp_path / "inventory.yaml"
    path.write_text("gpus:\n  - {name: NVIDIA H100 80GB HBM3, uuid: GPU-h100}\n")
    home.start_daemon(env={**home.env, "CORRAL_INVENTORY": str(path)})
    assert "CORRAL_INVENTORY" not in home.env
    home.run("up", "-d", str(gpu_spec(tmp_path, "svc-h", 1, "accelerators: H100:1")))
    home.wait_replicas("svc-h", 1, timeout=60)
    (report,) = seen(home, "svc-h").values()
    assert visible(report) == ["GPU-h100"]
    home.run(
        "update",
        "-d",
        "svc-h",
        str(gpu_spec(tmp_path, "svc-h", 1, "accelerators: H100:1", version="2")),
    )
    assert home.service("svc-h")["version"] == 2

    too_many = gpu_spec(tmp_path, "svc-2", 1, "accelerators: H100:2")
    for args in (("up", "-d", str(too_many)), ("update", "-d", "svc-h", str(too_many))):
        refused = home.run(*args, check=False)
        said = " ".join((refused.stdout + refused.stderr).split())
        assert refused.returncode != 0, said
        assert "resources.accelerators" in said and "the machine has 1 H100" in said, said
        assert "NVML" not in said and "Traceback" not in said, said
    assert home.service("svc-2") is None


def test_gpus_none_hides_every_gpu_from_replicas(corral_home: CorralHome, tmp_path: Path) -> None:
    """`corral daemon run --gpus none` on a machine with GPUs: a replica sees none of them."""
    home = corral_home
    path = tmp_path / "inventory.yaml"
    path.write_text(INVENTORY)
    env = {**home.env, "CORRAL_INVENTORY": str(path)}
    home.start_daemon(argv=home.cli("daemon", "run", "--gpus", "none"), env=env)
    home.run("up", "-d", str(gpu_spec(tmp_path, "svc-n", 1, "")))
    home.wait_replicas("svc-n", 1, timeout=60)
    (report,) = seen(home, "svc-n").values()
    assert report["env"]["CUDA_VISIBLE_DEVICES"] == ""
    assert report["env"]["NVIDIA_VISIBLE_DEVICES"] == "void"


def test_sigkill_during_a_launch_keeps_its_devices(gpu_home: CorralHome, tmp_path: Path) -> None:
    """A daemon killed while a replica's setup runs (its claim written, nothing recorded as
    started): the next daemon launches it again on the same devices, and a replica waiting for
    them still waits."""
    home = gpu_home
    marker = tmp_path / "setup-ran-once"
    setup = f"test -f {marker} || {{ touch {marker}; sleep 120; }}"
    text = spec_text(
        "svc-x",
        1,
        run=f"exec {sys.executable} {APPS / 'devices.py'}",
        setup=setup,
        workdir=APPS,
        extra="resources:\n  accelerators: A100:2\n",
    )
    home.run("up", "-d", str(write_spec(tmp_path / "svc-x.yaml", text)))
    home.run("up", "-d", str(gpu_spec(tmp_path, "svc-y", 1, "accelerators: A100:1")))

    def provisioning() -> dict[str, Any] | None:
        (r,) = home.service("svc-x")["replicas"]
        return r if r["status"] == "PROVISIONING" and marker.exists() else None

    x = wait_for(provisioning, 60, "svc-x's setup to run")
    assert sorted(g["uuid"] for g in x["devices"]["gpus"]) == sorted(A100)
    wait_for(lambda: home.service("svc-y")["replicas"][0]["waiting"], 30, "svc-y to wait")
    home.stop_daemon(signal.SIGKILL)
    assert held_claims(home) == Counter(A100)
    home.start_daemon()
    home.wait_replicas("svc-x", 1, timeout=90)
    ((x_id, report),) = seen(home, "svc-x").items()
    assert x_id == x["id"] and sorted(visible(report)) == sorted(A100)
    events = home.api("GET", "/v1/services/svc-x/events").json()["events"]
    assert any(e["action"] == "replica.relaunch" and e["replica_id"] == x_id for e in events)
    (y,) = home.service("svc-y")["replicas"]
    assert y["status"] == "PENDING"
    assert (
        y["waiting"] == f"needs 1x A100; the machine has 2 A100, both held by svc-x replica {x_id}"
    )
    assert held_claims(home) == Counter(A100)
    # Its log does not exist yet, and the answer says why (it pointed at the launch log,
    # which did not exist either).
    said = home.run("logs", "svc-y", str(y["id"]), "--no-follow", check=False)
    assert said.returncode == 1 and f"(it is PENDING: it waits: {y['waiting']})" in said.stderr


def test_rolling_update_on_a_full_machine_completes(gpu_home: CorralHome, tmp_path: Path) -> None:
    home = gpu_home
    home.run("up", "-d", str(gpu_spec(tmp_path, "svc-a", 2, "accelerators: A100:1")))
    home.run("up", "-d", str(gpu_spec(tmp_path, "svc-r", 2, "accelerators: L4:1")))
    home.wait_replicas("svc-a", 2, timeout=60)
    home.wait_replicas("svc-r", 2, timeout=60)
    a_pids = {r["pid"] for r in home.service("svc-a")["replicas"]}
    old = set(seen(home, "svc-r"))
    # another service waits for an L4 all along: the devices an old replica frees are handed
    # to its successor, never taken by the waiter in between
    home.run("up", "-d", str(gpu_spec(tmp_path, "svc-w", 1, "accelerators: L4:1")))
    wait_for(
        lambda: (home.service("svc-w")["replicas"] or [{}])[0].get("waiting"), 30, "svc-w waits"
    )

    spec = gpu_spec(tmp_path, "svc-r", 2, "accelerators: L4:1", version="2")
    update = home.popen("update", "svc-r", str(spec), "--mode", "rolling")
    lowest = 2
    statuses: list[list[str]] = []

    def done() -> bool:
        nonlocal lowest
        svc = home.service("svc-r")
        assert svc is not None
        ready = [r for r in svc["replicas"] if r["status"] == "READY"]
        lowest = min(lowest, len(ready))
        statuses.append([f"{r['id']}:{r['version']}:{r['status']}" for r in svc["replicas"]])
        live = [r for r in svc["replicas"] if r["status"] != "READY"]
        return (
            svc["version"] == 2
            and len(ready) == 2
            and not live
            and (all(r["version"] == 2 for r in ready))
        )

    wait_for(done, 120, "the rolling update to finish", interval=0.05)
    update.wait(60)
    assert lowest >= 1, statuses  # READY never below target - 1
    new = seen(home, "svc-r")
    assert not set(new) & old
    assert sorted(d for r in new.values() for d in visible(r)) == sorted(L4)
    assert all(r["version"] == "2" for r in new.values())
    assert {r["pid"] for r in home.service("svc-a")["replicas"]} == a_pids
    assert held_claims(home) == Counter(A100 + L4)
    (w,) = home.service("svc-w")["replicas"]
    assert w["status"] == "PENDING" and "svc-r replicas" in w["waiting"]
    events = home.api("GET", "/v1/services/svc-r/events").json()["events"]
    one_at_a_time = [e for e in events if "replacing one at a time" in (e["reason"] or "")]
    assert len(one_at_a_time) == 2


def test_a_broken_version_on_a_full_machine_leaves_the_rest_serving(
    gpu_home: CorralHome, tmp_path: Path
) -> None:
    """Only one old replica is replaced before the new version has a READY one: a version that
    never becomes READY costs one replica while it is tried, not the service; given up, the
    version still serving gets that replica back on the device it freed (corral.fallback)."""
    home = gpu_home
    home.run("up", "-d", str(gpu_spec(tmp_path, "svc-r", 2, "accelerators: L4:1")))
    home.wait_replicas("svc-r", 2, timeout=60)
    broken = gpu_spec(tmp_path, "svc-r", 2, "accelerators: L4:1", version="2", run="exit 3")
    update = home.popen("update", "svc-r", str(broken), "--mode", "rolling")
    lowest = 2

    def gave_up() -> bool:
        nonlocal lowest
        svc = home.service("svc-r")
        assert svc is not None
        ready = [r for r in svc["replicas"] if r["status"] == "READY" and r["version"] == 1]
        lowest = min(lowest, len(ready))
        return "never became ready" in (svc.get("last_update_failure") or svc["failure"] or "")

    wait_for(gave_up, 90, "version 2 to be given up", interval=0.05)
    svc = home.wait_replicas("svc-r", 2, timeout=60)
    assert lowest == 1
    assert {r["version"] for r in svc["replicas"] if r["status"] == "READY"} == {1}, svc
    assert held_claims(home) == Counter(L4)
    assert update.wait(60) == 1
    assert update.stdout is not None
    assert b"not promoted" in update.stdout.read()


def test_blue_green_is_refused_where_the_new_version_could_never_start(
    gpu_home: CorralHome, tmp_path: Path
) -> None:
    """Blue-green keeps the old replicas' devices until new ones are READY: with no room for
    the new ones beside them it could never switch, so it is refused up front (rolling is the
    way on a full machine); with room it goes through."""
    home = gpu_home
    home.run("up", "-d", str(gpu_spec(tmp_path, "svc-bg", 2, "accelerators: L4:1")))
    home.wait_replicas("svc-bg", 2, timeout=60)
    new = gpu_spec(tmp_path, "svc-bg", 2, "accelerators: L4:1", version="2")
    refused = home.run("update", "svc-bg", str(new), "--mode", "blue_green", check=False)
    assert refused.returncode != 0, refused.stdout
    said = " ".join(refused.stderr.split())
    assert "blue-green update" in said and "--mode rolling" in said and "L4" in said, said
    svc = home.service("svc-bg")
    assert svc is not None and svc["version"] == 1 and svc["status"] == "READY", svc
    assert [v["version"] for v in svc["versions"]] == [1]

    # The two A100s are free: a service on them has room for its new version beside the old.
    home.run("up", "-d", str(gpu_spec(tmp_path, "svc-roomy", 1, "accelerators: A100:1")))
    home.wait_replicas("svc-roomy", 1, timeout=60)
    roomy = gpu_spec(tmp_path, "svc-roomy", 1, "accelerators: A100:1", version="2")
    home.run("update", "svc-roomy", str(roomy), "--mode", "blue_green", timeout=120)
    svc = home.service("svc-roomy")
    assert svc is not None and svc["version"] == 2
    assert [r["version"] for r in svc["replicas"] if r["status"] == "READY"] == [2]


@pytest.mark.parametrize(
    ("accelerators", "why"),
    [
        ("H100:1", "the machine has no H100"),
        ("A100:3", "needs 3x A100: the machine has 2 A100"),
        ("A100:1.5", "a count is a whole number of devices"),
    ],
)
def test_asks_that_can_never_fit_are_refused(
    gpu_home: CorralHome, tmp_path: Path, accelerators: str, why: str
) -> None:
    spec = gpu_spec(tmp_path, "bad", 1, f"accelerators: {accelerators}")
    result = gpu_home.run("validate", str(spec), check=False)
    text = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 1, text
    assert "resources.accelerators" in text and why in text
    if "whole number" not in why:  # a malformed count needs no inventory
        assert "its GPUs: 2x NVIDIA A100-SXM4-80GB 80 GiB, 2x NVIDIA L4 24 GiB" in text
    assert gpu_home.daemon_info() is None  # validate reads the inventory itself

    # the daemon refuses it too (the API is the trust boundary), naming the same field
    gpu_home.run("up", "-d", str(gpu_spec(tmp_path, "good", 1, "accelerators: L4:1")))
    answer = gpu_home.api(
        "POST", "/v1/services", body={"spec": spec.read_text(), "source": str(spec)}
    )
    assert answer.status == 400, answer.body
    message = answer.json()["error"]
    assert "resources.accelerators" in message and why in message
    assert "whole number" in why or "2x NVIDIA L4 24 GiB (inventory from" in message
    answer = gpu_home.api(
        "POST", "/v1/services/good/versions", body={"spec": spec.read_text().replace("bad", "good")}
    )
    assert answer.status == 400, answer.body
    assert why in answer.json()["error"]


def test_daemon_refuses_a_bad_inventory(corral_home: CorralHome, tmp_path: Path) -> None:
    path = tmp_path / "inventory.yaml"
    path.write_text("gpus:\n  - {name: NVIDIA L4, index: -1}\n")
    corral_home.env["CORRAL_INVENTORY"] = str(path)
    result = corral_home.run("daemon", "run", check=False)
    assert result.returncode == 1
    assert "gpus[0].index: expected a whole number >= 0, got -1" in result.stderr
    corral_home.env["CORRAL_INVENTORY"] = ""
    result = corral_home.run("daemon", "run", "--gpus", "7", check=False)
    assert result.returncode == 1
    assert "CORRAL_GPUS (--gpus): no GPU '7' on this machine" in " ".join(result.stderr.split())
