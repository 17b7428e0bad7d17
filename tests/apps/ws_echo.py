"""A replica that speaks WebSocket: /ws echoes each text message with the replica's id, and
/health answers the readiness probe. Its port is $PORT, as every local replica's."""

import os

from aiohttp import WSMsgType, web

REPLICA = os.environ.get("CORRAL_REPLICA_ID", "?")


async def health(_request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def echo(request: web.Request) -> web.WebSocketResponse:
    socket = web.WebSocketResponse()
    await socket.prepare(request)
    async for message in socket:
        if message.type == WSMsgType.TEXT:
            await socket.send_str(f"{REPLICA}:{message.data}")
    return socket


app = web.Application()
app.router.add_get("/health", health)
app.router.add_get("/ws", echo)
web.run_app(app, host="127.0.0.1", port=int(os.environ["PORT"]), print=None)
