"""The dashboard's routes under ``/ui``, served by the API's own app (same address, same TLS).

Who gets in (see :mod:`corral.dashboard.session`): the pages and every ``/ui/api`` route need a
session cookie; without one a page sends the browser to the login page and a data route
answers 401. Only the static files (code and styles, no data) and the login page are open.

Actions change services, so a request must also prove it comes from the dashboard's own page:
the cookie is ``SameSite=Strict`` (no other site's request carries it), the request must carry
the ``X-Corral-UI: 1`` header (a cross-site form cannot set a header, and a cross-site script
cannot without a CORS preflight that this server never grants), and a browser's ``Origin``, when
sent, must be this server. Every answer under ``/ui`` gets a strict Content-Security-Policy
(scripts and styles from this server only, no framing) and ``Referrer-Policy: same-origin``,
so a one-time login link never leaves in a Referer header (``no-referrer`` would also make
Chromium send ``Origin: null`` with the login form, which the origin check then refuses).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any, Final

from aiohttp import web

from corral.api_errors import RequestError
from corral.dashboard import PREFIX, actions, own_auth, pages
from corral.dashboard.feed import Feed
from corral.dashboard.history import KEEP_SECONDS, SAMPLE_SECONDS
from corral.dashboard.logs import Followers
from corral.dashboard.resources import Usage
from corral.dashboard.session import CODE_SECONDS, SESSIONS_FILE, Sessions, cookie_name
from corral.httpbody import json_object
from corral.spec import MAX_REPLICAS

if TYPE_CHECKING:
    from corral.daemon import Daemon

UI_HEADER: Final = "X-Corral-UI"
BODY_TIMEOUT: Final = 10.0
MAX_ID: Final = (1 << 63) - 1

SECURITY_HEADERS: Final = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; form-action 'self'; "
    "base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
}


async def secure_headers(request: web.Request, response: web.StreamResponse) -> None:
    if not own_auth(request.path):
        return
    for key, value in SECURITY_HEADERS.items():
        response.headers.setdefault(key, value)
    cache = "no-cache" if request.path.startswith(PREFIX + "/static/") else "no-store"
    response.headers.setdefault("Cache-Control", cache)


def _html(text: str, status: int = 200) -> web.Response:
    return web.Response(text=text, status=status, content_type="text/html", charset="utf-8")


def _replica_id(value: str) -> int:
    if not (value.isascii() and value.isdigit()) or len(value) > 19 or int(value) > MAX_ID:
        raise RequestError(400, f"replica must be a whole number >= 0, got {value[:40]!r}")
    return int(value)


class Dashboard:
    """The dashboard of one daemon: sessions, the shared state feed, followed logs."""

    def __init__(self, daemon: Daemon, token: str) -> None:
        self.daemon = daemon
        self.sessions = Sessions(token, path=daemon.home / SESSIONS_FILE)
        self.feed = Feed(daemon)
        self.followers = Followers()
        self.usage = Usage()
        self.static = pages.load_static()

    async def on_startup(self, app: web.Application) -> None:
        self.feed.start()

    async def on_shutdown(self, app: web.Application) -> None:
        # Before aiohttp waits for open requests: the streams end now, not after its timeout.
        self.followers.closed.set()
        await self.feed.stop()
        self.sessions.save()  # "last seen" as of now, for the next daemon of this home

    # -- who is asking ------------------------------------------------------------------------

    def _cookie(self, request: web.Request) -> str:
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        return cookie_name(int(sockname[1]) if isinstance(sockname, tuple) else None)

    def signed_in(self, request: web.Request) -> bool:
        return self.sessions.valid(request.cookies.get(self._cookie(request)))

    def _need_session(self, request: web.Request) -> None:
        if not self.signed_in(request):
            raise RequestError(
                401, "not signed in to the dashboard: open the link `corral dashboard` prints"
            )

    def _need_action(self, request: web.Request) -> None:
        self._need_session(request)
        if request.headers.get(UI_HEADER) != "1" or not _same_origin(request):
            raise RequestError(
                403,
                f"dashboard actions come from the dashboard's page only ({UI_HEADER} header, "
                "same origin)",
            )

    # -- login --------------------------------------------------------------------------------

    async def login_code(self, request: web.Request) -> web.Response:
        """For ``corral dashboard`` (behind the API token): a one-time login link."""
        code = self.sessions.new_code()
        return web.json_response(
            {"code": code, "path": f"{PREFIX}/login?once={code}", "expires_in": CODE_SECONDS}
        )

    async def login_page(self, request: web.Request) -> web.Response:
        once = request.query.get("once")
        if once is not None:
            session = self.sessions.redeem(once)
            if session is None:
                return _html(
                    pages.login_page(
                        "This login link was used already or has expired: run "
                        "`corral dashboard` for a new one, or paste the token."
                    ),
                    status=401,
                )
            raise self._signed_in_answer(request, session)
        if self.signed_in(request):
            raise web.HTTPSeeOther(f"{PREFIX}/")
        return _html(pages.login_page())

    async def login(self, request: web.Request) -> web.Response:
        if not _same_origin(request):
            return _html(pages.login_page("Sign in from this page."), status=403)
        try:
            async with asyncio.timeout(BODY_TIMEOUT):
                form = await request.post()
        except TimeoutError:
            raise RequestError(408, "timed out reading the login form") from None
        except (ValueError, LookupError, web.RequestPayloadError):
            # aiohttp's form reader raises these on a body that is not the form its headers
            # say (a multipart one without its boundary or a field name, bytes not of the
            # charset, an unknown charset, a Content-Encoding it is not): each was a 500, with
            # a traceback in the daemon log, to anyone who can reach the login page.
            raise RequestError(400, "the login form cannot be read") from None
        token = form.get("token")
        session = self.sessions.login(token) if isinstance(token, str) else None
        if session is None:
            return _html(pages.login_page("That is not this daemon's API token."), status=401)
        raise self._signed_in_answer(request, session)

    def _signed_in_answer(self, request: web.Request, session: str) -> web.HTTPSeeOther:
        answer = web.HTTPSeeOther(f"{PREFIX}/")
        answer.set_cookie(
            self._cookie(request),
            session,
            httponly=True,
            samesite="Strict",
            path="/",
            secure=request.secure,
        )
        return answer

    async def logout(self, request: web.Request) -> web.Response:
        self._need_action(request)
        self.sessions.end(request.cookies.get(self._cookie(request)))
        answer = web.json_response({"signed_out": True})
        answer.del_cookie(self._cookie(request), path="/")
        return answer

    # -- pages and files ----------------------------------------------------------------------

    async def page(self, request: web.Request) -> web.Response:
        if not self.signed_in(request):
            raise web.HTTPSeeOther(f"{PREFIX}/login")
        body, kind = self.static["index.html"]
        return web.Response(body=body, headers={"Content-Type": kind})

    async def root(self, request: web.Request) -> web.Response:
        raise web.HTTPSeeOther(f"{PREFIX}/")

    async def static_file(self, request: web.Request) -> web.Response:
        found = self.static.get(request.match_info["file"])
        if found is None:
            raise RequestError(404, f"no dashboard file {request.match_info['file'][:80]!r}")
        return web.Response(body=found[0], headers={"Content-Type": found[1]})

    # -- data ---------------------------------------------------------------------------------

    async def feed_stream(self, request: web.Request) -> web.StreamResponse:
        self._need_session(request)
        return await self.feed.stream(request)

    async def history(self, request: web.Request) -> web.Response:
        self._need_session(request)
        name = request.match_info["name"]
        self.daemon.controller(name)
        return web.json_response(
            {
                "service": name,
                "sample_seconds": SAMPLE_SECONDS,
                "keep_seconds": KEEP_SECONDS,
                "points": self.feed.history.series(name),
            }
        )

    async def log_stream(self, request: web.Request) -> web.StreamResponse:
        self._need_session(request)
        kind = request.query.get("kind", "replica")
        if kind not in ("replica", "launch"):
            raise RequestError(400, f"query parameter 'kind' must be replica or launch: {kind!r}")
        replica = _replica_id(request.match_info["replica"])
        path = self.daemon.log_path(request.match_info["name"], kind, replica)
        return await self.followers.follow(request, path)

    async def service_log(self, request: web.Request) -> web.StreamResponse:
        """The service's controller log, or its load balancer's lines, followed live."""
        self._need_session(request)
        name = request.match_info["name"]
        kind = request.query.get("kind", "controller")
        if kind == "load_balancer":
            self.daemon.controller(name)
            return await self.followers.balancer(
                request, self.daemon.home, name, lambda: self.daemon.has_service(name)
            )
        if kind != "controller":
            raise RequestError(
                400, f"query parameter 'kind' must be controller or load_balancer: {kind!r}"
            )
        return await self.followers.follow(request, self.daemon.log_path(name, kind, None))

    async def resources(self, request: web.Request) -> web.Response:
        """CPU and memory of each replica of the service, read now (see resources.py)."""
        self._need_session(request)
        name = request.match_info["name"]
        answer = self.usage.cached(name, time.time())
        if answer is None:
            replicas = self.daemon.service(name)["replicas"]
            keep = list(self.daemon.controllers)
            answer = await asyncio.to_thread(self.usage.read, name, replicas, keep)
        return web.json_response(answer)

    # -- actions ------------------------------------------------------------------------------

    async def replace(self, request: web.Request) -> web.Response:
        """``corral down NAME --replica-id N``: this replica drains and goes, and since the
        target is unchanged the controller starts another in its place."""
        self._need_action(request)
        replica = _replica_id(request.match_info["replica"])
        message = self.daemon.terminate_replica(request.match_info["name"], replica, purge=False)
        return web.json_response({"message": message}, status=202)

    async def down(self, request: web.Request) -> web.Response:
        self._need_action(request)
        return web.json_response(
            actions.down(self.daemon, request.match_info["name"]), status=202, dumps=_dumps
        )

    async def rollback(self, request: web.Request) -> web.Response:
        self._need_action(request)
        body = await _body(request)
        version = actions.count_field(body, "version", 1, MAX_ID)
        service = await actions.rollback(self.daemon, request.match_info["name"], version)
        return web.json_response(service, status=201, dumps=_dumps)

    async def scale(self, request: web.Request) -> web.Response:
        self._need_action(request)
        body = await _body(request)
        replicas = actions.count_field(body, "replicas", 0, MAX_REPLICAS)
        service = await actions.scale(self.daemon, request.match_info["name"], replicas)
        return web.json_response(service, status=201, dumps=_dumps)

    def routes(self) -> list[web.RouteDef]:
        p = PREFIX
        svc = p + "/api/services/{name}"
        return [
            web.post("/v1/dashboard/login", self.login_code),
            web.get(p, self.root),
            web.get(p + "/login", self.login_page),
            web.post(p + "/login", self.login),
            web.get(p + "/static/{file}", self.static_file),
            web.get(p + "/", self.page),
            web.get(p + "/services/{name}", self.page),
            web.get(p + "/services/{name}/replicas/{replica}", self.page),
            # Streams answer GET only: a HEAD would hold a stream that never writes a byte.
            web.get(p + "/api/feed", self.feed_stream, allow_head=False),
            web.get(svc + "/history", self.history),
            web.get(svc + "/replicas/{replica}/log", self.log_stream, allow_head=False),
            web.get(svc + "/log", self.service_log, allow_head=False),
            web.get(svc + "/resources", self.resources),
            web.post(svc + "/replicas/{replica}/replace", self.replace),
            web.post(svc + "/down", self.down),
            web.post(svc + "/rollback", self.rollback),
            web.post(svc + "/scale", self.scale),
            web.post(p + "/api/logout", self.logout),
        ]


def _same_origin(request: web.Request) -> bool:
    """A browser's request from one of this server's own pages (or a non-browser client, which
    sends no Origin and no Sec-Fetch-Site; actions still need the custom header)."""
    fetch_site = request.headers.get("Sec-Fetch-Site")
    if fetch_site is not None and fetch_site not in ("same-origin", "none"):
        return False
    origin = request.headers.get("Origin")
    return origin is None or origin == f"{request.scheme}://{request.host}"


def _dumps(data: Any) -> str:
    return json.dumps(data, default=str)


async def _body(request: web.Request) -> dict[str, Any]:
    return await json_object(request, BODY_TIMEOUT)
