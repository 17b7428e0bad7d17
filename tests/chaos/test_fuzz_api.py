"""API fuzzing with schemathesis against a REAL daemon and its own OpenAPI schema.

The daemon of a ``corral_home`` is started for real (``corral daemon run``), with one real
service (examples/app.py, one replica) so the routes that take a service name also meet a name
that exists. The schema is fetched from the daemon itself (``/v1/openapi.json``, with the token)
and every operation in it is fuzzed:

* authorized, with data that fits the schema (positive) and data that does not (negative);
* unauthorized, with no token and with wrong ones: every route but /v1/health must answer 401.

Checks on every answer: no 5xx, an answer within a hang guard (far above the real cost: this is
not a speed test), a status code the schema lists, and a body that conforms to the schema. Once
the fuzzing is over the daemon must still answer, and the real service must still be READY.

Destructive operations are handled, not skipped:

* ``POST /v1/daemon/stop`` is fuzzed only without a valid token (it must then be refused, and
  the daemon must keep running); authorized, it is tested once at the end, where the daemon must
  answer 202 and exit. The fixture's teardown starts a daemon again to take the services down.
* ``DELETE /v1/services/{name}`` is fuzzed with generated names (4xx), and the real service is
  deleted once at the end, checked against the schema.
* a generated spec posted to ``POST /v1/services`` or ``/versions`` that is a VALID spec is not
  sent as is: its ``run`` is replaced by a harmless ``sleep`` (fuzzing must not run random shell
  text), and it still goes through the daemon. The fixture's teardown fails the test if any
  replica process is left behind.
* ``follow=true`` on logs streams until the service goes away, by design; it is turned off so a
  request cannot block the run (following is tested end to end elsewhere).

Rounds: hypothesis examples per operation and mode, ``rounds(short, long)``.
"""

from __future__ import annotations

import contextlib
import json
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from chaos_support import BASE_SEED, record, rounds
from conftest import EXAMPLES, CorralHome, http, pid_alive, wait_for, write_spec
from hypothesis import HealthCheck, given, seed, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.generation import GenerationMode

from corral.spec import SpecError, parse_spec

pytestmark = pytest.mark.timeout(600)

# A hang guard per request, not a speed assertion: the daemon answers in milliseconds.
REQUEST_TIMEOUT = 20.0
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
SETTINGS: dict[str, Any] = {
    "deadline": None,
    "database": None,
    "suppress_health_check": list(HealthCheck),
}
WRONG_TOKENS = [
    None,  # no Authorization header
    "Bearer wrong",
    "Bearer ",
    "Basic dXNlcjpwYXNz",
    "bearer {token}",  # the right token, the wrong scheme spelling
    "Bearer {token}x",
    "Bearer {token_prefix}",
]


def start(home: CorralHome, tmp_path: Path) -> str:
    """Start the daemon and one real service; return the service's name."""
    home.start_daemon()
    spec = write_spec(
        tmp_path / "web.yaml",
        textwrap.dedent(
            f"""\
            name: web
            workdir: {EXAMPLES}
            run: exec {sys.executable} app.py
            service:
              readiness_probe: {{path: /health, period_seconds: 0.5, initial_delay_seconds: 60}}
              replicas: 1
            """
        ),
    )
    home.run("up", str(spec), "--detach")
    home.wait_replicas("web", 1, timeout=60)
    return "web"


def load_schema(home: CorralHome) -> Any:
    answer = home.api("GET", "/v1/openapi.json")
    assert answer.status == 200, answer
    raw = answer.json()
    schema = schemathesis.openapi.from_dict(raw)
    return raw, schema


def defuse(case: Any) -> None:
    """Keep a generated request from running shell text or blocking on a followed log."""
    body = case.body
    if isinstance(body, dict) and isinstance(body.get("spec"), str):
        try:
            given_name = body.get("name")
            spec = parse_spec(
                body["spec"], name=given_name if isinstance(given_name, str) else None
            )
        except SpecError:
            pass
        else:
            # A valid spec: send one that runs something known and harmless, once (a generated
            # `replicas: 9000` must not start 9000 processes); the name is kept.
            safe: dict[str, Any] = {"run": "exec sleep 30", "service": {"replicas": 1}}
            if spec.name and "name" not in body:
                safe["name"] = spec.name
            body["spec"] = json.dumps(safe)
    if isinstance(case.query, dict) and "follow" in case.query:
        case.query["follow"] = "false"


class Run:
    """Counts what was sent, and what came back wrong."""

    def __init__(self, base_url: str, token: str) -> None:
        self.base_url = base_url
        self.token = token
        self.sent = 0
        self.by_operation: dict[str, int] = {}
        self.session = requests.Session()

    def call(self, case: Any, headers: dict[str, str]) -> Any:
        defuse(case)
        started = time.monotonic()
        response = case.call(
            base_url=self.base_url,
            session=self.session,
            headers=headers,
            timeout=REQUEST_TIMEOUT,
        )
        elapsed = time.monotonic() - started
        self.sent += 1
        label = case.operation.label
        self.by_operation[label] = self.by_operation.get(label, 0) + 1
        assert elapsed < REQUEST_TIMEOUT, f"{label} took {elapsed:.1f}s"
        return response

    def fuzz(
        self,
        operation: Any,
        mode: GenerationMode,
        examples: int,
        *,
        auth: str | None,
        path_parameters: dict[str, Any] | None = None,
    ) -> None:
        headers = {} if auth is None else {"Authorization": auth}
        strategy = operation.as_strategy(mode, path_parameters=path_parameters)

        @seed(BASE_SEED)
        @settings(max_examples=examples, **SETTINGS)
        @given(strategy)
        def one(case: Any) -> None:
            response = self.call(case, headers)
            if auth == f"Bearer {self.token}":
                # Negative data may be rejected with any 4xx the schema does not list (405 for
                # a body on a GET, ...): the checks that matter there are "no 5xx" and "JSON".
                checks = CHECKS if mode is GenerationMode.POSITIVE else [not_a_server_error]
                case.validate_response(response, checks=checks)
                if response.status_code == 400 and "json" in response.headers.get(
                    "Content-Type", ""
                ):
                    # A refused spec says where: every issue names a field or a line.
                    for issue in response.json().get("issues") or []:
                        assert issue["loc"] or issue["line"], issue
            elif operation.path == "/v1/health":
                assert response.status_code < 500, response.status_code
            else:
                assert response.status_code == 401, (
                    f"{case.operation.label} answered {response.status_code} to "
                    f"Authorization {auth!r}: {response.text[:300]}"
                )
                assert "error" in response.json()

        # Unsatisfiable: nothing to make negative (no parameters); the positive run covers it.
        with contextlib.suppress(Unsatisfiable):
            one()


def operations(schema: Any) -> list[Any]:
    found = []
    for result in schema.get_all_operations():
        found.append(result.ok())
    return found


def test_api_fuzz(corral_home: CorralHome, tmp_path: Path) -> None:
    name = start(corral_home, tmp_path)
    raw, schema = load_schema(corral_home)
    token = corral_home.token
    good = f"Bearer {token}"
    run = Run(corral_home.api_url, token)
    ops = operations(schema)
    labels = {op.label for op in ops}
    # The schema describes every route the daemon serves.
    assert {
        "GET /v1/health",
        "GET /v1/daemon",
        "GET /v1/openapi.json",
        "GET /metrics",
        "POST /v1/daemon/stop",
        "GET /v1/services",
        "POST /v1/services",
        "GET /v1/services/{name}",
        "DELETE /v1/services/{name}",
        "POST /v1/services/{name}/versions",
        "GET /v1/services/{name}/events",
        "GET /v1/services/{name}/logs",
        "DELETE /v1/services/{name}/replicas/{replica}",
    } <= labels, labels

    positive, negative, unauthorized = rounds(10, 80), rounds(6, 50), rounds(1, 6)
    # Destructive ones last: DELETE may take down only generated names until the very end.
    ops.sort(key=lambda op: op.method.upper() == "DELETE")
    for op in ops:
        for auth in WRONG_TOKENS:
            shown = None if auth is None else auth.format(token=token, token_prefix=token[:-1])
            run.fuzz(op, GenerationMode.POSITIVE, unauthorized, auth=shown)
        if op.label == "POST /v1/daemon/stop":
            continue  # authorized: tested once, below
        named = "{name}" in op.path
        run.fuzz(op, GenerationMode.POSITIVE, positive, auth=good)
        run.fuzz(op, GenerationMode.NEGATIVE, negative, auth=good)
        if named and op.method.upper() != "DELETE":
            # The same operation on the real service (generated names almost never exist, and
            # a 404 for the name hides what the other parameters would do).
            real = {"name": name}
            run.fuzz(op, GenerationMode.POSITIVE, positive, auth=good, path_parameters=real)
            run.fuzz(op, GenerationMode.NEGATIVE, negative, auth=good, path_parameters=real)
        assert corral_home.healthy(), f"the daemon stopped answering after {op.label}"

    # The real service went through all of that and still serves.
    service = corral_home.wait_replicas(name, 1, timeout=60, exact=False)
    assert service["status"] in ("READY", "REPLICA_INIT"), service

    # The destructive operations, once each, checked against the schema.
    delete = schema["/v1/services/{name}"]["DELETE"]
    case = delete.Case(path_parameters={"name": name}, query={"purge": True})
    response = run.call(case, {"Authorization": good})
    assert response.status_code == 202, response.text
    case.validate_response(response, checks=CHECKS)

    daemon_pid = corral_home.daemon_pid()
    stop = schema["/v1/daemon/stop"]["POST"]
    case = stop.Case()
    response = run.call(case, {"Authorization": good})
    assert response.status_code == 202, response.text
    case.validate_response(response, checks=CHECKS)
    wait_for(lambda: not pid_alive(daemon_pid), 30, "the daemon to exit after POST /daemon/stop")

    record(
        "API fuzz",
        rounds=run.sent,
        lost=0,  # a 5xx, a hang or a non-conforming answer fails the test instead
        operations=len(ops),
        requests_per_operation=run.by_operation,
        schema_paths=len(raw["paths"]),
    )


def test_unknown_routes_and_methods_are_json_4xx(corral_home: CorralHome) -> None:
    """What the schema does not list still gets a JSON 4xx, never a 5xx or an HTML page."""
    corral_home.start_daemon()
    base = corral_home.api_url
    token = corral_home.token
    for method, path in [
        ("GET", "/"),
        ("GET", "/v2/services"),
        ("PUT", "/v1/services"),
        ("PATCH", "/v1/services/web"),
        ("GET", "/v1/services/web/logs/../../token"),
        ("GET", "/v1/services/%2e%2e/%2e%2e/token"),
        ("GET", "/v1/daemon/stop"),
        ("TRACE", "/v1/health"),
    ]:
        answer = http(base + path, method=method, headers={"Authorization": f"Bearer {token}"})
        assert 400 <= answer.status < 500, (method, path, answer.status, answer.body[:200])
        assert "error" in json.loads(answer.body), (method, path, answer.body[:200])
        assert token.encode() not in answer.body
