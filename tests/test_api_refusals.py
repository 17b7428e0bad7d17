"""Every refusal of the daemon's operations reaches a client as the same status and JSON body.

Why pinned word for word: the CLI prints these messages and branches on these statuses, and the
operations raise domain errors that the API alone turns into statuses (corral.errors ->
corral.api_errors): a change in that mapping must show up here, not in a user's terminal.
"""

from __future__ import annotations

from typing import Any

from conftest import CorralHome, spec_text

from corral import errors
from corral.api_errors import STATUS, status_of
from corral.errors import Refused


def _refusals(home: CorralHome) -> list[tuple[str, str, Any, int, dict[str, Any]]]:
    versions = "/v1/services/pinned/versions"
    return [
        (
            "POST",
            "/v1/services",
            {"name": "x"},
            400,
            {"error": "field 'spec' (the service YAML as a string) is required"},
        ),
        (
            "POST",
            "/v1/services",
            {"spec": spec_text("pinned", 1)},
            409,
            {"error": "service 'pinned' already exists"},
        ),
        (
            "POST",
            "/v1/services",
            {"spec": "run: sleep 100\n"},
            400,
            {"error": "the service needs a name: set `name:` in the spec or pass -n"},
        ),
        (
            "POST",
            "/v1/services",
            {"spec": spec_text("elsewhere", 1, extra="infra: ray\n")},
            400,
            {
                "error": "infra 'ray' is not available in this daemon (available: local): start "
                "the daemon with RAY_ADDRESS in its environment and Ray installed "
                "(docs/troubleshooting.md)"
            },
        ),
        (
            "POST",
            versions,
            {"spec": spec_text("pinned", 2), "mode": "sideways"},
            400,
            {"error": "mode must be rolling or blue_green, not 'sideways'"},
        ),
        (
            "POST",
            versions,
            {"spec": spec_text("pinned", 2), "from_version": 1},
            400,
            {"error": "give either a spec or a version to roll back to, not both"},
        ),
        (
            "POST",
            versions,
            {"from_version": 99},
            404,
            {"error": "service 'pinned' has no version 99"},
        ),
        (
            "POST",
            versions,
            {"from_version": 1, "envs": {"A": "b"}},
            400,
            {"error": "a rollback reuses the version's values: no envs/secrets"},
        ),
        (
            "POST",
            versions,
            {},
            400,
            {"error": "field 'spec' (the service YAML) or 'from_version' is required"},
        ),
        (
            "POST",
            versions,
            {"from_version": 0},
            400,
            {"error": "field 'from_version' must be a version number (>= 1)"},
        ),
        (
            "POST",
            "/v1/services/absent/versions",
            {"from_version": 1},
            404,
            {"error": "no service named 'absent'"},
        ),
        ("GET", "/v1/services/absent", None, 404, {"error": "no service named 'absent'"}),
        (
            "DELETE",
            "/v1/services/pinned/replicas/99",
            None,
            404,
            {"error": "service 'pinned' has no replica 99"},
        ),
        (
            "GET",
            "/v1/services/pinned/logs?replica=99",
            None,
            404,
            {"error": "service 'pinned' has no replica 99"},
        ),
        (
            "GET",
            "/v1/services/pinned/logs?kind=launch",
            None,
            400,
            {"error": "log kind 'launch' needs a replica id"},
        ),
        (
            "GET",
            "/v1/services/pinned/logs?kind=weird&replica=1",
            None,
            400,
            {"error": "unknown log kind 'weird': use replica, launch or controller"},
        ),
        (
            "GET",
            "/v1/services/pinned/events?after=x",
            None,
            400,
            {"error": "query parameter 'after' must be a whole number >= 0, got 'x'"},
        ),
        (
            "DELETE",
            "/v1/services/pinned?purge=maybe",
            None,
            400,
            {"error": "query parameter 'purge' must be true or false, got 'maybe'"},
        ),
        (
            # Taken from the daemon's own working directory before (`workdir: .` copied it).
            "POST",
            "/v1/services",
            {"spec": spec_text("rel", 1), "base_dir": "relative/dir"},
            400,
            {"error": "field 'base_dir' must be an absolute path, not 'relative/dir'"},
        ),
        (
            "POST",
            "/v1/services/pinned/versions",
            {"spec": spec_text("pinned", 1), "base_dir": "."},
            400,
            {"error": "field 'base_dir' must be an absolute path, not '.'"},
        ),
        (
            # Read as "no" before: the daemon stopped, keeping the workers it was maybe asked
            # to stop. Last, since a wrong answer here stops the daemon.
            "POST",
            "/v1/daemon/stop?all=maybe",
            None,
            400,
            {"error": "query parameter 'all' must be true or false, got 'maybe'"},
        ),
    ]


def test_refusals_keep_their_status_and_body(corral_home: CorralHome) -> None:
    corral_home.start_daemon()
    created = corral_home.api("POST", "/v1/services", body={"spec": spec_text("pinned", 1)})
    assert created.status == 201, created
    for method, path, body, status, expected in _refusals(corral_home):
        answer = corral_home.api(method, path, body=body)
        assert (answer.status, answer.json()) == (status, expected), (method, path, body)

    bad_name = corral_home.api("GET", "/v1/services/NOPE")
    assert bad_name.status == 400
    assert bad_name.json()["error"].startswith("bad service name 'NOPE': ")
    typo = corral_home.api("POST", "/v1/services", body={"spec": "name: typo\nrun: x\nrnu: y\n"})
    assert typo.status == 400
    assert typo.json()["error"] == "invalid service spec"
    assert [i["loc"] for i in typo.json()["issues"]] == ["rnu"]
    assert "rnu" in typo.json()["text"]


def test_every_domain_error_has_one_status() -> None:
    """A new kind of refusal cannot reach a client as a 500: each maps to a 4xx or a 503."""

    def kinds(cls: type[Refused]) -> list[type[Refused]]:
        return [cls] + [k for sub in cls.__subclasses__() for k in kinds(sub)]

    for kind in kinds(Refused):
        if kind is Refused:
            continue
        statuses = [STATUS[k] for k in kind.__mro__ if k in STATUS]
        assert statuses, f"{kind.__name__} maps to no status"
        assert statuses[0] in (400, 404, 409, 503), kind


def test_each_refusal_keeps_the_status_clients_know() -> None:
    """Pinned kind by kind: a 503 says "retry later", a 409 "not now", a 404 "not there"."""
    expected = {
        errors.InvalidRequest: 400,
        errors.BadSpec: 400,
        errors.Unrunnable: 400,
        errors.NoSuchService: 404,
        errors.NoSuchVersion: 404,
        errors.NoSuchReplica: 404,
        errors.ServiceExists: 409,
        errors.ServiceShuttingDown: 409,
        errors.ReplicaBusy: 409,
        errors.NoRoom: 409,
        errors.VersionFilesGone: 409,
        errors.HomeUnwritable: 503,
    }
    assert {kind: status_of(kind("why")) for kind in expected} == expected


def test_a_request_aiohttp_cannot_parse_is_one_line_in_the_log(corral_home: CorralHome) -> None:
    """A body in an encoding aiohttp cannot decode, or a URL over 8190 bytes: aiohttp answers
    400 itself and logged each at ERROR with a traceback, so a local client could fill the
    daemon's log with tracebacks. Each is now one INFO line saying what was wrong."""
    from test_dashboard import port_of, request

    corral_home.start_daemon()
    port = port_of(corral_home)
    log = corral_home.path / "daemon.log"
    before = log.read_text()
    brotli = {"Content-Encoding": "br", "Content-Type": "application/json"}
    assert request(port, "POST", "/v1/services", headers=brotli, body=b"x")[0] == 400
    assert request(port, "GET", "/v1/health?" + "a" * 9000)[0] == 400
    assert request(port, "GET", "/v1/health")[0] == 200  # and the daemon serves on
    added = log.read_text()[len(before) :]
    assert "Traceback" not in added and "ERROR" not in added, added
    assert added.count("a malformed request answered 400") == 2, added
