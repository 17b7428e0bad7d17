"""Through the CLI, with a real daemon and real replicas: names made up at `up`, a version's own
copy of its workdir, `--env`/`--secret`, and where a secret must never show."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import stat
import sys
import textwrap
import urllib.request
from pathlib import Path
from typing import Any

from conftest import CorralHome, get_json, wait_for, write_spec

# The replica's app: says which code it runs, what its environment holds (a digest for the
# secret, never the value), whether ignored files came along, and whether it can write to its
# own files.
SERVER = """\
import hashlib, json, os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CODE = "{code}"


def writable():
    try:
        with open("data/kept.txt", "a") as handle:
            handle.write(" touched")
            return True
    except OSError:
        return False


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        secret = os.environ.get("API_KEY", "")
        body = json.dumps({{
            "code": CODE,
            "plain": os.environ.get("PLAIN"),
            "mode": os.environ.get("MODE"),
            "secret_sha256": hashlib.sha256(secret.encode()).hexdigest() if secret else None,
            "leaked_shell_var": os.environ.get("SHELL_ONLY_VAR"),
            "ignored_present": os.path.exists("ignored.log"),
            "skipped_present": os.path.exists("build"),
            "kept_present": os.path.exists("data/kept.txt"),
            "can_write_own_file": writable(),
        }}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


ThreadingHTTPServer(("127.0.0.1", int(os.environ["PORT"])), Handler).serve_forever()
"""

SPEC = """\
workdir: app
run: exec {python} server.py
envs:
  MODE: fast
  PLAIN:
secrets:
  API_KEY:
service:
  readiness_probe:
    path: /
    initial_delay_seconds: 60
    period_seconds: 0.2
  replicas: 1
"""


def make_app(root: Path, code: str) -> Path:
    app = root / "app"
    (app / "data").mkdir(parents=True, exist_ok=True)
    (app / "server.py").write_text(SERVER.format(code=code))
    (app / "data" / "kept.txt").write_text("kept")
    (app / "ignored.log").write_text("not copied")
    (app / "build").mkdir(exist_ok=True)
    (app / "build" / "out.bin").write_bytes(b"\0" * 10)
    (app / ".gitignore").write_text("*.log\nbuild/\n")
    return app


def spec_file(root: Path) -> Path:
    return write_spec(root / "svc.yaml", SPEC.format(python=sys.executable))


def endpoint(home: CorralHome, name: str) -> str:
    service = home.service(name)
    assert service is not None
    return str(service["endpoint"])


def ready_replica(home: CorralHome, name: str, not_id: int | None = None) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        service = home.service(name) or {"replicas": []}
        for replica in service["replicas"]:
            if replica["status"] == "READY" and replica["id"] != not_id:
                return dict(replica)
        return None

    return wait_for(check, 60, f"a READY replica of {name} other than {not_id}")


def up(home: CorralHome, root: Path, *args: str) -> str:
    result = home.run(
        "up",
        str(spec_file(root)),
        "--env",
        "PLAIN",
        "--secret",
        "API_KEY=s3cr3t-value-4711",
        *args,
        cwd=root,
        env={"PLAIN": "from-shell", "SHELL_ONLY_VAR": "should-not-reach"},
    )
    return result.stdout


def test_up_without_a_name_makes_one_and_prints_it(corral_home: CorralHome, tmp_path: Path) -> None:
    make_app(tmp_path, "v1")
    output = up(corral_home, tmp_path)
    names = [s["name"] for s in corral_home.status()]
    assert len(names) == 1 and names[0].startswith("corral-service-"), names
    assert len(names[0]) == len("corral-service-") + 4
    assert f"service name: {names[0]} (generated" in output, output


def test_a_version_runs_from_its_own_copy_until_update(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    app = make_app(tmp_path, "v1")
    up(corral_home, tmp_path, "-n", "web")
    url = endpoint(corral_home, "web")
    first = get_json(url)
    assert first["code"] == "v1"
    # .gitignore'd files stay behind; the rest came along; the replica cannot change the copy
    # (shared with other versions by hard links).
    assert (first["ignored_present"], first["skipped_present"], first["kept_present"]) == (
        False,
        False,
        True,
    )
    stored = corral_home.path / "services" / "web" / "versions" / "1" / "workdir"
    daemon = corral_home.api("GET", "/v1/daemon").json()
    if daemon["confinement"]["confined"] or os.geteuid() != 0:
        # The replica's writes go to its own overlay (or are refused where there is none),
        # never to the stored file other versions share. An unconfined root daemon's
        # replicas could write to it (docs/spec.md says so).
        assert (stored / "data" / "kept.txt").read_text() == "kept"
    if daemon["confinement"]["confined"] and os.geteuid() == 0:
        assert first["can_write_own_file"] is True  # copy-on-write: an overlay

    # Edit the live directory, then make the replica die: its replacement serves version 1's
    # copy, not the edit.
    (app / "server.py").write_text(SERVER.format(code="v2"))
    old = ready_replica(corral_home, "web")
    os.kill(old["pid"], signal.SIGKILL)
    ready_replica(corral_home, "web", not_id=old["id"])
    assert get_json(url)["code"] == "v1"

    corral_home.run(
        "update", "web", str(tmp_path / "svc.yaml"), "--env", "PLAIN=again",
        "--secret", "API_KEY=s3cr3t-value-4711", cwd=tmp_path,
    )  # fmt: skip
    answer = get_json(url)
    assert (answer["code"], answer["plain"]) == ("v2", "again")

    # Both versions' files are in the home, sharing the unchanged file's inode; stored files
    # are read-only.
    versions = corral_home.path / "services" / "web" / "versions"
    kept = [versions / v / "workdir" / "data" / "kept.txt" for v in ("1", "2")]
    assert kept[0].stat().st_ino == kept[1].stat().st_ino
    assert kept[1].read_text() == "kept"
    assert stat.S_IMODE(kept[0].stat().st_mode) == 0o444
    corral_home.run("down", "web")
    assert not versions.exists()
    assert not any((corral_home.path / "store").iterdir())


def test_a_secret_reaches_the_replica_and_nothing_else(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    secret = "s3cr3t-value-4711"
    make_app(tmp_path, "v1")
    up(corral_home, tmp_path, "-n", "sec")
    answer = get_json(endpoint(corral_home, "sec"))
    assert answer["secret_sha256"] == hashlib.sha256(secret.encode()).hexdigest()
    assert (answer["plain"], answer["mode"]) == ("from-shell", "fast")
    assert answer["leaked_shell_var"] is None  # the shell's other variables stay behind

    service = corral_home.service("sec")
    assert service is not None
    replica = service["replicas"][0]["id"]
    seen = [
        corral_home.run("status", "--json").stdout,
        corral_home.run("status").stdout,
        corral_home.run("logs", "sec", str(replica), "--launch", "--no-follow").stdout,
        corral_home.run("logs", "sec", str(replica), "--no-follow").stdout,
        corral_home.run("logs", "sec", "--controller", "--no-follow").stdout,
    ]
    for path in ("/v1/services", "/v1/services/sec", "/v1/services/sec/events"):
        seen.append(corral_home.api("GET", path).body.decode())
    for text in seen:
        assert secret not in text
    # Not in the state file (nor its WAL or backup), the logs or any other file of the home
    # but the version's 0600 values file.
    with sqlite3.connect(corral_home.path / "state.db") as db:
        stored = db.execute("SELECT spec_yaml FROM versions").fetchone()[0]
    assert "API_KEY" in stored and secret not in stored
    holders = []
    for path in corral_home.path.rglob("*"):
        if path.is_file() and not path.is_symlink() and secret.encode() in path.read_bytes():
            holders.append(path.relative_to(corral_home.path).as_posix())
    assert holders == ["services/sec/versions/1/values.json"], holders
    values = corral_home.path / holders[0]
    assert stat.S_IMODE(values.stat().st_mode) == 0o600

    # The API checks what the CLI checks: a key left empty and not given is refused, by name.
    text = (tmp_path / "svc.yaml").read_text()
    refused = corral_home.api(
        "POST", "/v1/services", body={"spec": text, "name": "other", "base_dir": str(tmp_path)}
    )
    assert refused.status == 400
    fields = {issue["field"] for issue in refused.json()["issues"]}
    assert fields == {"envs.PLAIN", "secrets.API_KEY"}, refused.json()


def test_an_empty_env_must_be_given_at_up(corral_home: CorralHome, tmp_path: Path) -> None:
    make_app(tmp_path, "v1")
    result = corral_home.run(
        "up", str(spec_file(tmp_path)), "--secret", "API_KEY=x", cwd=tmp_path, check=False
    )
    assert result.returncode == 1
    assert "envs.PLAIN: has no value in the spec and none was given" in result.stderr
    assert "pass --env PLAIN=VALUE" in result.stderr, result.stderr
    assert corral_home.daemon_info() is None  # refused before anything started

    unset = corral_home.run(
        "up", str(spec_file(tmp_path)), "--env", "PLAIN", cwd=tmp_path, check=False,
        env={"PLAIN": ""} | {"CORRAL_UNUSED": "1"},
    )  # fmt: skip
    assert unset.returncode == 1 and "secrets.API_KEY" in unset.stderr


def test_every_problem_at_once_in_text_and_json(corral_home: CorralHome, tmp_path: Path) -> None:
    bad = write_spec(
        tmp_path / "bad.yaml",
        textwrap.dedent(
            """\
            run: python3 server.py
            workdir: nowhere
            servce:
              replicas: 2
            resources:
              cpus: lots
            """
        ),
    )
    text = corral_home.run("validate", str(bad), check=False, cwd=tmp_path)
    assert text.returncode == 1
    assert "valid" not in text.stdout
    lines = text.stderr.splitlines()
    assert any(f"{bad}:3: servce: unknown field 'servce'; did you mean" in x for x in lines)
    assert any(f"{bad}:6: resources.cpus:" in x for x in lines), text.stderr

    as_json = corral_home.run("validate", "--json", str(bad), check=False, cwd=tmp_path)
    assert as_json.returncode == 1
    document = json.loads(as_json.stdout)
    assert document["valid"] is False
    errors = {e["field"]: e for e in document["errors"]}
    # The workdir behind the refused fields too: every problem in one go.
    assert set(errors) == {"servce", "resources.cpus", "workdir"}
    assert errors["servce"]["line"] == 3
    assert errors["servce"]["hint"] == "did you mean 'service'?"
    assert set(errors["resources.cpus"]) == {"field", "line", "message", "hint"}

    (tmp_path / "bad.yaml").write_text(
        "run: python3 server.py\nworkdir: nowhere\nservice:\n  readiness_probe: /\n"
    )
    missing = json.loads(
        corral_home.run("validate", "--json", str(bad), check=False, cwd=tmp_path).stdout
    )
    assert [e["field"] for e in missing["errors"]] == ["workdir"]
    assert missing["errors"][0]["line"] == 2 and missing["spec"]["name"] is None


def probe_timeout_spec(timeout: int, replicas: int = 1) -> str:
    """The app of make_app, its probe timeout the only thing that varies: a change of the
    service section alone, which keeps the replicas (relabelled)."""
    return (
        f"workdir: app\nrun: exec {sys.executable} server.py\n"
        "service:\n  readiness_probe:\n    path: /\n    period_seconds: 0.2\n"
        f"    timeout_seconds: {timeout}\n  replicas: {replicas}\n"
    )


def test_old_versions_files_are_pruned_and_rollback_says_so(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    make_app(tmp_path, "v1")

    write_spec(tmp_path / "small.yaml", probe_timeout_spec(2))
    corral_home.run("up", str(tmp_path / "small.yaml"), "-n", "hist", cwd=tmp_path)
    # Twelve updates of the service section only: the replica is kept (relabelled), and every
    # version gets its own copy (sharing every file).
    for timeout in range(3, 15):
        body = {"spec": probe_timeout_spec(timeout), "base_dir": str(tmp_path)}
        answer = corral_home.api("POST", "/v1/services/hist/versions", body=body)
        assert answer.status == 201, answer.body
    versions = corral_home.path / "services" / "hist" / "versions"
    kept = sorted(int(p.name) for p in versions.iterdir())
    assert kept == list(range(4, 14)), kept  # the last 10 (the replica runs version 13)
    gone = corral_home.api("POST", "/v1/services/hist/versions", body={"from_version": 2})
    assert gone.status == 409 and "files of version 2 were removed" in gone.json()["error"]
    back = corral_home.api("POST", "/v1/services/hist/versions", body={"from_version": 5})
    assert back.status == 201, back.body
    assert (versions / "14" / "workdir" / "server.py").read_text() == SERVER.format(code="v1")


def test_a_replica_kept_by_service_only_updates_keeps_its_launching_files(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """Eleven updates of the service section only: the replica, relabelled each time, still
    runs in version 1's files (its working directory), which fell out of the last 10. They
    are held aside while it runs (it still sees its own files), never under ``versions/``
    (the window stays the last 10), and go at the first prune after it went."""
    make_app(tmp_path, "v1")
    write_spec(tmp_path / "small.yaml", probe_timeout_spec(2))
    corral_home.run("up", str(tmp_path / "small.yaml"), "-n", "held", cwd=tmp_path)
    first = ready_replica(corral_home, "held")
    for timeout in range(3, 14):
        body = {"spec": probe_timeout_spec(timeout), "base_dir": str(tmp_path)}
        answer = corral_home.api("POST", "/v1/services/held/versions", body=body)
        assert answer.status == 201, answer.body
    service_dir = corral_home.path / "services" / "held"
    assert sorted(int(p.name) for p in (service_dir / "versions").iterdir()) == [*range(3, 13)]
    assert (service_dir / "held" / "1" / "workdir" / "server.py").is_file()
    answer = get_json(endpoint(corral_home, "held"))
    assert answer["code"] == "v1" and answer["kept_present"], answer
    assert ready_replica(corral_home, "held")["pid"] == first["pid"]  # never relaunched
    corral_home.run("down", "held", "--replica-id", str(first["id"]), "-y")
    ready_replica(corral_home, "held", not_id=first["id"])
    wait_for(
        lambda: len((corral_home.service("held") or {"replicas": [0, 0]})["replicas"]) == 1,
        60,
        "the replaced replica's row gone",
    )
    body = {"spec": probe_timeout_spec(20), "base_dir": str(tmp_path)}
    assert corral_home.api("POST", "/v1/services/held/versions", body=body).status == 201
    assert not (service_dir / "held" / "1").exists()


def test_an_update_of_the_service_section_moves_the_traffic_to_its_version(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """The replicas are kept and relabelled: `traffic_versions` and the replicas name the new
    version at once (it kept naming the old one), the same processes serve."""
    make_app(tmp_path, "v1")

    write_spec(tmp_path / "same.yaml", probe_timeout_spec(2, replicas=2))
    corral_home.run("up", str(tmp_path / "same.yaml"), "-n", "same", cwd=tmp_path)
    before = corral_home.wait_replicas("same", 2)
    write_spec(tmp_path / "same.yaml", probe_timeout_spec(3, replicas=2))
    corral_home.run("update", "same", str(tmp_path / "same.yaml"), cwd=tmp_path, timeout=60)
    after = corral_home.service("same")
    assert after is not None and after["version"] == 2
    assert after["traffic_versions"] == [2], after
    assert {r["version"] for r in after["replicas"]} == {2}
    assert {r["pid"] for r in after["replicas"]} == {r["pid"] for r in before["replicas"]}


def test_a_spec_kept_in_its_workdir_keeps_the_replicas_on_a_service_section_update(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """The spec file lies in the workdir it names (as examples/demo.yaml does): editing its
    service section changes a file of the copy, and that alone must not relaunch every
    replica. Another file of the workdir changed still does."""
    make_app(tmp_path, "v1")
    spec = tmp_path / "app" / "svc.yaml"
    write_spec(spec, probe_timeout_spec(2, replicas=2))
    corral_home.run("up", str(spec), "-n", "inwd", cwd=tmp_path)
    before = corral_home.wait_replicas("inwd", 2)
    write_spec(spec, probe_timeout_spec(3, replicas=2))
    corral_home.run("update", "inwd", str(spec), cwd=tmp_path, timeout=60)
    after = corral_home.service("inwd")
    assert after is not None and after["version"] == 2
    assert {r["version"] for r in after["replicas"]} == {2}, after
    assert {r["pid"] for r in after["replicas"]} == {r["pid"] for r in before["replicas"]}
    (tmp_path / "app" / "notes.txt").write_text("a file the app may read\n")
    write_spec(spec, probe_timeout_spec(4, replicas=2))
    corral_home.run("update", "inwd", str(spec), cwd=tmp_path, timeout=60)
    moved = [r for r in corral_home.wait_replicas("inwd", 2)["replicas"] if r["status"] == "READY"]
    assert {r["version"] for r in moved} == {3}, moved
    assert not {r["pid"] for r in moved} & {r["pid"] for r in before["replicas"]}


def test_a_failed_update_after_one_that_kept_the_replicas_names_the_version_serving(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """Version 2 changes the service section only (the replicas are kept, relabelled); version
    3 cannot start (exit 127: given up at the first failure). Everything that says which
    version still serves names 2, the one the replicas run, never 1."""
    make_app(tmp_path, "v1")
    spec = tmp_path / "kept.yaml"
    write_spec(spec, probe_timeout_spec(2, replicas=2))
    corral_home.run("up", str(spec), "-n", "kept", cwd=tmp_path)
    pids = {r["pid"] for r in corral_home.wait_replicas("kept", 2)["replicas"]}
    write_spec(spec, probe_timeout_spec(3, replicas=2))
    corral_home.run("update", "kept", str(spec), cwd=tmp_path, timeout=60)
    broken = probe_timeout_spec(3, replicas=2).replace(f"exec {sys.executable}", "pyhton3")
    write_spec(spec, broken)
    failed = corral_home.run("update", "kept", str(spec), cwd=tmp_path, timeout=60, check=False)
    said = " ".join((failed.stdout + failed.stderr).split())
    assert failed.returncode == 1, said
    assert "version 3 not promoted: version 3 never became ready" in said, said
    assert "pyhton3" in said and said.endswith("traffic stays on version 2"), said

    svc = corral_home.service("kept")
    assert svc is not None and svc["version"] == 3 and svc["status"] == "READY", svc
    assert svc["traffic_versions"] == [2], svc
    assert "version 3 never became ready" in (svc["last_update_failure"] or ""), svc
    serving = [r for r in svc["replicas"] if r["status"] == "READY"]
    assert {r["version"] for r in serving} == {2} and {r["pid"] for r in serving} == pids
    status = " ".join(corral_home.run("status", "kept").stdout.split())
    assert "2 (v3 failed)" in status, status
    assert "kept: update failed, traffic stays on version 2: version 3 never became" in status
    events = corral_home.api("GET", "/v1/services/kept/events").json()["events"]
    gave_up = [e["reason"] for e in events if e["action"] == "service.failed"]
    assert gave_up and all(r.endswith("; traffic stays on version 2") for r in gave_up), gave_up


def probe_path_spec(path: str) -> str:
    """A server that answers 404 off its files: the probe's path decides whether it passes."""
    return (
        f"run: exec {sys.executable} -m http.server $PORT --bind 127.0.0.1\n"
        "service:\n  readiness_probe:\n"
        f"    path: {path}\n    period_seconds: 0.2\n    initial_delay_seconds: 2\n"
        "  replicas: 1\n"
    )


def test_an_update_of_what_the_probe_asks_is_proven_on_new_replicas(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """A service-section update that changes the probe's path keeps no replica: the running
    ones, relabelled, failed the new probe all at once and the service answered 503, while
    `update` said the version served all traffic. Proven on new replicas instead, as any
    rolling update: they never pass, the version is not promoted, the old replica serves."""
    spec = write_spec(tmp_path / "probed.yaml", probe_path_spec("/"))
    corral_home.run("up", str(spec), "-n", "probed", cwd=tmp_path)
    before = corral_home.wait_replicas("probed", 1)
    write_spec(spec, probe_path_spec("/missing"))
    failed = corral_home.run("update", "probed", str(spec), cwd=tmp_path, timeout=90, check=False)
    said = " ".join((failed.stdout + failed.stderr).split())
    assert failed.returncode == 1, said
    assert "version 2 not promoted" in said, said
    svc = corral_home.service("probed")
    assert svc is not None and svc["status"] == "READY", svc
    assert svc["traffic_versions"] == [1], svc
    serving = [r for r in svc["replicas"] if r["status"] == "READY"]
    assert {r["pid"] for r in serving} == {r["pid"] for r in before["replicas"]}, svc
    with urllib.request.urlopen(svc["endpoint"] + "/", timeout=10) as answer:
        assert answer.status == 200
