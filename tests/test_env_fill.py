"""`envs` filled into `service:` as SkyPilot fills them, with the values given at `up` too.

Why: SkyServe's LLM specs probe with ``post_data: {model: $MODEL_NAME}``, and an engine
answers 404 for a model it does not serve. Filled with a value other than the one the replica
runs with (the spec's own, when `--env` gave another; or none, when only `--env` gave one), no
replica ever becomes READY. A restarted daemon parses the stored spec again, and must fill in
the same values.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from conftest import CorralHome, write_spec

from corral.spec import parse_spec

# Like vLLM: the probe's POST names a model, and only the one it serves answers 200.
ENGINE = """\
import json, os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ok = body.get("model") == os.environ["MODEL_NAME"]
        self.send_response(200 if ok else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


ThreadingHTTPServer(("127.0.0.1", int(os.environ["PORT"])), Handler).serve_forever()
"""

SPEC = """\
name: filled
workdir: app
run: exec python3 engine.py
envs:
  MODEL_NAME: {spec_value}
service:
  readiness_probe:
    path: /v1/chat/completions
    post_data:
      model: $MODEL_NAME
    initial_delay_seconds: 60
    period_seconds: 0.2
  replicas: 1
"""


def test_values_given_at_up_override_the_specs_where_they_are_filled() -> None:
    text = "envs:\n  M: spec\n  E:\nservice:\n  readiness_probe:\n    post_data: {m: $M, e: $E}\n"
    assert parse_spec(text + "run: x\n").service.readiness_probe.post_data == {
        "m": "spec",
        "e": "$E",  # no value anywhere: left as written
    }
    given = parse_spec(text + "run: x\n", envs={"M": "given", "E": "also"})
    assert given.service.readiness_probe.post_data == {"m": "given", "e": "also"}
    # A secret's value never enters the parsed spec, which status and the API show parts of.
    secret = "secrets:\n  S: hush\nservice:\n  readiness_probe:\n    post_data: {s: $S}\n"
    assert parse_spec(secret + "run: x\n").service.readiness_probe.post_data == {"s": "$S"}


def _replica_pid(home: CorralHome) -> int:
    svc: Any = home.wait_replicas("filled", 1, timeout=30)
    return int(svc["replicas"][0]["pid"])


def test_the_probe_asks_for_the_model_given_at_up_before_and_after_a_restart(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "engine.py").write_text(ENGINE)
    spec = write_spec(tmp_path / "filled.yaml", SPEC.format(spec_value="org/spec-default"))
    up = corral_home.run(
        "up", str(spec), "--env", "MODEL_NAME=org/given", "--timeout", "40", cwd=tmp_path
    )
    assert up.returncode == 0, up.stderr
    first = _replica_pid(corral_home)

    # A restarted daemon reads the spec from the state file, and the values from the version's.
    corral_home.run("daemon", "stop")
    corral_home.run("daemon", "start")
    corral_home.note_daemon()
    os.kill(first, signal.SIGKILL)  # its successor must pass the probe the new daemon sends
    corral_home.wait_for(
        lambda: (
            (s := corral_home.service("filled"))
            and any(r["status"] == "READY" and r["pid"] not in (None, first) for r in s["replicas"])
        ),
        40,
        "a new replica READY after the restart",
    )

    # A rollback reuses version 1's values: its replicas are probed for the same model.
    corral_home.run("update", "filled", "--to-version", "1", "--timeout", "40")
    corral_home.wait_for(
        lambda: (
            (s := corral_home.service("filled"))
            and any(r["status"] == "READY" and r["version"] == 2 for r in s["replicas"])
        ),
        40,
        "version 2 (version 1 again) READY",
    )


def test_the_cli_checks_a_workdir_given_by_env_with_that_value(tmp_path: Path) -> None:
    """`workdir: $WD` with WD given at `update` (--env): the CLI checked the path as the spec
    alone fills it ("$WD does not exist") and refused what the daemon would have run."""
    from click.testing import CliRunner

    from corral.cli import main

    (tmp_path / "app").mkdir()
    spec = tmp_path / "svc.yaml"
    spec.write_text(
        "name: wd\nenvs:\n  WD: null\nworkdir: $WD\n"
        "service:\n  readiness_probe: /\n  replicas: 1\nrun: python -m http.server $PORT\n"
    )
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        args = ["--home", str(tmp_path / "home"), "update", "wd", str(spec), "--env", "WD=app"]
        result = CliRunner().invoke(main, args)
    finally:
        os.chdir(cwd)
    assert "does not exist" not in result.output, result.output
    assert "daemon" in result.output.lower(), result.output  # it got as far as asking one


def test_a_workdir_naming_an_env_without_a_value_says_where_its_value_comes_from(
    tmp_path: Path,
) -> None:
    """`validate` takes no --env: a `workdir: $WD` whose WD is given only at `up` is missing
    there, and the hint says so instead of asking for an absolute path."""
    from corral.spec import path_issues

    text = "envs:\n  WD: null\nworkdir: $WD\nservice:\n  replicas: 1\nrun: x $PORT\n"
    (issue,) = path_issues(parse_spec(text), tmp_path)
    assert issue.loc == "workdir" and "$WD does not exist" in issue.message
    assert issue.hint is not None and "--env" in issue.hint
    filled = parse_spec(text, envs={"WD": str(tmp_path)})
    assert path_issues(filled, tmp_path) == []
