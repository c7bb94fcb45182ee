"""Matched benchmark runner: the baseline (num_draft_tokens = 0) and each speculative
mode against the same server, prompts, sampling settings and max_tokens.

Schedule: for every load point (closed-loop concurrency c, or open-loop Poisson rate R)
the prompts are cut into blocks; every block is run once per mode, the order of the modes
rotating from block to block (and repeat to repeat), so slow drift of a shared machine
spreads over all modes instead of favouring whichever ran first. Each (block, mode) run
is timed by its own wall clock and bracketed by two scrapes of the server's Prometheus
counters (per-position acceptance). Warm-up requests run before any block and are not
recorded.
"""
from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Sequence

import specdec_wire as P

from specdec_client import server_metrics
from specdec_client.client import AsyncSpecDecClient, GenerateRequest
from specdec_client.datasets import Prompt, structured_valid
from specdec_client.endpoints import AsyncEndpointClient, Endpoint
from specdec_client.errors import SpecDecClientError
from specdec_client.metrics import Slo, Trace

BASELINE = "baseline"
METHOD_NONE = "none"  # the server's method label for plain decoding


class BenchConfigError(SpecDecClientError, ValueError):
    """A benchmark option is invalid; the message names it."""


@dataclass(frozen=True)
class Mode:
    """A decoding mode: (method, num_draft_tokens). num_draft_tokens None = the server's
    configured budget for that method; 0 = plain decoding (the matched baseline)."""

    name: str
    method: str | None
    num_draft_tokens: int | None
    # False: every request gets a salt of its own, so it reuses no cached prefix (the
    # "without the cache" side of a prefix-caching comparison, on the same server).
    prefix_cache: bool = True
    # Across deployments (--baseline / --candidate): the deployment this mode is sent to,
    # and which side it is. None: the --url server, whose baseline is plain decoding.
    endpoint: Endpoint | None = None
    baseline: bool | None = None

    @property
    def is_baseline(self) -> bool:
        return self.num_draft_tokens == 0 if self.baseline is None else self.baseline

    @property
    def metrics_method(self) -> str:
        """The `method` label of this mode's series on the metrics port."""
        return METHOD_NONE if self.is_baseline else (self.method or "")


NO_CACHE = "/no-cache"
PREFIX_CACHE_CHOICES = ("on", "off", "both")


def parse_modes(methods: Sequence[str], prefix_cache: str = "on") -> list[Mode]:
    """'ngram', 'ngram:6' (6 draft tokens) -> modes; the baseline always comes first.
    prefix_cache "off": every mode without the prefix cache ("<name>/no-cache"); "both":
    each mode with it and then without it."""
    if prefix_cache not in PREFIX_CACHE_CHOICES:
        raise BenchConfigError(f"--prefix-cache must be one of {', '.join(PREFIX_CACHE_CHOICES)}, got {prefix_cache!r}")
    modes = _parse_modes(methods)
    if prefix_cache == "on":
        return modes
    uncached = [replace(m, name=m.name + NO_CACHE, prefix_cache=False) for m in modes]
    return uncached if prefix_cache == "off" else [x for pair in zip(modes, uncached) for x in pair]


def _parse_modes(methods: Sequence[str]) -> list[Mode]:
    modes = [Mode(BASELINE, None, 0)]
    for item in methods:
        item = item.strip()
        if not item or item == BASELINE:
            continue
        method, _, k = item.partition(":")
        if k:
            if not k.isdigit() or int(k) < 1:
                raise BenchConfigError(f"--methods: {item!r}: draft tokens after ':' must be a positive integer")
            mode = Mode(f"{method}:{int(k)}", method, int(k))
        else:
            mode = Mode(method, method, None)
        if mode.name in {m.name for m in modes}:
            raise BenchConfigError(f"--methods: {item!r} is listed twice")
        modes.append(mode)
    return modes


def endpoint_modes(baseline: Endpoint, candidates: Sequence[Endpoint], prefix_cache: str = "on") -> list[Mode]:
    """Deployments side by side: the baseline's mode first, then each candidate's."""
    names = [baseline.label or BASELINE] + [ep.label or ("candidate" if len(candidates) == 1 else f"candidate{i + 1}")
                                            for i, ep in enumerate(candidates)]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise BenchConfigError(f"--baseline and --candidate share the name {repeated[0]!r}; give each a name=LABEL")
    if prefix_cache not in PREFIX_CACHE_CHOICES:
        raise BenchConfigError(f"--prefix-cache must be one of {', '.join(PREFIX_CACHE_CHOICES)}, got {prefix_cache!r}")
    modes = [Mode(name, ep.method, ep.num_draft_tokens, endpoint=ep, baseline=i == 0)
             for i, (name, ep) in enumerate(zip(names, [baseline, *candidates]))]
    if prefix_cache == "on":
        return modes
    uncached = [replace(m, name=m.name + NO_CACHE, prefix_cache=False) for m in modes]
    return uncached if prefix_cache == "off" else [x for pair in zip(modes, uncached) for x in pair]


@dataclass(frozen=True)
class LoadPoint:
    concurrency: int | None = None  # closed loop: this many requests in flight
    request_rate: float | None = None  # open loop: Poisson arrivals per second

    @property
    def label(self) -> str:
        return f"c={self.concurrency}" if self.request_rate is None else f"rate={self.request_rate:g}/s"


@dataclass(frozen=True)
class BenchConfig:
    url: str
    protocol: str
    modes: tuple[Mode, ...]
    loads: tuple[LoadPoint, ...]
    model: str = "ensemble"
    metrics_url: str | None = None
    max_tokens: int = 128
    ignore_eos: bool = True
    temperature: float | None = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = 0
    stop: tuple[str, ...] = ()
    repeats: int = 1
    block_size: int | None = None  # None: max(8, 2 x concurrency)
    prompts_per_concurrency: int | None = None  # None: every prompt at every load
    warmup: int = 2  # requests per mode, not recorded
    timeout_s: float = 600.0
    arrival_seed: int = 0
    # A service-level objective for goodput (requests within both limits per second) and
    # the rate each mode sustains; None: not judged.
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    slo_attainment: float = 0.9  # a rate is sustained when this share of its requests met the SLO
    prefix_cache: str = "on"  # as the modes were made (parse_modes)
    # Conversations (Prompt.turns) are rendered by the target's chat template here, client
    # side, the model's own answers included: messages -> prompt text. Not recorded.
    render_chat: Any = field(default=None, compare=False, repr=False)
    # Across deployments every prompt is rendered here too (one user message), and sent as
    # raw text: each side then tokenizes the same text, whatever template it would apply.
    render_prompts: bool = False
    # Output tokens of a side that does not count them (a stock ensemble): its text counted
    # by the target's tokenizer. Not recorded.
    count_tokens: Any = field(default=None, compare=False, repr=False)
    # Both sides serve the same model: greedy outputs are compared (lossless in summary.json).
    compare_outputs: bool = True

    def __post_init__(self):
        if not self.modes or not self.modes[0].is_baseline:
            raise BenchConfigError("modes: the first mode must be the baseline")
        if not self.loads:
            raise BenchConfigError("give --concurrency and/or --request-rate")
        for load in self.loads:
            if load.concurrency is not None and load.concurrency < 1:
                raise BenchConfigError(f"--concurrency must be >= 1, got {load.concurrency}")
            if load.request_rate is not None and not load.request_rate > 0:
                raise BenchConfigError(f"--request-rate must be > 0, got {load.request_rate}")
        for name in ("max_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise BenchConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.block_size is not None and self.block_size < 1:
            raise BenchConfigError(f"--block-size must be >= 1, got {self.block_size}")
        if self.prompts_per_concurrency is not None and self.prompts_per_concurrency < 1:
            raise BenchConfigError(f"--prompts-per-concurrency must be >= 1, got {self.prompts_per_concurrency}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise BenchConfigError(f"--{name.replace('_', '-')} must be > 0, got {value}")
        if not 0 < self.slo_attainment <= 1:
            raise BenchConfigError(f"--slo-attainment must be in (0, 1], got {self.slo_attainment}")

    @property
    def slo(self) -> "Slo | None":
        if self.slo_ttft_ms is None and self.slo_tpot_ms is None:
            return None
        return Slo(None if self.slo_ttft_ms is None else self.slo_ttft_ms / 1e3,
                   None if self.slo_tpot_ms is None else self.slo_tpot_ms / 1e3)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def request(self, mode: Mode, prompt: Prompt, cache_salt: str | None = None, text: str | None = None) -> GenerateRequest:
        """text: the rendered conversation (sent without the server's chat template)."""
        return GenerateRequest(
            prompt.text if text is None else text, max_tokens=prompt.max_tokens or self.max_tokens, temperature=self.temperature,
            top_k=self.top_k, top_p=self.top_p, seed=self.seed, stop=self.stop, method=mode.method,
            num_draft_tokens=mode.num_draft_tokens, ignore_eos=self.ignore_eos,
            guide_type=prompt.guide_type, guide=prompt.guide, cache_salt=cache_salt,
            apply_chat_template=False if text is not None or prompt.raw else None,
        )

    def as_dict(self) -> dict[str, Any]:
        out = asdict(replace(self, render_chat=None, count_tokens=None))
        del out["render_chat"], out["count_tokens"]
        out["modes"] = [{**asdict(m), "endpoint": None if m.endpoint is None else m.endpoint.describe()} for m in self.modes]
        out["loads"] = [{**asdict(load), "label": load.label} for load in self.loads]
        out["stop"] = list(self.stop)
        return out


# ---- schedule ----------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockPlan:
    load: LoadPoint
    repeat: int
    block: int
    mode: Mode
    prompt_indices: tuple[int, ...]


MIN_BLOCK = 8  # prompts in the smallest automatic block


def block_size(config: BenchConfig, load: LoadPoint, count: int | None = None) -> int:
    """Prompts per block. Automatic: max(8, 2 x concurrency); when the load runs only `count`
    prompts (prompts_per_concurrency), at most half of them, so that it still has two
    paired blocks and a noise estimate."""
    if config.block_size is not None:
        return config.block_size
    size = max(MIN_BLOCK, 2 * (load.concurrency or 1))
    if config.prompts_per_concurrency is not None and count is not None:
        size = min(size, max(MIN_BLOCK, count // 2))
    return size


def prompts_at(config: BenchConfig, load: LoadPoint, num_prompts: int) -> int:
    """How many of the prompts a load point runs. With `prompts_per_concurrency` K, a
    closed-loop load c runs K x c of them (at least two minimal blocks): a sweep over
    c = 1..32 then spends its time evenly over the loads instead of mostly at c = 1 (with
    K = 2 every point from c = 8 up is two blocks of one wave each)."""
    if config.prompts_per_concurrency is None or load.concurrency is None:
        return num_prompts
    return min(num_prompts, max(2 * MIN_BLOCK, config.prompts_per_concurrency * load.concurrency))


def schedule(config: BenchConfig, num_prompts: int) -> list[BlockPlan]:
    """Blocks in execution order: per load point, per (repeat, block), every mode once,
    the mode order rotated by one each time."""
    plans = []
    for load in config.loads:
        count = prompts_at(config, load, num_prompts)
        size = min(block_size(config, load, count), count)
        blocks = [tuple(range(i, min(i + size, count))) for i in range(0, count, size)]
        unit = 0
        for repeat in range(config.repeats):
            for index, prompts in enumerate(blocks):
                shift = unit % len(config.modes)
                for mode in config.modes[shift:] + config.modes[:shift]:
                    plans.append(BlockPlan(load, repeat, index, mode, prompts))
                unit += 1
    return plans


def poisson_arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """Seconds from the block start at which each of n requests is sent."""
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# ---- records -----------------------------------------------------------------------------
@dataclass
class RequestRecord:
    mode: str
    concurrency: int | None
    request_rate: float | None
    repeat: int
    block: int
    prompt_index: int
    send: float  # perf_counter seconds; written relative to the benchmark start
    chunks: list[float]
    end: float
    output_tokens: int
    verification_steps: int
    accepted: int
    drafted: int
    output_tokens_from_server: bool
    text: str
    error: str | None
    forced: int = 0  # of `accepted`, the tokens the request's grammar forced (structured output)
    valid: bool | None = None  # the output satisfies the prompt's guide (None: no guide, or failed)
    turn: int = 0  # of a conversation (0: its first user message, or a plain prompt)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (num_cached_tokens)

    def trace(self) -> Trace:
        return Trace(self.send, self.chunks, self.end, self.output_tokens, self.verification_steps,
                     self.accepted, self.drafted, self.error)

    def as_json(self, t0: float) -> dict[str, Any]:
        out = asdict(self)
        out["send"] = round(self.send - t0, 6)
        out["end"] = round(self.end - t0, 6)
        out["chunks"] = [round(c - t0, 6) for c in self.chunks]
        return out


@dataclass
class BlockResult:
    plan: BlockPlan
    start: float
    end: float
    records: list[RequestRecord]
    metrics_delta: dict | None  # Prometheus counter deltas; None when the scrape failed

    @property
    def wall_s(self) -> float:
        return self.end - self.start


@dataclass
class BenchResult:
    config: BenchConfig
    t0: float  # perf_counter at the start (timestamps in requests.jsonl are relative to it)
    started_unix: float
    blocks: list[BlockResult] = field(default_factory=list)
    metrics_error: str | None = None

    @property
    def records(self) -> list[RequestRecord]:
        return [r for b in self.blocks for r in b.records]


# ---- running -----------------------------------------------------------------------------
def cache_salt(run_id: str, plan: BlockPlan) -> str:
    """The prefix-cache scope of a request: one per (load, mode, repeat) of this run, so no
    mode reuses the KV another mode computed for the same prompts (each mode's own requests
    share it, as production traffic does: a common system prompt, a conversation's history);
    without the cache, one per request."""
    if not plan.mode.prefix_cache:
        return f"bench:{run_id}:{uuid.uuid4().hex}"
    return f"bench:{run_id}:{plan.load.label}:{plan.mode.name}:{plan.repeat}"


async def run_prompt(client: AsyncSpecDecClient, config: BenchConfig, plan: BlockPlan, index: int,
                     prompt: Prompt, run_id: str) -> list[RequestRecord]:
    """One record per request: a plain prompt's one, or a conversation's turns in order
    (each sends the history with the answers so far; a failed turn ends the conversation)."""
    if not prompt.turns:
        text = config.render_chat([{"role": "user", "content": prompt.text}]) if config.render_prompts and config.render_chat else None
        return [await one_request(client, config, plan, index, prompt, cache_salt(run_id, plan), text)]
    if config.render_chat is None:
        raise BenchConfigError("conversations need the target's chat template (its tokenizer could not be loaded)")
    history: list[dict[str, str]] = []
    records = []
    for turn, message in enumerate(prompt.messages):
        history.append({"role": "user", "content": message})
        record = await one_request(client, config, plan, index, prompt, cache_salt(run_id, plan), config.render_chat(history), turn)
        records.append(record)
        if record.error is not None:
            break
        history.append({"role": "assistant", "content": record.text})
    return records


async def one_request(client: AsyncSpecDecClient, config: BenchConfig, plan: BlockPlan, index: int,
                      prompt: Prompt, salt: str | None = None, text: str | None = None, turn: int = 0) -> RequestRecord:
    chunks, texts, perf, error = [], [], {}, None
    send = time.perf_counter()
    try:
        async for chunk in client.stream(config.request(plan.mode, prompt, salt, text)):
            if chunk.text:
                texts.append(chunk.text)
                chunks.append(chunk.time)
            perf.update(chunk.perf)
    except Exception as exc:  # noqa: BLE001 - a failed request is a result, not a crash
        error = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()
    from_server = P.OUTPUT_TOKENS in perf
    if from_server:
        output_tokens = int(perf[P.OUTPUT_TOKENS])
    elif config.count_tokens is not None and error is None:
        output_tokens = config.count_tokens("".join(texts))
    else:
        output_tokens = len(chunks)
    return RequestRecord(
        mode=plan.mode.name, concurrency=plan.load.concurrency, request_rate=plan.load.request_rate,
        repeat=plan.repeat, block=plan.block, prompt_index=index, send=send, chunks=chunks, end=end,
        output_tokens=output_tokens,
        verification_steps=int(perf.get("verification_steps", 0)),
        accepted=int(perf.get(P.TOTAL_ACCEPTED_DRAFT_TOKENS, 0)), drafted=int(perf.get(P.TOTAL_DRAFT_TOKENS, 0)),
        output_tokens_from_server=from_server, text="".join(texts), error=error,
        forced=int(perf.get(P.TOTAL_ACCEPTED_FORCED_TOKENS, 0)),
        valid=None if error else structured_valid(prompt, "".join(texts)),
        turn=turn, cached_tokens=int(perf.get(P.NUM_CACHED_TOKENS, 0)),
    )


async def closed_loop(client, config, plan, prompts, done: Callable[[], None], run_id: str = "") -> list[RequestRecord]:
    """`concurrency` workers, each sending its next request as soon as the last one ends."""
    pending = list(plan.prompt_indices)
    records: list[RequestRecord] = []

    async def worker():
        while pending:
            index = pending.pop(0)
            records.extend(await run_prompt(client, config, plan, index, prompts[index], run_id))
            done()

    await asyncio.gather(*(worker() for _ in range(min(plan.load.concurrency, len(pending)))))
    return records


async def open_loop(client, config, plan, prompts, done: Callable[[], None], rng: random.Random,
                    run_id: str = "") -> list[RequestRecord]:
    """Requests sent at seeded Poisson arrival times, however many are still in flight."""
    start = time.perf_counter()

    async def send_at(offset: float, index: int) -> list[RequestRecord]:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        records = await run_prompt(client, config, plan, index, prompts[index], run_id)
        done()
        return records

    arrivals = poisson_arrivals(len(plan.prompt_indices), plan.load.request_rate, rng)
    sent = await asyncio.gather(*(send_at(t, i) for t, i in zip(arrivals, plan.prompt_indices)))
    return [r for records in sent for r in records]


async def _scrape(url: str | None):
    if url is None:
        return None
    return await asyncio.to_thread(server_metrics.scrape, url)


WARMUP_MAX_TOKENS = 16


async def warm_up(clients: dict, config: BenchConfig, prompts: Sequence[Prompt]) -> None:
    """A few short requests per mode (first-request costs, caches); not recorded."""
    for mode in config.modes:
        for i in range(config.warmup):
            prompt = prompts[i % len(prompts)]
            short = Prompt(prompt.text, min(WARMUP_MAX_TOKENS, prompt.max_tokens or config.max_tokens))
            await clients[mode.endpoint].generate(config.request(mode, short, cache_salt=f"warm-up:{uuid.uuid4().hex}"))


async def open_clients(stack: contextlib.AsyncExitStack, config: BenchConfig) -> dict:
    """One client per deployment the modes name (None: the --url server), opened once."""
    clients = {}
    for endpoint in dict.fromkeys(m.endpoint for m in config.modes):
        client = (AsyncSpecDecClient(config.url, config.protocol, config.model, config.timeout_s) if endpoint is None
                  else AsyncEndpointClient(endpoint, config.timeout_s))
        clients[endpoint] = await stack.enter_async_context(client)
    return clients


async def run_bench(config: BenchConfig, prompts: Sequence[Prompt], on_request: Callable[[], None] = lambda: None,
                    on_block: Callable[[BlockPlan], None] = lambda plan: None) -> BenchResult:
    if not prompts:
        raise BenchConfigError("no prompts")
    async with contextlib.AsyncExitStack() as stack:
        clients = await open_clients(stack, config)
        await warm_up(clients, config, prompts)
        result = BenchResult(config, time.perf_counter(), time.time())
        rng = random.Random(config.arrival_seed)
        run_id = uuid.uuid4().hex[:12]
        for plan in schedule(config, len(prompts)):
            on_block(plan)
            client = clients[plan.mode.endpoint]
            metrics_url = config.metrics_url if plan.mode.endpoint is None else plan.mode.endpoint.metrics_url
            before = await _scrape_or_none(result, metrics_url)
            start = time.perf_counter()
            if plan.load.request_rate is None:
                records = await closed_loop(client, config, plan, prompts, on_request, run_id)
            else:
                records = await open_loop(client, config, plan, prompts, on_request, rng, run_id)
            end = time.perf_counter()
            after = await _scrape_or_none(result, metrics_url)
            delta = server_metrics.delta(before, after) if before is not None and after is not None else None
            result.blocks.append(BlockResult(plan, start, end, sorted(records, key=lambda r: r.send), delta))
    return result


async def _scrape_or_none(result: BenchResult, url: str | None):
    try:
        return await _scrape(url)
    except SpecDecClientError as exc:
        result.metrics_error = str(exc)
        return None
