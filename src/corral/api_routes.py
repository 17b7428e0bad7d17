"""The API's routes over the daemon's operations: one method per route, nothing more.

Why thin: a route reads the request (corral.api_input), calls one operation of
:class:`~corral.daemon.Daemon` and answers its result as JSON. What is allowed is the daemon's to
decide, and it says no with a domain error that corral.api_errors turns into a status; so the
rules are tested once, whatever the caller (the API, the dashboard).
"""

from __future__ import annotations

import os
from typing import Any

from aiohttp import web

from corral import __version__, api_logs
from corral.api_errors import RequestError, json_answer
from corral.api_input import (
    body_of,
    flag,
    int_param,
    optional_dir,
    optional_str,
    optional_values,
    optional_version,
)
from corral.api_openapi import OPENAPI
from corral.balancer import CONTENT_TYPE_LATEST
from corral.daemon import Daemon, UpdateRequest
from corral.home import hello_proof, valid_nonce
from corral.limits import open_files


class Routes:
    """The routes of one daemon's API; ``token`` only proves, in /v1/health, who answers."""

    def __init__(self, daemon: Daemon, token: str) -> None:
        self.daemon = daemon
        self._token = token

    def table(self) -> web.RouteTableDef:
        routes = web.RouteTableDef()
        routes.get("/v1/health")(self.health)
        routes.get("/v1/daemon")(self.info)
        routes.post("/v1/daemon/stop")(self.stop)
        routes.post("/v1/daemon/restart-workers")(self.restart_workers)
        routes.get("/v1/services")(self.list_services)
        routes.post("/v1/services")(self.create)
        routes.post("/v1/services/{name}/versions")(self.update)
        routes.get("/v1/services/{name}")(self.get_service)
        routes.delete("/v1/services/{name}")(self.down)
        routes.delete("/v1/services/{name}/replicas/{replica}")(self.terminate_replica)
        routes.get("/v1/services/{name}/events")(self.events)
        routes.get("/v1/services/{name}/logs")(self.logs)
        routes.get("/metrics")(self.metrics)
        routes.get("/v1/openapi.json")(self.openapi)
        return routes

    async def health(self, request: web.Request) -> web.Response:
        answer: dict[str, Any] = {"ok": True, "version": __version__}
        nonce = request.query.get("nonce", "")
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        if valid_nonce(nonce) and isinstance(sockname, tuple):
            # The CLI's question before it sends the token (see home.hello_proof).
            port = int(sockname[1])
            answer.update(proof=hello_proof(self._token, nonce, port), port=port, pid=os.getpid())
        return json_answer(answer)

    async def info(self, request: web.Request) -> web.Response:
        described = self.daemon.describe()
        return json_answer({"pid": os.getpid(), **described, "open_files": open_files()})

    async def stop(self, request: web.Request) -> web.Response:
        # ?all=1: the balancer workers stop too; without it they keep serving every service.
        # Read by flag(), which refuses what is neither yes nor no, before anything stops.
        everything = flag(request, "all")
        workers = self.daemon.request_stop(workers=everything)
        return json_answer({"stopping": True, "balancer_workers_stop": workers}, status=202)

    async def restart_workers(self, request: web.Request) -> web.Response:
        return json_answer({"restarted": await self.daemon.restart_workers()})

    async def list_services(self, request: web.Request) -> web.Response:
        return json_answer({"services": self.daemon.services()})

    async def create(self, request: web.Request) -> web.Response:
        body = await body_of(request)
        spec = body.get("spec")
        if not isinstance(spec, str) or not spec.strip():
            raise RequestError(400, "field 'spec' (the service YAML as a string) is required")
        name = optional_str(body, "name")
        source = optional_str(body, "source")
        base_dir = optional_dir(body, "base_dir")
        service = await self.daemon.create(
            spec,
            name=name,
            source=source,
            base_dir=base_dir,
            envs=optional_values(body, "envs"),
            secrets=optional_values(body, "secrets"),
        )
        return json_answer(service, status=201)

    async def update(self, request: web.Request) -> web.Response:
        body = await body_of(request)
        spec = optional_str(body, "spec")
        mode = optional_str(body, "mode") or "rolling"
        wanted = UpdateRequest(
            spec_text=spec,
            mode=mode,
            from_version=optional_version(body, "from_version"),
            source=optional_str(body, "source"),
            base_dir=optional_dir(body, "base_dir"),
            envs=optional_values(body, "envs"),
            secrets=optional_values(body, "secrets"),
        )
        service = await self.daemon.update(request.match_info["name"], wanted)
        return json_answer(service, status=201)

    async def get_service(self, request: web.Request) -> web.Response:
        return json_answer(self.daemon.service(request.match_info["name"]))

    async def down(self, request: web.Request) -> web.Response:
        purge = flag(request, "purge")
        return json_answer(self.daemon.down(request.match_info["name"], purge=purge), status=202)

    async def terminate_replica(self, request: web.Request) -> web.Response:
        # SkyServe's `down --replica-id`: the replica goes and (target unchanged) is replaced.
        replica = request.match_info["replica"]
        if not (replica.isascii() and replica.isdigit()) or len(replica) > 18:
            raise RequestError(400, f"replica id must be a whole number, got {replica[:40]!r}")
        name = request.match_info["name"]
        message = self.daemon.terminate_replica(name, int(replica), purge=flag(request, "purge"))
        return json_answer({"message": message}, status=202)

    async def events(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        self.daemon.controller(name)
        after = int_param(request, "after", 0)
        return json_answer({"events": self.daemon.events(name, after)})

    async def logs(self, request: web.Request) -> web.StreamResponse:
        return await api_logs.logs(request, self.daemon)

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus exposition of every service's balancer and the machine's devices."""
        headers = {"Content-Type": CONTENT_TYPE_LATEST}
        return web.Response(body=self.daemon.metrics(), headers=headers)

    async def openapi(self, request: web.Request) -> web.Response:
        return json_answer(OPENAPI)
