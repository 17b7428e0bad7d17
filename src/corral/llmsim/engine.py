"""The simulated engine: continuous batching over a prefix KV cache, on real time, with no model.

Why simulate: an LLM router is judged by how the engines behind it queue, batch and cache, not
by what they write. These classes reproduce those costs and nothing else, so routing can be
measured on a machine with no GPU and no weights:

* Tokens and the prefix KV cache (vLLM's chained block hashes, LRU eviction) are
  :mod:`corral.llmsim.cache`.
* :class:`Scheduler` is continuous batching without a clock of its own: at most ``max_batch``
  sequences run, the rest wait first come first served. A step admits what fits, lasts
  ``step_base + step_per_seq * batch + prefill_per_token * uncached prompt tokens admitted``
  (prefill is charged to the step that admits a sequence, as chunked prefill would, so it slows
  every running sequence too) and gives every running sequence one token.
* :class:`Engine` drives the scheduler with real asyncio sleeps, so the TTFT a client measures is
  queueing plus prefill, as with a real engine; ``speed`` divides every duration.

A sequence reserves KV blocks for its whole length (prompt plus ``max_tokens``) when admitted and
is admitted only when they fit, so nothing is ever preempted (vLLM would grow it block by block
and preempt under pressure). Output is ``max_tokens`` meaningless tokens, never an early stop.
When a text prompt's sequence finishes, the full blocks of its answer stay cached after its
prompt's, as real engines keep what they generated (vLLM hashes each output block as it fills,
SGLang inserts the whole sequence in its radix tree): a chat's next turn on the replica that
wrote the previous answer computes only its new message.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import math
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, fields
from types import TracebackType

from corral.llmsim.cache import PrefixCache, Rejected, answered, block_hashes, token_count

WAITING, RUNNING, FINISHED, ABORTED = "waiting", "running", "finished", "aborted"

# vLLM's buckets for vllm:time_to_first_token_seconds, so dashboards made for it read ours.
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip


class Closed(RuntimeError):
    """The engine is stopping: the HTTP layer answers 503, as a draining replica would."""


@dataclass(frozen=True)
class EngineConfig:
    """The engine's knobs; each field is a command-line flag of the same name (``--block-size``),
    so a benchmark's config and a replica's command line cannot drift apart."""

    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    cache_blocks: int = field(default=2048, metadata={"help": "KV cache capacity in blocks"})
    max_batch: int = field(default=8, metadata={"help": "most sequences running at once"})
    step_base_ms: float = field(default=10.0, metadata={"help": "fixed time of a decode step"})
    step_per_seq_ms: float = field(default=1.0, metadata={"help": "step time per running seq"})
    prefill_per_token_ms: float = field(
        default=0.2, metadata={"help": "step time per uncached prompt token admitted"}
    )
    speed: float = field(default=1.0, metadata={"help": "divides every duration (10 = 10x)"})

    def __post_init__(self) -> None:
        for name in ("block_size", "cache_blocks", "max_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in ("step_base_ms", "step_per_seq_ms", "prefill_per_token_ms"):
            if not 0 <= getattr(self, name) < math.inf:  # inf: every prompt waits forever
                raise ValueError(f"{name} must be a finite number, 0 or more")
        if not 0 < self.speed < math.inf:
            raise ValueError("speed must be a finite number above 0")

    def step_seconds(self, batch: int, prefill_tokens: int) -> float:
        ms = self.step_base_ms + self.step_per_seq_ms * batch
        return (ms + self.prefill_per_token_ms * prefill_tokens) / 1000.0 / self.speed

    def argv(self) -> list[str]:
        """These knobs as ``python -m corral.llmsim`` flags."""
        out = []
        for knob in fields(self):
            out += [f"--{knob.name.replace('_', '-')}", str(getattr(self, knob.name))]
        return out


@dataclass
class Histogram:
    """Counts per bucket, kept by the engine so it needs no metrics library to be tested."""

    bounds: tuple[float, ...] = TTFT_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(TTFT_BUCKETS) + 1))
    total: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, float]]:
        """Prometheus ``le`` buckets, the last one ``+Inf``."""
        names = [*(repr(bound) for bound in self.bounds), "+Inf"]
        return list(zip(names, itertools.accumulate(self.counts), strict=True))


@dataclass
class EngineStats:
    """Monotonic counters (tokens unless said otherwise), what vLLM exports and a bit more."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    requests_success: int = 0
    requests_aborted: int = 0
    steps: int = 0
    peak_running: int = 0
    ttft: Histogram = field(default_factory=Histogram)


@dataclass(eq=False)
class Sequence:
    """One prompt being served. Times are on the scheduler's clock (``loop.time()`` under
    :class:`Engine`), so TTFT is measured where a real engine measures it."""

    seq_id: int
    prompt_tokens: int
    max_tokens: int
    hashes: list[bytes]
    private_blocks: int
    submitted_at: float
    notify: Callable[[Sequence], None] | None = None
    # The prompt when it is a text (its answer continues it); None for token ids, whose
    # continuation in the client's own tokens cannot be known.
    text: bytes | None = None
    state: str = WAITING
    cached_tokens: int = 0
    generated: int = 0
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def done(self) -> bool:
        return self.state in (FINISHED, ABORTED)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at


class Scheduler:
    """Waiting queue, running batch and cache, advanced by explicit steps with no clock of its own,
    so what a step admits, costs and emits is testable without sleeping."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.cache = PrefixCache(config.cache_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = EngineStats()
        self._ids = itertools.count()

    def check(self, prompt: bytes, max_tokens: int) -> None:
        """Refuse what could never run: a sequence longer than the whole cache would wait
        forever at the head of the queue and stall everything behind it."""
        tokens = token_count(prompt)
        if tokens < 1:
            raise Rejected("the prompt is empty")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise Rejected("max_tokens must be a positive integer")
        needed = -(-(tokens + max_tokens) // self.config.block_size)
        if needed > self.config.cache_blocks:
            raise Rejected(
                f"prompt ({tokens} tokens) plus max_tokens ({max_tokens}) needs {needed} KV"
                f" blocks; the cache holds {self.config.cache_blocks}"
            )

    def submit(
        self,
        prompt: bytes,
        max_tokens: int,
        now: float,
        notify: Callable[[Sequence], None] | None = None,
        text: bool = True,
    ) -> Sequence:
        """Queue a prompt; ``text`` False for token ids (their answer is not cached)."""
        self.check(prompt, max_tokens)
        size, tokens = self.config.block_size, token_count(prompt)
        hashes = block_hashes(prompt, size)
        private = -(-(tokens + max_tokens) // size) - len(hashes)
        seq = Sequence(next(self._ids), tokens, max_tokens, hashes, private, now, notify)
        seq.text = prompt if text else None
        self.waiting.append(seq)
        return seq

    def begin_step(self, now: float) -> float:
        """Admit from the head of the queue while the batch and the cache have room (first come
        first served: a head that does not fit blocks the rest); return the step's seconds."""
        prefill = 0
        while self.waiting and len(self.running) < self.config.max_batch:
            head = self.waiting[0]
            if not self.cache.fits(head.hashes, head.private_blocks):
                break
            self.waiting.popleft()
            prefill += self._admit(head, now)
        self.stats.peak_running = max(self.stats.peak_running, len(self.running))
        return self.config.step_seconds(len(self.running), prefill)

    def _admit(self, seq: Sequence, now: float) -> int:
        """Start a sequence; return its prompt tokens to prefill. As in vLLM, the last prompt
        token is always computed, so a fully cached prompt still misses its last block."""
        size = self.config.block_size
        hits = self.cache.prefix_blocks(seq.hashes, (seq.prompt_tokens - 1) // size)
        self.cache.acquire(seq.hashes, seq.private_blocks)
        seq.cached_tokens = hits * size
        seq.state, seq.admitted_at = RUNNING, now
        self.running.append(seq)
        self.stats.prefix_queries += seq.prompt_tokens
        self.stats.prefix_hits += seq.cached_tokens
        self.stats.prompt_tokens += seq.prompt_tokens
        return seq.prompt_tokens - seq.cached_tokens

    def end_step(self, now: float) -> list[Sequence]:
        """Give every running sequence its token; return the ones that finished."""
        advanced, finished = self.running, []
        for seq in advanced:
            seq.generated += 1
            if seq.first_token_at is None:
                seq.first_token_at = now
                self.stats.ttft.observe(now - seq.submitted_at)
            if seq.generated >= seq.max_tokens:
                self.cache.release(seq.hashes, seq.private_blocks, self._answer_blocks(seq))
                seq.state, seq.finished_at = FINISHED, now
                self.stats.requests_success += 1
                finished.append(seq)
        self.stats.generation_tokens += len(advanced)
        self.stats.steps += 1
        self.running = [seq for seq in advanced if seq.state == RUNNING]
        for seq in advanced:
            if seq.notify is not None:
                seq.notify(seq)
        return finished

    def _answer_blocks(self, seq: Sequence) -> list[bytes]:
        """The full blocks of a finished text prompt and its answer past those it shares with
        the prompt's own (the prompt's padded last full block, if any, is among them)."""
        if seq.text is None:
            return []
        whole = block_hashes(answered(seq.text, seq.generated), self.config.block_size)
        same = 0
        for mine, theirs in zip(seq.hashes, whole, strict=False):
            if mine != theirs:
                break
            same += 1
        return whole[same:]

    def abort(self, seq: Sequence) -> None:
        """Drop a sequence whose client left, giving its batch slot and blocks back."""
        if seq.state == WAITING:
            self.waiting.remove(seq)
        elif seq.state == RUNNING:
            self.running.remove(seq)
            self.cache.release(seq.hashes, seq.private_blocks)
        else:
            return
        seq.state = ABORTED
        self.stats.requests_aborted += 1


class Engine:
    """The scheduler on real time: one asyncio task runs steps back to back while there is work
    and sleeps on an event when there is none (an idle engine costs no CPU)."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.scheduler = Scheduler(self.config)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def stats(self) -> EngineStats:
        return self.scheduler.stats

    def start(self) -> None:
        """Start stepping; call on the loop that will serve requests."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop stepping and abort every sequence, waking whoever waits on them."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        left = [*self.scheduler.waiting, *self.scheduler.running]
        for seq in left:
            self.scheduler.abort(seq)
            if seq.notify is not None:
                seq.notify(seq)

    def generate(self, prompts: Seq[bytes], max_tokens: int, text: bool = True) -> Generation:
        """Submit one request's prompts together (all or none: each is checked first);
        ``text`` False for prompts of token ids."""
        if self._closed or self._task is None:
            raise Closed("the engine is not running")
        for prompt in prompts:
            self.scheduler.check(prompt, max_tokens)
        generation = Generation(self)
        now = asyncio.get_running_loop().time()
        for prompt in prompts:
            seq = self.scheduler.submit(prompt, max_tokens, now, generation.wake, text)
            generation.sequences.append(seq)
        self._wake.set()
        return generation

    def abort(self, seq: Sequence) -> None:
        self.scheduler.abort(seq)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        scheduler = self.scheduler
        while True:
            start = loop.time()
            seconds = scheduler.begin_step(start)
            if not scheduler.running:
                self._wake.clear()
                await self._wake.wait()
                continue
            await asyncio.sleep(max(0.0, start + seconds - loop.time()))
            scheduler.end_step(loop.time())


class Generation:
    """One request's sequences as its handler reads them: the tokens made since its last read,
    and, on leaving its ``with`` block for any reason, the abort of what is unfinished."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.sequences: list[Sequence] = []
        self._event = asyncio.Event()
        self._sent: dict[int, int] = {}

    def wake(self, _seq: Sequence) -> None:
        self._event.set()

    async def next(self) -> list[tuple[Sequence, int]]:
        """New ``(sequence, position)`` tokens in order; empty once every sequence is done."""
        while True:
            self._event.clear()
            out = []
            for seq in self.sequences:
                sent = self._sent.get(seq.seq_id, 0)
                out += [(seq, position) for position in range(sent, seq.generated)]
                self._sent[seq.seq_id] = seq.generated
            if out or all(seq.done for seq in self.sequences):
                return out
            await self._event.wait()

    async def wait(self) -> None:
        while await self.next():
            pass

    @property
    def aborted(self) -> bool:
        return any(seq.state == ABORTED for seq in self.sequences)

    def close(self) -> None:
        for seq in self.sequences:
            self.engine.abort(seq)

    def __enter__(self) -> Generation:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
