"""A trivial HTTP/1.1 replica for bench/balancer.py, as cheap per request as Python gets.

Why raw asyncio instead of aiohttp: the benchmark measures the proxy, so the replicas must not be
the bottleneck. A bare ``asyncio.Protocol`` that answers every request head with a canned response
serves ~10k req/s per core here, several times what one Python proxy can push through, while an
aiohttp app would serve about as slowly as the proxy under test.

Routes (the path is all that is parsed):

* anything else: ``200 ok`` (2-byte body, keep-alive, pipelining-safe).
* ``/sse``: ``text/event-stream``, chunked, ``--events`` events ``--interval`` seconds apart
  (``/sse?events=N&interval=S`` for other counts and gaps); the
  first event goes out in the same write as the headers, so time-to-first-byte is the proxy's
  own latency and nothing else. The connection stays open afterwards, as with uvicorn or vLLM,
  so a proxy can reuse it for the next stream.

Run: ``python bench/_lb_replica.py [--port 0] [--events 200] [--interval 0.005]``; prints
``PORT <n>`` once listening, serves until SIGTERM/SIGINT. Listens on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import sys

OK = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"
OK_CLOSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n"
    b"Connection: close\r\n\r\nok"
)
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)


# ``/sse?events=N&interval=S``: N events S seconds apart instead of the defaults.
_EVENTS = re.compile(rb"[?&]events=(\d+)")
_INTERVAL = re.compile(rb"[?&]interval=([\d.]+)")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Replica(asyncio.Protocol):
    events = 200
    interval = 0.005
    streams: set[asyncio.Task[None]] = set()  # strong refs: running streams are not collected

    def __init__(self) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.skip = 0  # request body bytes still to discard
        self.streaming = False  # requests arriving during a stream wait for its end

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        transport = self.transport
        if transport is None:
            return
        buf = self.buf + data if self.buf else data
        if self.streaming:
            self.buf = buf
            return
        out: list[bytes] = []
        while True:
            if self.skip:
                n = min(self.skip, len(buf))
                self.skip -= n
                buf = buf[n:]
                if self.skip:
                    break
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                break
            head = buf[:end]
            buf = buf[end + 4 :]
            lower = head.lower()
            pos = lower.find(b"\r\ncontent-length:")
            if pos >= 0:
                line_end = lower.find(b"\r\n", pos + 2)
                value = lower[pos + 17 : line_end if line_end >= 0 else None]
                self.skip = int(value.strip() or b"0")
            eol = head.find(b"\r\n")
            first = head if eol < 0 else head[:eol]
            parts = first.split(b" ")
            path = parts[1] if len(parts) > 1 else b"/"
            if path.startswith(b"/sse"):
                if out:
                    transport.write(b"".join(out))
                    out = []
                self.streaming = True
                self.buf = buf
                events, interval = self.events, self.interval
                if (m := _EVENTS.search(path)) is not None:
                    events = max(1, int(m.group(1)))
                if (m := _INTERVAL.search(path)) is not None:
                    interval = float(m.group(1))
                task = asyncio.ensure_future(self.sse(transport, events, interval))
                self.streams.add(task)
                task.add_done_callback(self.streams.discard)
                return
            if b"\r\nconnection: close" in lower or first.endswith(b"HTTP/1.0"):
                out.append(OK_CLOSE)
                transport.write(b"".join(out))
                transport.close()
                self.transport = None
                return
            out.append(OK)
        self.buf = buf
        if out:
            transport.write(out[0] if len(out) == 1 else b"".join(out))

    async def sse(self, transport: asyncio.Transport, events: int, interval: float) -> None:
        loop = asyncio.get_running_loop()
        try:
            transport.write(SSE_HEAD + chunk(b"data: 0\n\n"))
            start = loop.time()
            for i in range(1, events):
                # paced against the start, not the previous event, so a late wake-up does not
                # stretch the whole stream
                await asyncio.sleep(max(0.0, start + i * interval - loop.time()))
                if transport.is_closing():
                    return
                transport.write(chunk(b"data: %d\n\n" % i))
            transport.write(b"0\r\n\r\n")
        except BaseException:
            transport.close()
            raise
        self.streaming = False
        if self.buf and not transport.is_closing():
            pending, self.buf = self.buf, b""
            self.data_received(pending)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--events", type=int, default=200)
    parser.add_argument("--interval", type=float, default=0.005)
    args = parser.parse_args()
    Replica.events = args.events
    Replica.interval = args.interval
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Replica, "127.0.0.1", args.port, backlog=1024)
    port = server.sockets[0].getsockname()[1]
    print(f"PORT {port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(0)
