"""The daemon's HTTP API (aiohttp), the only way the CLI talks to the daemon.

Every answer is JSON. A request the daemon refuses gets a 4xx with ``{"error": message, ...}``;
an unexpected failure gets a 500 with a short message (the traceback goes to the daemon's log,
never to the client). Every route but ``/v1/health`` needs ``Authorization: Bearer <token>``,
compared in constant time.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from corral import __version__, dashboard, logfiles, loglines
from corral.api_errors import RequestError, error_answer
from corral.balancer import CONTENT_TYPE_LATEST, render
from corral.daemon import Daemon
from corral.errors import NoSuchService
from corral.home import hello_proof, valid_nonce
from corral.httpbody import json_object
from corral.limits import open_files
from corral.state import StateError

log = logging.getLogger("corral.api")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

MAX_SPEC_BYTES = 1 << 20
LOG_CHUNK = 1 << 16
# The largest id, version or offset accepted: SQLite's INTEGER is 64-bit signed.
MAX_INT = (1 << 63) - 1


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, dumps=lambda o: json.dumps(o, default=str))


def _error(status: int, message: str, **details: Any) -> web.Response:
    return _json({"error": message, **details}, status=status)


# The only route answered without the token: clients poll it to learn whether a daemon runs.
OPEN_PATHS = frozenset({"/v1/health"})


def authorized(header: str, expected: bytes) -> bool:
    """Whether an ``Authorization`` header value is exactly ``expected``, in constant time.

    ``hmac.compare_digest`` takes as long for a near miss as for a wild one, so response times
    do not reveal how much of a guess was right. Bytes, not text: compare_digest refuses non-ASCII
    text, and aiohttp hands undecodable header bytes over as surrogates, which must give a 401,
    not a 500.
    """
    return hmac.compare_digest(header.encode("utf-8", "surrogateescape"), expected)


# A client has this long to send a whole request head, and again to send its body; the API's
# only clients are the CLI and tools on this machine, which send theirs at once.
# ``CORRAL_API_HEADER_TIMEOUT`` (seconds) in the daemon's environment overrides it (tests).
HEADER_TIMEOUT_SECONDS = 10.0


def _client_timeout() -> float:
    try:
        timeout = float(os.environ.get("CORRAL_API_HEADER_TIMEOUT", HEADER_TIMEOUT_SECONDS))
    except ValueError:
        return HEADER_TIMEOUT_SECONDS
    return timeout if 0 < timeout < 3600 else HEADER_TIMEOUT_SECONDS


def make_runner(daemon: Daemon, token: str) -> web.AppRunner:
    """The API's runner: the app, no access log, and a header timeout.

    aiohttp's keep-alive timer is the only header timeout it has (it closes a connection still
    waiting for a complete request that long after it opened or after the previous response);
    its default is an hour, so slowloris clients trickling header bytes could hold sockets,
    and the daemon's file descriptors, that long. A streamed answer (``logs --follow``) is not
    affected: the timer only runs while no request is being handled.
    """
    return web.AppRunner(
        make_app(daemon, token), access_log=None, keepalive_timeout=_client_timeout()
    )


# Set on a request once its answer has started streaming (see ``guard``).
STREAMING = "corral.streaming"


def make_app(daemon: Daemon, token: str) -> web.Application:
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        given = request.headers.get("Authorization", "")
        if (
            request.path not in OPEN_PATHS
            and not dashboard.own_auth(request.path)  # its session cookie, checked there
            and not authorized(given, expected)
        ):
            return _error(401, "missing or wrong API token (see $CORRAL_HOME/token)")
        try:
            return await handler(request)
        except ConnectionResetError:
            raise
        except Exception as exc:
            if request.get(STREAMING):
                # The answer's status and part of its body are sent: a second response would
                # be written into that body. Dropping the connection is the only honest end.
                log.warning(
                    "API %s %s failed while streaming: %r", request.method, request.path, exc
                )
                raise
            return error_answer(request, exc)

    app = web.Application(middlewares=[guard], client_max_size=MAX_SPEC_BYTES)
    routes = web.RouteTableDef()

    @routes.get("/v1/health")
    async def health(request: web.Request) -> web.Response:
        answer: dict[str, Any] = {"ok": True, "version": __version__}
        nonce = request.query.get("nonce", "")
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        if valid_nonce(nonce) and isinstance(sockname, tuple):
            # The CLI's question before it sends the token (see home.hello_proof).
            port = int(sockname[1])
            answer.update(proof=hello_proof(token, nonce, port), port=port, pid=os.getpid())
        return _json(answer)

    @routes.get("/v1/daemon")
    async def info(request: web.Request) -> web.Response:
        capacity = daemon.deps.capacity
        return _json(
            {
                "pid": os.getpid(),
                "home": str(daemon.home),
                "started_at": daemon.started_at,
                "services": len(daemon.controllers),
                "jobs": daemon.deps.pool.stats(),
                "balancer_workers": daemon.deps.dataplane.workers(),
                "open_files": open_files(),
                "confinement": daemon.confinement,
                "inventory": capacity.view() if capacity is not None else None,
            }
        )

    @routes.post("/v1/daemon/stop")
    async def stop(request: web.Request) -> web.Response:
        # ?all=1: the balancer workers stop too; without it they keep serving every service.
        everything = request.query.get("all", "") in ("1", "true", "yes")
        daemon.stop_workers = daemon.stop_workers or everything
        daemon.stop_requested.set()
        return _json({"stopping": True, "balancer_workers_stop": daemon.stop_workers}, status=202)

    @routes.post("/v1/daemon/restart-workers")
    async def restart_workers(request: web.Request) -> web.Response:
        # Each balancer worker replaced by a new process, new one first (an upgrade of corral
        # reaches the data plane this way, with no moment where a port has no listener).
        return _json({"restarted": await daemon.deps.dataplane.restart_workers()})

    @routes.get("/v1/services")
    async def list_services(request: web.Request) -> web.Response:
        return _json({"services": daemon.services()})

    @routes.post("/v1/services")
    async def create(request: web.Request) -> web.Response:
        body = await _body(request)
        spec = body.get("spec")
        if not isinstance(spec, str) or not spec.strip():
            raise RequestError(400, "field 'spec' (the service YAML as a string) is required")
        name = _optional_str(body, "name")
        source = _optional_str(body, "source")
        base_dir = _optional_str(body, "base_dir")
        service = await daemon.create(
            spec,
            name=name,
            source=source,
            base_dir=base_dir,
            envs=_optional_values(body, "envs"),
            secrets=_optional_values(body, "secrets"),
        )
        return _json(service, status=201)

    @routes.post("/v1/services/{name}/versions")
    async def update(request: web.Request) -> web.Response:
        body = await _body(request)
        spec = _optional_str(body, "spec")
        mode = _optional_str(body, "mode") or "rolling"
        from_version = body.get("from_version")
        if from_version is not None and (
            not isinstance(from_version, int)
            or isinstance(from_version, bool)
            or not 1 <= from_version <= MAX_INT
        ):
            raise RequestError(400, "field 'from_version' must be a version number (>= 1)")
        service = await daemon.update(
            request.match_info["name"],
            spec,
            mode=mode,
            source=_optional_str(body, "source"),
            base_dir=_optional_str(body, "base_dir"),
            from_version=from_version,
            envs=_optional_values(body, "envs"),
            secrets=_optional_values(body, "secrets"),
        )
        return _json(service, status=201)

    @routes.get("/v1/services/{name}")
    async def get_service(request: web.Request) -> web.Response:
        controller = daemon.controller(request.match_info["name"])
        try:
            return _json(controller.snapshot())
        except KeyError:  # its row is gone: the service finished `down` a moment ago
            raise NoSuchService(f"no service named {controller.name!r}") from None

    @routes.delete("/v1/services/{name}")
    async def down(request: web.Request) -> web.Response:
        purge = _flag(request, "purge")
        return _json(daemon.down(request.match_info["name"], purge=purge), status=202)

    @routes.delete("/v1/services/{name}/replicas/{replica}")
    async def terminate_replica(request: web.Request) -> web.Response:
        # SkyServe's `down --replica-id`: the replica goes and (target unchanged) is replaced.
        replica = request.match_info["replica"]
        if not (replica.isascii() and replica.isdigit()) or len(replica) > 18:
            raise RequestError(400, f"replica id must be a whole number, got {replica[:40]!r}")
        name = request.match_info["name"]
        message = daemon.terminate_replica(name, int(replica), purge=_flag(request, "purge"))
        return _json({"message": message}, status=202)

    @routes.get("/v1/services/{name}/events")
    async def events(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        daemon.controller(name)
        after = _int_param(request, "after", 0)
        rows = daemon.store.events(name, after=after)
        # ``replica``: the id status shows (replica_id is the internal one).
        seqs = {r.id: r.seq for r in daemon.store.replicas(name)}
        return _json(
            {"events": [{**r.__dict__, "replica": seqs.get(r.replica_id or 0)} for r in rows]}
        )

    @routes.get("/v1/services/{name}/logs")
    async def logs(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        kind = request.query.get("kind", "replica")
        replica = request.query.get("replica")
        follow = _flag(request, "follow")
        tail = _int_param(request, "tail", 0) if "tail" in request.query else None
        if kind == "load_balancer":
            daemon.controller(name)
            return await _balancer_log(request, daemon, name, follow=follow, tail=tail)
        replica_id = None
        if replica is not None:
            # The id users see (its number within the service), mapped to the internal one.
            replica_id = daemon.replica_uid(name, _int_param(request, "replica", 0))
        path = daemon.log_path(name, kind, replica_id)
        offset = _int_param(request, "offset", 0)
        if tail is not None:
            offset = await asyncio.to_thread(loglines.tail_offset, path, tail)
        if not path.exists() and not follow:
            raise RequestError(
                404,
                f"no {kind} log yet for service {name!r}"
                + (f" replica {replica_id}" if replica_id is not None else ""),
            )
        response = web.StreamResponse(headers={"Content-Type": "text/plain; charset=utf-8"})
        request[STREAMING] = True
        await response.prepare(request)
        position = offset
        reached = 0  # where this follower got to by reading (0: nowhere yet)
        last = b""  # the last byte sent
        mark = await asyncio.to_thread(logfiles.rotation_mark, path) if follow else None
        while True:
            # Decided before reading: what the writer wrote before it finished is still sent.
            try:
                done = not follow or _finished(daemon, name, kind, replica_id)
            except StateError:
                done = False  # the state file is busy: keep following, ask again next time
            chunk = await asyncio.to_thread(_read_from, path, position)
            if follow:
                rotated, mark = await asyncio.to_thread(_rotated, path, mark, reached)
                if rotated:
                    # The log was emptied (corral.logfiles moved it to .1) and its writer goes
                    # on at 0: so does the follower. A chunk read across that may belong to
                    # either generation, so it is dropped (it is in .1 if it was old). A line
                    # cut short by that is ended, so the next one starts on a line of its own.
                    if last not in (b"", b"\n"):
                        await response.write(b"\n")
                        last = b"\n"
                    position = reached = 0
                    continue
            if chunk:
                position += len(chunk)
                reached, last = position, chunk[-1:]
                await response.write(chunk)
                continue
            if done:
                break
            await asyncio.sleep(0.2)
        await response.write_eof()
        return response

    @routes.get("/metrics")
    async def metrics(request: web.Request) -> web.Response:
        """Prometheus exposition of every service's balancer (requests, errors, latency,
        in-flight per replica, retries), summed over the balancer workers' latest reports."""
        body = render(daemon.deps.dataplane.stats())
        if daemon.deps.capacity is not None:  # corral_gpu_held / corral_gpu_free per device
            body += daemon.deps.capacity.metrics()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    @routes.get("/v1/openapi.json")
    async def openapi(request: web.Request) -> web.Response:
        return _json(OPENAPI)

    app.add_routes(routes)
    dashboard.install(app, daemon, token)  # /ui and POST /v1/dashboard/login

    async def not_found(request: web.Request) -> web.Response:
        return _error(404, f"no route {request.method} {request.path}")

    app.router.add_route("*", "/{tail:.*}", not_found)
    return app


async def _balancer_log(
    request: web.Request, daemon: Daemon, name: str, *, follow: bool, tail: int | None
) -> web.StreamResponse:
    """The lines of the balancer workers' logs about service ``name`` (see corral.loglines),
    the last ``tail`` of them first, then, with ``follow``, new ones until the service goes."""
    response = web.StreamResponse(headers={"Content-Type": "text/plain; charset=utf-8"})
    request[STREAMING] = True
    await response.prepare(request)
    positions: dict[Any, int] = {}
    first = True
    while True:
        lines, positions = await asyncio.to_thread(
            loglines.balancer_lines, daemon.home, name, positions
        )
        if first and tail is not None:
            lines = lines[-tail:] if tail else []
        first = False
        if lines:
            await response.write(b"".join(lines))
        if not follow or name not in daemon.controllers:
            break
        await asyncio.sleep(0.5)
    await response.write_eof()
    return response


def _read_from(path: Any, position: int) -> bytes:
    try:
        with open(path, "rb") as f:
            # Past the end there is nothing yet; seek itself fails on offsets beyond what the
            # file system allows (EINVAL), after the 200 went out (found by fuzzing).
            if position >= os.fstat(f.fileno()).st_size:
                return b""
            f.seek(position)
            return f.read(LOG_CHUNK)
    except FileNotFoundError:
        return b""


def _rotated(
    path: Any, mark: logfiles.RotationMark, reached: int
) -> tuple[bool, logfiles.RotationMark]:
    """Was the followed log rotated since ``mark`` (a new ``.1``), or emptied some other way
    (now shorter than what the follower read)? And the mark to compare with next time."""
    now = logfiles.rotation_mark(path)
    if now != mark:
        return True, now
    try:
        return os.stat(path).st_size < reached, now
    except OSError:
        return False, now


def _finished(daemon: Daemon, name: str, kind: str, replica_id: int | None) -> bool:
    """A followed log ends when what writes it is gone: the service, or the replica (removed,
    or torn down: a failed replica stays listed but nothing writes its logs any more)."""
    if name not in daemon.controllers:
        return True
    if replica_id is None:
        return False
    row = daemon.store.replica(replica_id)
    return row is None or row.service != name or row.teardown_state == "succeeded"


async def _body(request: web.Request) -> dict[str, Any]:
    return await json_object(request, _client_timeout())


def _optional_values(body: dict[str, Any], key: str) -> dict[str, str]:
    """A mapping of environment variable names to values (``envs``, ``secrets``), or {}."""
    value = body.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise RequestError(400, f"field {key!r} must map names to strings")
    for name, text in value.items():
        if "\0" in name or "\0" in text or not name.isascii():
            raise RequestError(400, f"field {key!r}: names and values cannot hold NUL")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError(400, f"field {key!r}: values must be valid text") from None
    return dict(value)


def _optional_str(body: dict[str, Any], key: str) -> str | None:
    """A text field of a request body, or None.

    The text must be storable and usable as a path: JSON's ``"\\ud800"`` decodes to a lone
    surrogate that SQLite cannot encode (a 500, found by fuzzing), and a NUL cannot be in a
    path or an argument.
    """
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise RequestError(400, f"field {key!r} must be a string")
    if "\0" in value:
        raise RequestError(400, f"field {key!r} must not contain a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(400, f"field {key!r} is not valid Unicode text") from None
    return value


def _flag(request: web.Request, key: str) -> bool:
    value = request.query.get(key, "0").lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no", ""):
        return False
    raise RequestError(400, f"query parameter {key!r} must be true or false, got {value!r}")


def _int_param(request: web.Request, key: str, default: int) -> int:
    """A non-negative integer query parameter that SQLite and ``seek`` can take.

    ASCII digits only: ``int()`` also reads "\\u0661" (an Arabic-Indic one), "1_0" and " 1 ", which
    no client means. At most 2**63 - 1: ids and offsets beyond it made SQLite raise
    OverflowError, a 500 (found by fuzzing).
    """
    value = request.query.get(key)
    if value is None:
        return default
    if not (value.isascii() and value.isdigit()):
        shown = value if len(value) <= 40 else value[:37] + "..."
        raise RequestError(
            400, f"query parameter {key!r} must be a whole number >= 0, got {shown!r}"
        )
    if len(value) > 19 or int(value) > MAX_INT:
        raise RequestError(400, f"query parameter {key!r} must be at most {MAX_INT}")
    return int(value)


_ERROR = {"$ref": "#/components/schemas/Error"}
_COUNT = {"type": "integer", "minimum": 0, "maximum": MAX_INT}
_SERVICE = {"$ref": "#/components/schemas/Service"}
# --env / --secret values; never echoed back by any route.
_VALUES = {"type": "object", "additionalProperties": {"type": "string"}}
_NAME = {
    "name": "name",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": "^[a-z]([a-z0-9-]{0,61}[a-z0-9])?$"},
}


def _answers(ok: dict[str, Any], *errors: int) -> dict[str, Any]:
    """``ok`` plus the JSON errors a route may answer: 401 (no or wrong token) and 503 (the
    state file is locked or unwritable) on every route behind the token, and ``errors``."""
    out: dict[str, Any] = dict(ok)
    for status in (401, *errors, 503):
        out[str(status)] = {
            "description": "refused",
            "content": {"application/json": {"schema": _ERROR}},
        }
    return out


def _ok(status: int, schema: dict[str, Any], description: str = "ok") -> dict[str, Any]:
    return {
        str(status): {
            "description": description,
            "content": {"application/json": {"schema": schema}},
        }
    }


OPENAPI: dict[str, Any] = {
    "openapi": "3.0.3",
    "info": {"title": "corral daemon API", "version": __version__},
    "components": {
        "securitySchemes": {"token": {"type": "http", "scheme": "bearer"}},
        "schemas": {
            "Error": {
                "type": "object",
                "required": ["error"],
                "properties": {"error": {"type": "string"}},
            },
            "Replica": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "description": "number within the service"},
                    "uid": {"type": "integer", "description": "internal id (events)"},
                    "version": {"type": "integer"},
                    "status": {"type": "string"},
                    "starting_seconds": {"type": "number"},
                    "initial_delay_seconds": {"type": "number"},
                    "endpoint": {"type": "string", "nullable": True},
                    "infra": {"type": "string"},
                    "age_seconds": {"type": "number"},
                    "failure": {"type": "string", "nullable": True},
                    "exit_code": {"type": "integer", "nullable": True},
                    "pid": {"type": "integer", "nullable": True},
                    # What it holds on this machine (docs/gpus.md): gpus, cpus, cpu_ids, memory.
                    "devices": {"type": "object", "nullable": True},
                    # Why a PENDING replica waits (it does not fit now), else null.
                    "waiting": {"type": "string", "nullable": True},
                },
            },
            "Service": {
                "type": "object",
                "required": ["name", "status", "replicas"],
                "properties": {
                    "name": {"type": "string"},
                    "status": {"type": "string"},
                    "endpoint": {"type": "string", "nullable": True},
                    "version": {"type": "integer"},
                    "target": {"type": "integer"},
                    "failure": {"type": "string", "nullable": True},
                    "last_update_failure": {"type": "string", "nullable": True},
                    "traffic_versions": {"type": "array", "items": {"type": "integer"}},
                    "last_decision": {"type": "string"},
                    "replicas": {
                        "type": "array",
                        "items": {"$ref": "#/components/schemas/Replica"},
                    },
                },
            },
        },
    },
    "security": [{"token": []}],
    "paths": {
        "/v1/health": {
            "get": {
                "security": [],
                "parameters": [
                    {
                        "name": "nonce",
                        "in": "query",
                        "required": False,
                        "description": "hex, 16-128 characters: the answer then proves the "
                        "daemon holds the token (HMAC-SHA256 bound to the port)",
                        "schema": {"type": "string"},
                    }
                ],
                "responses": _ok(200, {"type": "object"}),
            }
        },
        "/v1/daemon": {"get": {"responses": _answers(_ok(200, {"type": "object"}))}},
        "/v1/openapi.json": {"get": {"responses": _answers(_ok(200, {"type": "object"}))}},
        "/metrics": {
            "get": {
                "responses": _answers(
                    {
                        "200": {
                            "description": "Prometheus text format",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    }
                )
            }
        },
        "/v1/daemon/stop": {
            "post": {
                "parameters": [
                    {
                        "name": "all",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "string", "enum": ["0", "1"]},
                    }
                ],
                "responses": _answers(_ok(202, {"type": "object"})),
            }
        },
        "/v1/daemon/restart-workers": {
            "post": {"responses": _answers(_ok(200, {"type": "object"}))}
        },
        "/v1/services": {
            "get": {
                "responses": _answers(
                    _ok(
                        200,
                        {
                            "type": "object",
                            "properties": {"services": {"type": "array", "items": _SERVICE}},
                        },
                    )
                )
            },
            "post": {
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "required": ["spec"],
                                "properties": {
                                    "spec": {"type": "string", "description": "service YAML"},
                                    "name": {"type": "string"},
                                    "source": {"type": "string"},
                                    "base_dir": {"type": "string"},
                                    "envs": _VALUES,
                                    "secrets": _VALUES,
                                },
                            }
                        }
                    },
                },
                "responses": _answers(_ok(201, _SERVICE, "created"), 400, 408, 409, 413),
            },
        },
        "/v1/services/{name}": {
            "get": {"parameters": [_NAME], "responses": _answers(_ok(200, _SERVICE), 400, 404)},
            "delete": {
                "parameters": [
                    _NAME,
                    {"name": "purge", "in": "query", "schema": {"type": "boolean"}},
                ],
                "responses": _answers(_ok(202, _SERVICE, "shutting down"), 400, 404),
            },
        },
        "/v1/services/{name}/versions": {
            "post": {
                "parameters": [_NAME],
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "properties": {
                                    "spec": {"type": "string", "description": "service YAML"},
                                    "mode": {"type": "string", "enum": ["rolling", "blue_green"]},
                                    "from_version": {
                                        "type": "integer",
                                        "minimum": 1,
                                        "maximum": MAX_INT,
                                    },
                                    "source": {"type": "string"},
                                    "base_dir": {"type": "string"},
                                    "envs": _VALUES,
                                    "secrets": _VALUES,
                                },
                            }
                        }
                    },
                },
                "responses": _answers(
                    _ok(201, _SERVICE, "new version rolling out"), 400, 404, 408, 409, 413
                ),
            }
        },
        "/v1/services/{name}/replicas/{replica}": {
            "delete": {
                "parameters": [
                    _NAME,
                    {"name": "replica", "in": "path", "required": True, "schema": _COUNT},
                    {"name": "purge", "in": "query", "schema": {"type": "boolean"}},
                ],
                "responses": _answers(_ok(202, {"type": "object"}, "shutting down"), 400, 404, 409),
            }
        },
        "/v1/services/{name}/events": {
            "get": {
                "parameters": [
                    _NAME,
                    {"name": "after", "in": "query", "schema": _COUNT},
                ],
                "responses": _answers(_ok(200, {"type": "object"}), 400, 404),
            }
        },
        "/v1/services/{name}/logs": {
            "get": {
                "parameters": [
                    _NAME,
                    {
                        "name": "kind",
                        "in": "query",
                        "schema": {
                            "type": "string",
                            "enum": ["replica", "launch", "controller", "load_balancer"],
                        },
                    },
                    {"name": "replica", "in": "query", "schema": _COUNT},
                    {"name": "tail", "in": "query", "schema": _COUNT},
                    {"name": "offset", "in": "query", "schema": _COUNT},
                    {"name": "follow", "in": "query", "schema": {"type": "boolean"}},
                ],
                "responses": _answers(
                    {
                        "200": {
                            "description": "log text",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                    400,
                    404,
                ),
            }
        },
    },
}
