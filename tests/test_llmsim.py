"""corral.llmsim, the LLM engine simulator: its cache, its scheduler, and its HTTP face.

Why these tests: benchmarks of LLM routing trust the simulator's counters (cache hits, queue
lengths) and its timing (TTFT grows with uncached prefill and queueing). Each test pins one of
those promises with an assertion that fails when the promise breaks: the engine's own counters
where they can decide, client-side timing only with margins far above a busy 2-core machine's
noise. Servers run in this process on 127.0.0.1 port 0; one test starts the command line as a
child process and ends it by its pid. Nothing sleeps and hopes: waits poll a condition under a
deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from corral.llmsim import (
    EngineConfig,
    PrefixCache,
    Rejected,
    Scheduler,
    SimServer,
    block_hashes,
    command,
    encode_text,
    render_chat,
    spawn,
)
from corral.spec import load_spec

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parent.parent
# Steps of about a millisecond and free prefill: tests that do not measure time run fast.
FAST = EngineConfig(step_base_ms=1.0, step_per_seq_ms=0.1, prefill_per_token_ms=0.0)


def run(scenario: Coroutine[Any, Any, None], timeout: float = 20.0) -> None:
    asyncio.run(asyncio.wait_for(scenario, timeout))


async def until(condition: Callable[[], Awaitable[bool]], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.005)


def words(tokens: int, tag: str = "a") -> str:
    """A text of exactly ``tokens`` tokens (4 ASCII bytes each), different for each tag."""
    text = "".join(f"{tag}{i:06d} " for i in range(tokens))
    return text[: tokens * 4]


async def post(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.post(url, data=data) as response:
        return response.status, await response.json(content_type=None)


async def stream(
    session: aiohttp.ClientSession, url: str, body: Any
) -> tuple[float, str, list[str]]:
    """Seconds to the first ``data:`` bytes, the whole body, and each event's payload."""
    started = time.monotonic()
    first = None
    chunks = []
    async with session.post(url, json=body) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        async for chunk in response.content.iter_any():
            first = first if first is not None else time.monotonic() - started
            chunks.append(chunk)
    text = b"".join(chunks).decode()
    assert first is not None and text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), text
    return first, text, [e[len("data: ") :] for e in events]


async def metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Every sample of /metrics by name (one model per server, so names are unique)."""
    async with session.get(url + "/metrics") as response:
        assert response.status == 200
        text = await response.text()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name
            if "le" in sample.labels:
                key += "{le=" + sample.labels["le"] + "}"
            samples[key] = sample.value
    return samples


def test_cache_shares_leading_blocks_and_evicts_idle_blocks_oldest_first() -> None:
    size = 4
    a, b = (
        block_hashes(encode_text(words(16, "a")), size),
        block_hashes(encode_text(words(16, "b")), size),
    )
    shared = block_hashes(encode_text(words(8, "a") + words(8, "c")), size)
    assert len(a) == 4 and a[:2] == shared[:2] and a[2:] != shared[2:]
    cache = PrefixCache(capacity=8)
    cache.acquire(a, private=1)
    assert cache.in_use == 5 and not cache.fits(b, private=1)  # held blocks are never taken
    cache.release(a, private=1)
    cache.acquire(b, private=1)  # evicts a's tail block first: a's prefix stays findable
    assert cache.evictions == 1 and a[3] not in cache and cache.prefix_blocks(a, 4) == 3
    cache.release(b, private=1)
    cache.acquire(block_hashes(encode_text(words(16, "c")), size), private=1)
    assert cache.prefix_blocks(a, 4) == 0, "the least recently used (a) goes first"
    assert cache.prefix_blocks(b, 4) == 3 and cache.evictions == 5
    assert cache.usage == 5 / 8


def test_scheduler_batches_first_come_first_served_and_charges_uncached_prefill() -> None:
    config = EngineConfig(max_batch=2, step_base_ms=10, step_per_seq_ms=1, prefill_per_token_ms=1)
    scheduler = Scheduler(config)
    prompt = encode_text(words(100))
    seqs = [scheduler.submit(prompt, 2, now=0.0) for _ in range(3)]
    # two admitted; the second finds the first one's blocks, inserted as the first was admitted
    assert scheduler.begin_step(0.0) == pytest.approx((10 + 2 + 100 + 4) / 1000)
    assert scheduler.running == seqs[:2] and list(scheduler.waiting) == seqs[2:]
    assert [seq.cached_tokens for seq in seqs[:2]] == [0, 96]
    assert scheduler.end_step(0.5) == [] and seqs[0].first_token_at == 0.5
    assert scheduler.begin_step(0.5) == pytest.approx(0.012), "no room for the third yet"
    assert scheduler.end_step(0.6) == seqs[:2] and seqs[0].ttft == 0.5
    assert scheduler.begin_step(0.6) == pytest.approx((10 + 1 + 4) / 1000)
    stats = scheduler.stats
    assert (stats.prefix_queries, stats.prefix_hits, stats.requests_success) == (300, 192, 2)
    assert stats.peak_running == 2 and stats.generation_tokens == 4
    scheduler.abort(seqs[2])
    assert scheduler.running == [] and scheduler.cache.in_use == 0
    with pytest.raises(Rejected):
        scheduler.submit(encode_text(words(40_000)), 16, now=0.0)


def test_a_repeated_prefix_hits_the_cache_and_skips_its_prefill() -> None:
    slow_prefill = EngineConfig(step_base_ms=1, step_per_seq_ms=0.1, prefill_per_token_ms=0.5)
    prompt = words(1024)

    async def scenario() -> None:
        async with SimServer(slow_prefill) as sim, aiohttp.ClientSession() as session:
            url = sim.url + "/v1/completions"
            body = {"prompt": prompt, "max_tokens": 2, "stream": True}
            body["stream_options"] = {"include_usage": True}
            cold, _, cold_events = await stream(session, url, body)
            warm, _, warm_events = await stream(session, url, body)
            usages = [json.loads(events[-2])["usage"] for events in (cold_events, warm_events)]
            assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [0, 1008]
            assert cold >= 0.5, "1024 uncached tokens at 0.5 ms each"
            assert warm < cold - 0.3, (cold, warm)
            # diverging in the middle of block 33: blocks 0-31 (512 tokens) are shared
            _, partial = await post(session, url, {"prompt": words(520) + words(504, "z")})
            assert partial["usage"]["prompt_tokens_details"]["cached_tokens"] == 512
            seen = await metrics(session, sim.url)
            assert seen["vllm:prefix_cache_queries_total"] == 3 * 1024
            assert seen["vllm:prefix_cache_hits_total"] == 1008 + 512
            assert seen["vllm:prompt_tokens_total"] == 3 * 1024
            assert seen["vllm:time_to_first_token_seconds_count"] == 3
            # cold: over 0.51 s; warm: about 10 ms; half cached: about 0.26 s
            assert seen["vllm:time_to_first_token_seconds_bucket{le=0.5}"] == 2

    run(scenario())


def test_a_full_cache_evicts_the_least_recently_used_prompt() -> None:
    small = EngineConfig(block_size=4, cache_blocks=8, step_base_ms=1, prefill_per_token_ms=0)

    async def scenario() -> None:
        async with SimServer(small) as sim, aiohttp.ClientSession() as session:
            url = sim.url + "/v1/completions"

            async def cached(tag: str) -> int:
                status, body = await post(session, url, {"prompt": words(16, tag), "max_tokens": 4})
                assert status == 200, body
                return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])

            # each needs 5 of the 8 blocks: 4 of prompt, 1 for its output
            assert [await cached("a"), await cached("a"), await cached("b")] == [0, 12, 0]
            assert await cached("c") == 0  # takes a's blocks (older), then one of b's
            assert [await cached("b"), await cached("a")] == [12, 0]
            assert sim.engine.scheduler.cache.evictions > 0
            status, body = await post(session, url, {"prompt": words(40, "d"), "max_tokens": 4})
            assert status == 400 and "KV blocks" in body["error"]["message"]

    run(scenario())


def test_requests_beyond_max_batch_wait_in_the_queue() -> None:
    config = EngineConfig(max_batch=2, step_base_ms=5, step_per_seq_ms=0, prefill_per_token_ms=0)

    async def scenario() -> None:
        async with SimServer(config) as sim, aiohttp.ClientSession() as session:
            url = sim.url + "/v1/completions"
            requests = [
                asyncio.create_task(
                    post(session, url, {"prompt": words(8, f"p{i}"), "max_tokens": 30})
                )
                for i in range(6)
            ]

            async def queued() -> bool:
                seen = await metrics(session, sim.url)
                assert seen["vllm:num_requests_running"] <= 2
                return (
                    seen["vllm:num_requests_waiting"] >= 1
                    and seen["vllm:num_requests_running"] == 2
                )

            await until(queued, "two running and some waiting")
            answers = await asyncio.gather(*requests)
            assert all(status == 200 for status, _ in answers)
            assert all(body["usage"]["completion_tokens"] == 30 for _, body in answers)
            stats = sim.engine.stats
            assert stats.peak_running == 2 and stats.requests_success == 6
            seen = await metrics(session, sim.url)
            assert seen["vllm:num_requests_waiting"] == 0 and seen["vllm:kv_cache_usage_perc"] == 0
            assert seen["vllm:generation_tokens_total"] == 180

    run(scenario())


def test_streams_are_openai_server_sent_events() -> None:
    async def scenario() -> None:
        async with SimServer(FAST) as sim, aiohttp.ClientSession() as session:
            body = {"prompt": ["one two", "three four"], "max_tokens": 5, "stream": True}
            body["stream_options"] = {"include_usage": True}
            _, text, events = await stream(session, sim.url + "/v1/completions", body)
            assert events[-1] == "[DONE]" and text.endswith("data: [DONE]\n\n")
            chunks = [json.loads(e) for e in events[:-1]]  # every other event is JSON
            assert all(
                c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks
            )
            usage = chunks[-1]
            assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
            for index in (0, 1):
                mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == index]
                assert "".join(c["text"] for c in mine) == " tok0 tok1 tok2 tok3 tok4"
                assert [c["finish_reason"] for c in mine] == [None] * 4 + ["length"]

            chat = {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
                "stream": True,
            }
            _, _, events = await stream(session, sim.url + "/v1/chat/completions", chat)
            chunks = [json.loads(e) for e in events[:-1]]
            assert (
                events[-1] == "[DONE]" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            )
            assert all(c["object"] == "chat.completion.chunk" for c in chunks)
            content = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
            assert (
                content == " tok0 tok1 tok2"
                and chunks[-1]["choices"][0]["finish_reason"] == "length"
            )

    run(scenario())


def test_a_chat_is_rendered_whole_so_earlier_turns_key_the_cache() -> None:
    system = {"role": "system", "content": words(64, "s")}
    tools = [{"type": "function", "function": {"name": "lookup"}}]

    def chat(first_question: str) -> list[dict[str, Any]]:
        return [
            system,
            {"role": "user", "content": [{"type": "text", "text": first_question}]},
            {"role": "assistant", "content": words(40, "r")},
            {"role": "user", "content": "and then?"},
        ]

    one, other = chat(words(40, "q")), chat(words(40, "x"))
    text = render_chat(one, tools)
    marks = [
        text.index(m)
        for m in ("system\n", "tools\n", "lookup", "user\n", "assistant\n", "and then?")
    ]
    assert marks == sorted(marks) and text.endswith("<|im_start|>assistant\n")
    hashes = [block_hashes(encode_text(render_chat(c, tools)), 16) for c in (one, other)]
    assert hashes[0][:4] == hashes[1][:4] and hashes[0][-1] != hashes[1][-1]

    async def scenario() -> None:
        async with SimServer(FAST) as sim, aiohttp.ClientSession() as session:
            url = sim.url + "/v1/chat/completions"

            async def cached(messages: list[dict[str, Any]]) -> int:
                status, body = await post(session, url, {"messages": messages, "tools": tools})
                assert status == 200 and body["object"] == "chat.completion", body
                return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])

            assert await cached(one) == 0
            repeated, changed = await cached(one), await cached(other)
            texts = [render_chat(c, tools) for c in (one, other)]
            common = next(i for i, (x, y) in enumerate(zip(*texts, strict=False)) if x != y)
            assert changed == common // 4 // 16 * 16 > 0, "shared up to the first changed turn"
            assert repeated > changed + 80

    run(scenario())


def test_a_chat_s_next_turn_finds_the_answer_it_repeats_cached() -> None:
    """Real engines keep the blocks of what they generated: a next turn that repeats the answer
    computes only its new message (on the replica that wrote the answer)."""
    first = [{"role": "system", "content": words(64, "s")}, {"role": "user", "content": "hi"}]

    async def scenario() -> None:
        async with SimServer(FAST) as sim, aiohttp.ClientSession() as session:
            url = sim.url + "/v1/chat/completions"

            async def ask(messages: list[dict[str, Any]]) -> tuple[int, str]:
                status, body = await post(session, url, {"messages": messages, "max_tokens": 40})
                assert status == 200, body
                cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
                return int(cached), body["choices"][0]["message"]["content"]

            _, answer = await ask(first)
            assert answer.startswith(" tok0 tok1")
            follow = [*first, {"role": "assistant", "content": answer}]
            follow.append({"role": "user", "content": "and then?"})
            written = len(render_chat(first).encode() + answer.encode()) // 4 // 16 * 16
            prompt_only = len(encode_text(render_chat(first))) // 4 // 16 * 16
            assert written >= prompt_only + 48, "the 40-token answer fills 3 blocks or more"
            edited = [*follow[:2], {"role": "assistant", "content": "no" + answer}, follow[3]]
            assert (await ask(edited))[0] == prompt_only, "another answer is not cached"
            assert (await ask(follow))[0] == written, "every full block of prompt and answer"

    run(scenario())


def test_an_answer_to_token_ids_or_cut_short_is_not_cached() -> None:
    """The client's own tokens for an answer to token ids are unknown, and an aborted answer is
    not whole: nothing past the prompt is kept for either."""
    scheduler = Scheduler(EngineConfig(block_size=4))
    seq = scheduler.submit(b"\1\0\0\0" * 16, 40, now=0.0, text=False)
    scheduler.begin_step(0.0)
    while not seq.done:
        scheduler.end_step(0.0)
    assert len(scheduler.cache) == 4
    text = scheduler.submit(encode_text(words(16)), 40, now=0.0)
    scheduler.begin_step(0.0)
    while not text.done:
        scheduler.end_step(0.0)
    assert len(scheduler.cache) > 8, "a text's answer stays cached after its prompt"
    cut = scheduler.submit(encode_text(words(16, "c")), 40, now=0.0)
    scheduler.begin_step(0.0)
    for _ in range(8):  # " tok0 ... tok7": 10 tokens, 2 full blocks of 4
        scheduler.end_step(0.0)
    before = len(scheduler.cache)
    scheduler.abort(cut)
    assert cut.generated == 8 and len(scheduler.cache) == before, "aborted: its prompt only"


def test_generate_reads_sglang_text_and_tgi_inputs() -> None:
    async def scenario() -> None:
        async with SimServer(FAST) as sim, aiohttp.ClientSession() as session:
            url = sim.url + "/generate"
            sglang = {"text": words(10), "sampling_params": {"max_new_tokens": 3}}
            status, body = await post(session, url, sglang)
            assert status == 200 and body["text"] == " tok0 tok1 tok2"
            assert body["meta_info"]["prompt_tokens"] == 10
            assert body["meta_info"]["completion_tokens"] == 3
            status, body = await post(
                session, url, {"inputs": words(10), "parameters": {"max_new_tokens": 2}}
            )
            assert status == 200 and body["generated_text"] == " tok0 tok1"
            _, _, events = await stream(session, url, sglang | {"stream": True})
            assert events[-1] == "[DONE]" and json.loads(events[-2])["text"] == " tok0 tok1 tok2"
            _, _, events = await stream(session, url + "_stream", {"inputs": "hi"})
            tokens = [json.loads(e) for e in events]
            assert len(tokens) == 16 and tokens[-1]["details"]["generated_tokens"] == 16
            assert [t["generated_text"] is None for t in tokens] == [True] * 15 + [False]

    run(scenario())


BAD = [
    ("/v1/completions", b"{"),
    ("/v1/completions", b"\xff\xfe"),
    ("/v1/completions", b"[]"),
    ("/v1/completions", b"{}"),
    ("/v1/completions", b'{"prompt": 5}'),
    ("/v1/completions", b'{"prompt": []}'),
    ("/v1/completions", b'{"prompt": [1, "a"]}'),
    ("/v1/completions", b'{"prompt": [-1]}'),
    ("/v1/completions", b'{"prompt": ""}'),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}'),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": "5"}'),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": true}'),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 1e400}'),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 1000000000}'),
    ("/v1/completions", b'{"prompt": "x", "stream": "yes"}'),
    ("/v1/completions", b'{"prompt": "x", "stream_options": 3}'),
    ("/v1/chat/completions", b"{}"),
    ("/v1/chat/completions", b'{"messages": "hi"}'),
    ("/v1/chat/completions", b'{"messages": []}'),
    ("/v1/chat/completions", b'{"messages": [{"content": "x"}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [5]}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "tools": {}}'),
    ("/generate", b"{}"),
    ("/generate", b'{"text": 5}'),
    ("/generate", b'{"text": "x", "sampling_params": []}'),
    ("/generate", b'{"inputs": "x", "parameters": {"max_new_tokens": -1}}'),
]


def test_bad_input_is_a_400_with_a_json_error() -> None:
    async def scenario() -> None:
        async with SimServer(FAST) as sim, aiohttp.ClientSession() as session:
            for path, raw in BAD:
                status, body = await post(session, sim.url + path, raw)
                assert status == 400, (path, raw, status, body)
                assert isinstance(body["error"]["message"], str), body
            engine = sim.engine.scheduler
            assert not engine.waiting and not engine.running and engine.stats.prompt_tokens == 0
            status, _ = await post(session, sim.url + "/v1/completions", {"prompt": "fine"})
            assert status == 200

    run(scenario())


def test_a_request_that_arrives_while_the_server_stops_is_a_503() -> None:
    """docs/llmsim.md: a request arriving while the server stops is a 503 (with the JSON
    error shape of a 400), not a hang nor a 500: a balancer then tries another replica."""

    async def scenario() -> None:
        async with SimServer(FAST) as sim, aiohttp.ClientSession() as session:
            await sim.engine.stop()  # what SimServer.stop does first, before the listener goes
            for path, body in (
                ("/v1/completions", {"prompt": "late"}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "late"}]}),
            ):
                status, answer = await post(session, sim.url + path, body)
                assert status == 503, (path, status, answer)
                assert answer["error"]["code"] == 503 and answer["error"]["message"], answer

    run(scenario())


def test_a_stream_the_stop_cuts_reads_as_cut() -> None:
    """docs/llmsim.md: a stream under way when the server stops ends with the connection cut,
    its chunked body unended. It once ended properly, without its [DONE]: a client (curl, an
    SDK iterating the events) read a cut answer as a whole one."""

    async def scenario() -> None:
        async with SimServer(FAST) as sim, aiohttp.ClientSession() as session:
            body = {"prompt": "long", "max_tokens": 5_000, "stream": True}
            async with session.post(sim.url + "/v1/completions", json=body) as response:
                assert response.status == 200
                await response.content.readline()  # the answer is under way
                stopping = asyncio.create_task(sim.engine.stop())
                with pytest.raises(aiohttp.ClientPayloadError):
                    while await response.content.read(65536):
                        pass
                await stopping

    run(scenario())


def test_a_deeply_nested_body_or_a_lone_surrogate_is_never_a_500() -> None:
    """Two bodies a client can send that json.loads does not refuse with a ValueError: one
    nested past the parser's recursion limit (RecursionError: was aiohttp's bare 500) is a 400
    with the JSON error; a prompt holding a lone surrogate, which JSON allows as an escape and
    the balancer hashes as its bytes, is served (``str.encode`` refused it: a 500)."""

    async def scenario() -> None:
        async with SimServer(FAST) as sim, aiohttp.ClientSession() as session:
            deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
            for path, raw in [("/v1/chat/completions", deep), ("/v1/completions", b"[" * 50_000)]:
                async with session.post(sim.url + path, data=raw) as response:
                    assert response.status == 400, (path, response.status, await response.text())
                    assert isinstance((await response.json())["error"]["message"], str)
            lone = [
                ("/v1/completions", b'{"prompt": "a \\ud800 b", "max_tokens": 2}'),
                ("/v1/completions", b'{"prompt": ["\\udfff"], "max_tokens": 2, "stream": true}'),
                ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
                ("/generate", b'{"text": "\\ud83d", "sampling_params": {"max_new_tokens": 2}}'),
            ]
            for path, raw in lone:
                async with session.post(sim.url + path, data=raw) as response:
                    assert response.status == 200, (path, response.status, await response.text())
            status, _ = await post(session, sim.url + "/v1/completions", {"prompt": "fine"})
            assert status == 200

    run(scenario())


def test_metrics_use_vllm_names_and_the_model_label() -> None:
    async def scenario() -> None:
        async with SimServer(FAST, model="sim-x") as sim, aiohttp.ClientSession() as session:
            await post(session, sim.url + "/v1/completions", {"prompt": "hello"})
            async with session.get(sim.url + "/metrics") as response:
                text = await response.text()
            families = {f.name: f for f in text_string_to_metric_families(text)}
            kinds = {
                "vllm:num_requests_running": "gauge",
                "vllm:num_requests_waiting": "gauge",
                "vllm:kv_cache_usage_perc": "gauge",
                "vllm:gpu_cache_usage_perc": "gauge",
                "vllm:prefix_cache_queries": "counter",
                "vllm:prefix_cache_hits": "counter",
                "vllm:prompt_tokens": "counter",
                "vllm:generation_tokens": "counter",
                "vllm:request_success": "counter",
                "vllm:time_to_first_token_seconds": "histogram",
            }
            assert {name: families[name].type for name in kinds} == kinds
            labels = [s.labels["model_name"] for f in families.values() for s in f.samples]
            assert set(labels) == {"sim-x"} and len(labels) > len(kinds)
            assert 'vllm:generation_tokens_total{model_name="sim-x"} 16.0' in text
            async with session.get(sim.url + "/v1/models") as response:
                assert (await response.json())["data"][0]["id"] == "sim-x"
            async with session.get(sim.url + "/health") as response:
                assert response.status == 200

    run(scenario())


def test_a_client_that_hangs_up_frees_its_batch_slot() -> None:
    async def scenario() -> None:
        async with SimServer(FAST) as sim:
            scheduler = sim.engine.scheduler
            async with aiohttp.ClientSession() as session:
                body = {"prompt": "long one", "max_tokens": 20_000, "stream": True}
                async with session.post(sim.url + "/v1/completions", json=body) as response:
                    await response.content.readuntil(b"\n\n")
                    assert len(scheduler.running) == 1

            async def freed() -> bool:
                return not scheduler.running and scheduler.stats.requests_aborted == 1

            await until(freed, "the abandoned sequence aborted")
            assert scheduler.cache.in_use == 0

    run(scenario())


def test_the_command_line_serves_until_sigterm_and_the_example_spec_runs_it() -> None:
    fast = EngineConfig(speed=10, max_batch=3)
    argv = command(fast)
    assert argv[argv.index("--max-batch") + 1] == "3" and argv[argv.index("--speed") + 1] == "10"
    process, url = spawn(fast, model="cli-model")
    try:
        with urllib.request.urlopen(url + "/server_info", timeout=10) as response:
            assert json.load(response)["max_running_requests"] == 3
        request = urllib.request.Request(url + "/v1/completions", data=b'{"prompt": "hi"}')
        with urllib.request.urlopen(request, timeout=10) as response:
            assert json.load(response)["model"] == "cli-model"
    finally:
        process.terminate()
        assert process.wait(timeout=10) == 0

    # the spec's `run:` line, as corral runs it: a shell with $PORT set
    spec = load_spec(ROOT / "examples" / "llm-sim.yaml")
    assert spec.service.readiness_probe.path == "/health"
    assert spec.service.replica_policy.min_replicas == 2 and spec.run is not None
    env = dict(os.environ, PORT="0", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    shell = subprocess.Popen(["bash", "-c", spec.run], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert shell.stdout is not None
        assert select.select([shell.stdout], [], [], 20)[0], "the example printed nothing"
        assert shell.stdout.readline().startswith("corral.llmsim listening on http://127.0.0.1:")
    finally:
        shell.terminate()
        assert shell.wait(timeout=10) == 0


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--port", "99999"], "--port must be 0 to 65535, got 99999"),
        (["--port", "-1"], "--port must be 0 to 65535, got -1"),
        (["--host", "256.1.1.1", "--port", "0"], "cannot listen on 256.1.1.1:0"),
        (["--prefill-per-token-ms", "inf"], "prefill_per_token_ms must be a finite number"),
        (["--speed", "inf"], "speed must be a finite number above 0"),
    ],
)
def test_the_command_refuses_what_it_cannot_serve_in_one_line(argv: list[str], said: str) -> None:
    """`--port 99999` listened on 34463 (the OS takes it modulo 65536) and printed so, a
    script connecting to 99999 never found it; `-1` and a host that is no address ended in a
    traceback; an infinite prefill cost made every prompt wait forever."""
    run = subprocess.run(
        [sys.executable, "-m", "corral.llmsim", *argv],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert run.returncode != 0 and said in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and "listening" not in run.stdout
