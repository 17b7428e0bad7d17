"""The simulator's HTTP server: routes, errors as JSON, vLLM's metric names at ``/metrics``, and
ways to start it in this process (:class:`SimServer`) or in a child process (:func:`spawn`).

Kept thin on purpose: every cost a router should see lives in :mod:`corral.llmsim.engine`, and
the shapes of requests and answers in :mod:`corral.llmsim.protocol`. A request it cannot read is
a 400 with a JSON error, never a 500; a request that arrives while it stops is a 503.
"""

from __future__ import annotations

import itertools
import select
import subprocess
import sys
import time
from collections.abc import Iterable
from types import TracebackType

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from corral.llmsim.cache import Rejected, encode_text
from corral.llmsim.engine import Closed, Engine, EngineConfig
from corral.llmsim.protocol import (
    DONE,
    ChatFormat,
    CompletionFormat,
    Format,
    SGLangFormat,
    TGIFormat,
    completion_prompts,
    event,
    flag,
    generate_request,
    include_usage,
    json_body,
    positive_int,
    render_chat,
)

DEFAULT_MODEL = "corral-llmsim"
DEFAULT_MAX_TOKENS = 16
# The line `python -m corral.llmsim` prints once it listens, followed by its URL.
READY_LINE = "corral.llmsim listening on "
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def _error(status: int, message: str) -> web.Response:
    kind = "BadRequestError" if status == 400 else "ServiceUnavailableError"
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except Rejected as exc:
        return _error(400, str(exc))
    except Closed as exc:
        return _error(503, str(exc))


class EngineMetrics(Collector):
    """vLLM's metric names read from the engine at scrape time, so the engine needs no metrics
    library and the numbers are never out of step with it."""

    def __init__(self, engine: Engine, model: str) -> None:
        self.engine, self.model = engine, model

    def collect(self) -> Iterable[Metric]:
        scheduler, stats = self.engine.scheduler, self.engine.stats
        gauges = (
            ("vllm:num_requests_running", "Sequences in the running batch.", scheduler.running),
            ("vllm:num_requests_waiting", "Sequences waiting to run.", scheduler.waiting),
        )
        for name, doc, queue in gauges:
            yield self._family(GaugeMetricFamily(name, doc, labels=["model_name"]), len(queue))
        for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            doc = "KV cache held by running sequences, 0 to 1."
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            yield self._family(gauge, scheduler.cache.usage)
        counters = (
            ("vllm:prefix_cache_queries", "Prompt tokens looked up.", stats.prefix_queries),
            ("vllm:prefix_cache_hits", "Prompt tokens found cached.", stats.prefix_hits),
            ("vllm:prompt_tokens", "Prompt tokens admitted.", stats.prompt_tokens),
            ("vllm:generation_tokens", "Tokens generated.", stats.generation_tokens),
        )
        for name, doc, value in counters:
            yield self._family(CounterMetricFamily(name, doc, labels=["model_name"]), value)
        success = CounterMetricFamily(
            "vllm:request_success", "Requests finished.", labels=["model_name", "finished_reason"]
        )
        success.add_metric([self.model, "length"], stats.requests_success)
        yield success
        ttft = HistogramMetricFamily(
            "vllm:time_to_first_token_seconds", "Submit to first token.", labels=["model_name"]
        )
        ttft.add_metric([self.model], stats.ttft.cumulative(), stats.ttft.total)
        yield ttft

    def _family(
        self, family: GaugeMetricFamily | CounterMetricFamily, value: float
    ) -> GaugeMetricFamily | CounterMetricFamily:
        family.add_metric([self.model], value)
        return family


class _Routes:
    """The handlers: each reads its request shape, then shares :meth:`_answer`."""

    def __init__(self, engine: Engine, model: str, default_max_tokens: int) -> None:
        self.engine, self.model, self.default_max_tokens = engine, model, default_max_tokens
        self._ids = itertools.count()

    def _id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = json_body(await request.read())
        prompts, text = completion_prompts(body.get("prompt"))
        limit = positive_int(body.get("max_tokens"), self.default_max_tokens, "max_tokens")
        answer = CompletionFormat(self._id("cmpl"), self.model, include_usage(body))
        stream = flag(body, "stream")
        return await self._answer(request, prompts, limit, stream, answer, text)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = json_body(await request.read())
        prompt = encode_text(render_chat(body.get("messages"), body.get("tools")))
        limit = body.get("max_completion_tokens")
        limit = body.get("max_tokens") if limit is None else limit
        max_tokens = positive_int(limit, self.default_max_tokens, "max_tokens")
        answer = ChatFormat(self._id("chatcmpl"), self.model, include_usage(body))
        return await self._answer(request, [prompt], max_tokens, flag(body, "stream"), answer)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = json_body(await request.read())
        prompt, max_tokens, tgi = generate_request(body, self.default_max_tokens)
        answer = (TGIFormat if tgi else SGLangFormat)(self._id("gen"), self.model)
        stream = flag(body, "stream") or request.path == "/generate_stream"
        return await self._answer(request, [prompt], max_tokens, stream, answer)

    async def _answer(
        self,
        request: web.Request,
        prompts: list[bytes],
        max_tokens: int,
        stream: bool,
        answer: Format,
        text: bool = True,
    ) -> web.StreamResponse:
        """Run the prompts; answer once at the end, or stream every token as it is made. The
        generation is aborted on leaving, so a client that hangs up frees its batch slot."""
        with self.engine.generate(prompts, max_tokens, text) as generation:
            if not stream:
                await generation.wait()
                if generation.aborted:
                    raise Closed("the engine stopped")
                return web.json_response(answer.body(generation.sequences))
            index = {seq.seq_id: i for i, seq in enumerate(generation.sequences)}
            response = web.StreamResponse(headers=_SSE_HEADERS)
            await response.prepare(request)
            while tokens := await generation.next():
                events = (answer.events(index[seq.seq_id], seq, pos) for seq, pos in tokens)
                await response.write(b"".join(event(e) for chunk in events for e in chunk))
            if generation.aborted and request.transport is not None:
                # Stopped mid-answer: the connection is cut, the chunked body left unended, as
                # a killed engine's is, so a client can tell the answer is not whole (an ended
                # body read as a complete answer that lacked only its [DONE]).
                request.transport.abort()
                return response
            tail = [event(e) for e in answer.tail(generation.sequences)]
            await response.write(b"".join(tail) + (DONE if answer.done_marker else b""))
            await response.write_eof()
            return response

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response()

    async def models(self, _request: web.Request) -> web.Response:
        config = self.engine.config
        card = {
            "id": self.model,
            "object": "model",
            "created": 0,
            "owned_by": "corral-llmsim",
            "max_model_len": config.cache_blocks * config.block_size,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def model_info(self, _request: web.Request) -> web.Response:
        """SGLang's, which its router reads when a worker registers."""
        info = {"model_path": self.model, "tokenizer_path": None, "is_generation": True}
        return web.json_response(info)

    async def server_info(self, _request: web.Request) -> web.Response:
        config = self.engine.config
        info = {
            "model_path": self.model,
            "max_running_requests": config.max_batch,
            "page_size": config.block_size,
            "version": "corral-llmsim",
        }
        return web.json_response(info)


def build_app(engine: Engine, model: str, default_max_tokens: int) -> web.Application:
    routes = _Routes(engine, model, default_max_tokens)
    registry = CollectorRegistry()
    registry.register(EngineMetrics(engine, model))

    async def metrics(_request: web.Request) -> web.Response:
        headers = {"Content-Type": CONTENT_TYPE_PLAIN_0_0_4}
        return web.Response(body=generate_latest(registry), headers=headers)

    app = web.Application(middlewares=[_errors], client_max_size=64 * 1024 * 1024)
    app.add_routes(
        [
            web.post("/v1/completions", routes.completions),
            web.post("/v1/chat/completions", routes.chat),
            web.post("/generate", routes.generate),
            web.post("/generate_stream", routes.generate),
            web.get("/health", routes.health),
            web.get("/v1/models", routes.models),
            web.get("/model_info", routes.model_info),
            web.get("/server_info", routes.server_info),
            web.get("/metrics", metrics),
        ]
    )
    return app


class SimServer:
    """A simulator in this process, on the running event loop: ``async with SimServer(config) as
    sim:`` then ``sim.url``; ``sim.engine`` is there to read (its counters, its queues)."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        model: str = DEFAULT_MODEL,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
    ) -> None:
        self.engine = Engine(config)
        self.model = model
        self.app = build_app(self.engine, model, default_max_tokens)
        self.host, self.port = "127.0.0.1", 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen (port 0: a free one) and return the port."""
        self.engine.start()
        # handler_cancellation: a client that hangs up cancels its handler, which aborts its
        # sequences instead of leaving them to run for nobody.
        runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
        await runner.setup()
        self._runner = runner
        await web.TCPSite(runner, host, port).start()
        self.host, self.port = host, runner.addresses[0][1]
        return self.port

    async def stop(self) -> None:
        """Abort what runs (its clients get an error or a cut stream), then close."""
        await self.engine.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> SimServer:
        await self.start(self.host, self.port)
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.stop()


def command(
    config: EngineConfig | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    model: str = DEFAULT_MODEL,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    python: str = sys.executable,
) -> list[str]:
    """The command line of a simulator with these settings."""
    args = ["--host", host, "--port", str(port), "--model", model]
    args += ["--default-max-tokens", str(default_max_tokens)]
    return [python, "-m", "corral.llmsim", *args, *(config or EngineConfig()).argv()]


def spawn(
    config: EngineConfig | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    model: str = DEFAULT_MODEL,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    timeout: float = 30.0,
) -> tuple[subprocess.Popen[str], str]:
    """Start a simulator as a child process of this Python and wait until it listens; return
    the process and its URL. The caller ends it (``terminate()``, then ``wait()``)."""
    process = subprocess.Popen(  # an argv list (never a shell): python -m corral.llmsim ...
        [
            *command(
                config, host=host, port=port, model=model, default_max_tokens=default_max_tokens
            )
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if select.select([process.stdout], [], [], left)[0]:
            line = process.stdout.readline()
            if line.startswith(READY_LINE):
                return process, line[len(READY_LINE) :].strip()
            if not line:  # it exited before it listened
                break
    process.kill()
    process.wait()
    raise RuntimeError(f"corral.llmsim did not start: {process.args!r}")
