"""The daemon's HTTP API (aiohttp), the only way the CLI talks to the daemon.

Every answer is JSON. A request the daemon refuses gets a 4xx with ``{"error": message, ...}``;
an unexpected failure gets a 500 with a short message (the traceback goes to the daemon's log,
never to the client). Every route but ``/v1/health`` needs ``Authorization: Bearer <token>``,
compared in constant time.

This module is the app and its guard; the routes are corral.api_routes (the followed logs
corral.api_logs), reading a request is corral.api_input, and corral.api_errors is the one place
where a refusal becomes a status. The layers point one way: bootstrap -> api -> daemon.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from corral import dashboard
from corral.api_errors import STREAMING, error, error_answer
from corral.api_input import client_timeout
from corral.api_openapi import OPENAPI
from corral.api_routes import Routes
from corral.daemon import Daemon

__all__ = ["OPENAPI", "OPEN_PATHS", "authorized", "make_app", "make_runner"]

log = logging.getLogger("corral.api")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

MAX_SPEC_BYTES = 1 << 20

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


class _MalformedRequests(logging.Filter):
    """aiohttp answers a request it cannot parse (an encoding it cannot decode, a URL past
    8190 bytes, broken framing) with a 400 itself, and logs it at ERROR with a traceback:
    anyone who can reach the port could fill the daemon's log with them, and each reads as a
    fault of the daemon. This makes each one line, at INFO, saying what was wrong."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg, record.args = "a malformed request answered %d: %s", (exc.code, exc.message)
            record.exc_info = record.exc_text = None
        return True


_MALFORMED = _MalformedRequests()


def make_runner(daemon: Daemon, token: str) -> web.AppRunner:
    """The API's runner: the app, no access log, and a header timeout.

    aiohttp's keep-alive timer is the only header timeout it has (it closes a connection still
    waiting for a complete request that long after it opened or after the previous response);
    its default is an hour, so slowloris clients trickling header bytes could hold sockets,
    and the daemon's file descriptors, that long. A streamed answer (``logs --follow``) is not
    affected: the timer only runs while no request is being handled.
    """
    logging.getLogger("aiohttp.server").addFilter(_MALFORMED)  # once: the same object
    return web.AppRunner(
        make_app(daemon, token), access_log=None, keepalive_timeout=client_timeout()
    )


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
            return error(401, "missing or wrong API token (see $CORRAL_HOME/token)")
        streaming = STREAMING.set(False)
        try:
            return await handler(request)
        except ConnectionResetError:
            raise
        except Exception as exc:
            if STREAMING.get():
                # The answer's status and part of its body are sent: a second response would
                # be written into that body. Dropping the connection is the only honest end.
                log.warning(
                    "API %s %s failed while streaming: %r", request.method, request.path, exc
                )
                raise
            return error_answer(request, exc)
        finally:
            STREAMING.reset(streaming)

    async def started(request: web.Request, response: web.StreamResponse) -> None:
        STREAMING.set(True)  # a handler's own prepare(), within the guard (see STREAMING)

    app = web.Application(middlewares=[guard], client_max_size=MAX_SPEC_BYTES)
    app.on_response_prepare.append(started)
    app.add_routes(Routes(daemon, token).table())
    dashboard.install(app, daemon, token)  # /ui and POST /v1/dashboard/login
    app.router.add_route("*", "/{tail:.*}", _not_found)
    return app


async def _not_found(request: web.Request) -> web.Response:
    return error(404, f"no route {request.method} {request.path}")
