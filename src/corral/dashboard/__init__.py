"""The web dashboard: services, replicas, traffic and logs in a browser, served by the daemon.

:func:`install` is the one hook the API calls; everything else lives in this package (see
docs/dashboard.md for the design and its limits). Importing the package is cheap: the CLI's
``corral dashboard`` needs :mod:`corral.dashboard.cli` only, not the daemon's modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from aiohttp import web

    from corral.daemon import Daemon

__all__ = ["PREFIX", "install", "own_auth"]

PREFIX: Final = "/ui"


def own_auth(path: str) -> bool:
    """Whether ``path`` is the dashboard's: checked by its session, not the bearer token."""
    return path == PREFIX or path.startswith(PREFIX + "/")


def install(app: web.Application, daemon: Daemon, token: str) -> Any:
    """Add the dashboard's routes, its security headers and its feed's lifecycle to the API's
    app; returns the :class:`~corral.dashboard.routes.Dashboard`."""
    from corral.dashboard.routes import Dashboard, secure_headers

    dashboard = Dashboard(daemon, token)
    app.add_routes(dashboard.routes())
    app.on_startup.append(dashboard.on_startup)
    app.on_shutdown.append(dashboard.on_shutdown)
    app.on_response_prepare.append(secure_headers)
    return dashboard
