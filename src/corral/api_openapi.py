"""The API's OpenAPI document, served at ``/v1/openapi.json``.

Why a module of its own: it is data, a third of the API's text, and changes with the routes'
shapes only; the security tests walk its paths to try every route without a token.
"""

from __future__ import annotations

from typing import Any

from corral import __version__
from corral.api_input import MAX_INT

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
                    "uid": {"type": "integer", "description": "internal key (not shown elsewhere)"},
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
                    # FAILED_CLEANUP only: teardowns tried so far, and when the next comes.
                    "teardown_attempts": {"type": "integer"},
                    "teardown_retry_in_seconds": {"type": "number"},
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
                    # While relaunches wait out their backoff (else null): next_attempt_at
                    # (epoch seconds), next_attempt_in_seconds, reason.
                    "backoff": {"type": "object", "nullable": True},
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
