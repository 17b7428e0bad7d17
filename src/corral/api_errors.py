"""How a refusal becomes an HTTP answer: the one place that knows statuses.

Two kinds reach here. Domain errors (corral.errors) come from the operations, which know no
HTTP; :data:`STATUS` gives each its status. :class:`RequestError` is the HTTP layer's own, for a
request it cannot even read (a body that is not JSON, a query parameter that is not a number,
the dashboard's session checks): there the status is the meaning. Every answer is JSON
``{"error": message, ...details}``; only what nobody foresaw is a 500, whose details go to the
daemon's log and never to the client.
"""

from __future__ import annotations

import json
import logging
from contextvars import ContextVar
from typing import Any, Final

from aiohttp import web

from corral.errors import Conflict, HomeUnwritable, InvalidRequest, NotFound, Refused
from corral.state import StateError

log = logging.getLogger("corral.api")

# The most specific class of a domain error found here gives its status (see status_of).
STATUS: Final[dict[type[Refused], int]] = {
    InvalidRequest: 400,
    NotFound: 404,
    Conflict: 409,
    HomeUnwritable: 503,
}


# True once the current request's answer has gone out in part (its headers: a StreamResponse
# prepared by the handler): an error after that cannot become an answer of its own. corral.api's
# guard sets it to False for each request and its on_response_prepare hook to True, for every
# streaming route at once (the logs, the dashboard's feeds). A context variable, not a key on
# the request: aiohttp warns on a str key there, and its typed request keys need aiohttp 3.14.
# The guard, the handler and the hook run in one task, so one context.
STREAMING: ContextVar[bool] = ContextVar("corral_api_streaming", default=False)


class RequestError(Exception):
    """A request the HTTP layer refuses before any operation runs: its status and a message."""

    def __init__(self, status: int, message: str, **details: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.details = details


def status_of(exc: Refused) -> int:
    for kind in type(exc).__mro__:
        if kind in STATUS:
            return STATUS[kind]
    return 400  # a kind nobody mapped yet (tests/test_api_refusals.py catches that)


def json_answer(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, dumps=lambda o: json.dumps(o, default=str))


def error(status: int, message: str, **details: Any) -> web.Response:
    return json_answer({"error": message, **details}, status=status)


def error_answer(request: web.Request, exc: Exception) -> web.StreamResponse:
    """The answer to a request whose handler raised ``exc``: 4xx/503 with a message, and a 500
    (details in the daemon log, never in the answer) only for what nobody foresaw."""
    if isinstance(exc, Refused):
        return error(status_of(exc), exc.message, **exc.details)
    if isinstance(exc, RequestError):
        return error(exc.status, exc.message, **exc.details)
    if isinstance(exc, StateError):
        # The state file is locked by another process or unwritable: nothing was changed,
        # the daemon and its balancers keep running, and the client may retry (not a 500).
        log.warning("API %s %s: %s", request.method, request.path, exc)
        return error(503, str(exc))
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            raise exc
        return error(exc.status, exc.reason)
    log.error("API %s %s failed", request.method, request.path, exc_info=exc)
    return error(500, "internal error; the daemon log has the details")
