"""An open WebSocket through the balancer while its replica leaves (docs/reliability.md,
"Limits that remain"): it counts as a request in flight, so it keeps working for the leaving
replica's drain, then ends with the replica, a close the client sees, never a hang; a new
socket reaches the replica that replaced it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from conftest import APPS, CorralHome, spec_text, write_spec

DRAIN = 3.0


def test_a_websocket_lasts_its_replicas_drain_then_closes(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    extra = f"  load_balancer:\n    drain_timeout_seconds: {DRAIN:g}\n"
    text = spec_text("ws", 1, run=f"exec {sys.executable} ws_echo.py", workdir=APPS) + extra
    corral_home.run("up", str(write_spec(tmp_path / "ws.yaml", text)))
    endpoint = str(corral_home.status("ws")["endpoint"]).replace("http://", "ws://") + "/ws"

    async def scenario() -> tuple[str, float]:
        async with aiohttp.ClientSession() as session:
            socket = await session.ws_connect(endpoint)
            await socket.send_str("a")
            assert (await socket.receive_str(timeout=10)) == "1:a"
            down = subprocess.Popen(
                corral_home.cli("down", "ws", "--replica-id", "1", "-y"),
                env=corral_home.env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                left = time.monotonic()
                await socket.send_str("b")  # the replica is leaving: the tunnel still works
                during = await socket.receive_str(timeout=10)
                ending = await socket.receive(timeout=DRAIN + 30)  # never a hang
                lasted = time.monotonic() - left
            finally:
                await asyncio.to_thread(down.wait, 60)
            assert ending.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED), ending
            return during, lasted

    async def fresh() -> str:
        async with aiohttp.ClientSession() as session, session.ws_connect(endpoint) as socket:
            await socket.send_str("c")
            return await socket.receive_str(timeout=10)

    corral_home.wait_replicas("ws", 1)
    during, lasted = asyncio.run(scenario())
    assert during == "1:b"
    assert lasted >= DRAIN * 0.9, lasted  # held for the drain, not cut when the replica left
    corral_home.wait_for(
        lambda: (
            [r["id"] for r in corral_home.status("ws")["replicas"] if r["status"] == "READY"] == [2]
        ),
        60,
        "replica 2 ready in replica 1's place",
    )
    assert asyncio.run(fresh()) == "2:c"
