"""Locust load test of the speculative-decoding server, built on specdec_client.

Each request streams (gRPC by default; HTTP SSE with --specdec-protocol http) and fires
one Locust request event (request_type "gRPC"/"HTTP", response_time = E2E ms,
response_length = output tokens): the only thing Locust counts as a request, so the
Aggregated row counts real requests. Its timings, TTFT, per-token ITL (= TPOT) and the
inter-chunk latency (see loadtest/timings.py), are logged into stats entries of their own
(Type "TTFT", "ITL", "TPOT", "inter-chunk"; Name = the mode), which show up in Locust's
stats, CSV and HTML but stay out of the Aggregated row (see log_timings).

Conversations (--specdec-dataset sharegpt-multiturn): a user sends a conversation's turns in
order, each with the whole history (the model's own answers included, rendered by the
target's chat template), and each turn's TTFT is also logged under "<mode> turn <n>".
Repeated tasks: --specdec-dataset jsonl --specdec-dataset-path data/repeated/tasks.jsonl.

Scenarios (ScenarioShape, --specdec-scenario / SPECDEC_SCENARIO): concurrency_1 and
production; see loadtest/scenarios.py. The decoding mode is --specdec-method and
--specdec-num-draft-tokens (0 = the baseline), so the same scenario runs both. Distributed
workers each send the prompts in an order of their own (scenarios.prompt_order, seeded by the
worker's Locust index); a standalone run keeps the data set's order.

    locust -f loadtest/locustfile.py --headless --stop-timeout 60s --specdec-duration 60s \
        --specdec-scenario production --specdec-url localhost:8001 --specdec-method ngram \
        --csv results/loadtest/prod
"""
from __future__ import annotations

import locust  # noqa: F401 - imported first: it monkey-patches the standard library for gevent

from grpc.experimental import gevent as grpc_gevent

grpc_gevent.init_gevent()  # before any gRPC channel exists: make gRPC cooperative with gevent

import itertools  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402

import gevent.lock  # noqa: E402
from locust import LoadTestShape, User, constant, events, task  # noqa: E402
from locust.runners import Runner, WorkerRunner  # noqa: E402
from locust.stats import RequestStats  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `loadtest` when run as locust -f
from loadtest import scenarios, timings  # noqa: E402
from specdec_client import GenerateRequest, SpecDecClient  # noqa: E402
from specdec_client import datasets as D  # noqa: E402
from specdec_client import metrics as M  # noqa: E402
from specdec_client.errors import SpecDecClientError  # noqa: E402
import specdec_wire as P  # noqa: E402


@events.init_command_line_parser.add_listener
def add_options(parser):
    g = parser.add_argument_group("specdec")
    g.add_argument("--specdec-scenario", choices=scenarios.SCENARIOS, default="concurrency_1", env_var="SPECDEC_SCENARIO")
    g.add_argument("--specdec-url", default="", env_var="SPECDEC_URL", help="host:port (default --host, else localhost:8001)")
    g.add_argument("--specdec-protocol", choices=("grpc", "http"), default="grpc", env_var="SPECDEC_PROTOCOL")
    g.add_argument("--specdec-model", default="ensemble", env_var="SPECDEC_MODEL")
    g.add_argument("--specdec-method", default="", env_var="SPECDEC_METHOD", help="empty = the server's default method")
    g.add_argument("--specdec-num-draft-tokens", default="", env_var="SPECDEC_NUM_DRAFT_TOKENS",
                   help="0 = plain decoding (the baseline); empty = the method's configured budget")
    g.add_argument("--specdec-max-tokens", type=int, default=128, env_var="SPECDEC_MAX_TOKENS")
    g.add_argument("--specdec-ignore-eos", default="true", env_var="SPECDEC_IGNORE_EOS", help="true/false")
    g.add_argument("--specdec-temperature", type=float, default=0.0, env_var="SPECDEC_TEMPERATURE")
    g.add_argument("--specdec-dataset", choices=D.DATASETS, default="sharegpt", env_var="SPECDEC_DATASET")
    g.add_argument("--specdec-dataset-path", default="", env_var="SPECDEC_DATASET_PATH")
    g.add_argument("--specdec-num-prompts", type=int, default=64, env_var="SPECDEC_NUM_PROMPTS")
    g.add_argument("--specdec-seed", type=int, default=0, env_var="SPECDEC_SEED")
    g.add_argument("--specdec-turns", type=int, default=4, env_var="SPECDEC_TURNS", help="sharegpt-multiturn: turns")
    g.add_argument("--specdec-cache-salt", default="", env_var="SPECDEC_CACHE_SALT",
                   help="prefix-cache scope of every request (empty: the shared scope; 'unique': one per request, "
                        "so nothing is reused: the without-cache side of a comparison)")
    g.add_argument("--specdec-users", type=int, default=scenarios.DEFAULT_PRODUCTION_USERS, env_var="SPECDEC_USERS",
                   help="production: peak users")
    g.add_argument("--specdec-ramp-steps", type=int, default=scenarios.DEFAULT_RAMP_STEPS, env_var="SPECDEC_RAMP_STEPS")
    g.add_argument("--specdec-duration", default="120s", env_var="SPECDEC_DURATION",
                   help="scenario length (-t, if given, wins but kills requests in flight at the deadline)")


def mode_of(options) -> tuple[str, str | None, int | None]:
    """(stats entry name, method, num_draft_tokens) from the options."""
    return scenarios.mode(options.specdec_method, options.specdec_num_draft_tokens)


_prompts: list | None = None
_render = None
_prompt_lock = gevent.lock.Semaphore()
_counter = itertools.count()


def prompts_for(options) -> list:
    """The prompt list, loaded once per process (master and every worker load their own)."""
    global _prompts
    with _prompt_lock:
        if _prompts is None:
            _prompts = D.load(options.specdec_dataset, options.specdec_num_prompts, options.specdec_seed,
                              options.specdec_dataset_path or None, turns=options.specdec_turns).prompts
    return _prompts


def chat_renderer():
    """The target's chat template (messages -> text), loaded once per process."""
    global _render
    with _prompt_lock:
        if _render is None:
            _render = D.chat_renderer()
            if _render is None:
                raise SpecDecClientError("conversations need the target's tokenizer (its chat template)")
    return _render


def worker_index(runner: Runner | None) -> int | None:
    """This worker's Locust index (the master assigns 0..N-1 as workers join, before any user
    starts); None outside a distributed run's workers."""
    if isinstance(runner, WorkerRunner) and runner.worker_index >= 0:
        return runner.worker_index
    return None


def ordered_prompts(environment) -> list:
    """The prompts in this load generator's order (scenarios.prompt_order): the data set's
    order when standalone, a permutation of its own on each distributed worker."""
    opts = environment.parsed_options
    prompts = prompts_for(opts)
    return [prompts[i] for i in scenarios.prompt_order(len(prompts), opts.specdec_seed, worker_index(environment.runner))]


class SpecDecUser(User):
    """One simulated user: sequential streaming requests, no think time."""

    wait_time = constant(0)

    def on_start(self):
        opts = self.environment.parsed_options
        self.url = opts.specdec_url or (self.environment.host or "localhost:8001").split("://")[-1]
        self.protocol = opts.specdec_protocol
        self.client = SpecDecClient(self.url, self.protocol, opts.specdec_model)
        self.mode, self.method, self.k = mode_of(opts)
        self.prompts = ordered_prompts(self.environment)

    def on_stop(self):
        self.client.close()

    def request(self, prompt, text: str | None = None) -> GenerateRequest:
        """text: a rendered conversation (sent without the server's chat template)."""
        opts = self.environment.parsed_options
        salt = opts.specdec_cache_salt or None
        return GenerateRequest(
            prompt.text if text is None else text, max_tokens=prompt.max_tokens or opts.specdec_max_tokens,
            temperature=opts.specdec_temperature, seed=opts.specdec_seed, method=self.method, num_draft_tokens=self.k,
            ignore_eos=str(opts.specdec_ignore_eos).lower() in ("1", "true", "yes", "on"),
            guide_type=prompt.guide_type, guide=prompt.guide,  # structured prompts (JSONL guide fields)
            cache_salt=uuid.uuid4().hex if salt == "unique" else salt,
            apply_chat_template=None if text is None else False,
            perf_outputs=(P.OUTPUT_TOKENS, P.VERIFICATION_STEPS),  # all send() reads
        )

    @task
    def generate(self):
        prompt = self.prompts[next(_counter) % len(self.prompts)]
        if not prompt.turns:
            self.send(prompt)
            return
        history = []
        for turn, message in enumerate(prompt.messages):
            history.append({"role": "user", "content": message})
            answer = self.send(prompt, chat_renderer()(history), turn)
            if answer is None:
                return
            history.append({"role": "assistant", "content": answer})

    def send(self, prompt, text: str | None = None, turn: int | None = None) -> str | None:
        """One streamed request, fired as one Locust request; its text (None on failure)."""
        chunks, texts, perf, error = [], [], {}, None
        send = time.perf_counter()
        try:
            for chunk in self.client.stream(self.request(prompt, text)):
                if chunk.text:
                    chunks.append(chunk.time)
                    texts.append(chunk.text)
                perf.update(chunk.perf)
        except SpecDecClientError as exc:  # carries the server's message
            error = exc
        if error is None and D.structured_valid(prompt, "".join(texts)) is False:
            error = StructuredOutputError(f"the output does not satisfy its {prompt.guide_type} guide")
        trace = M.Trace(send, chunks, time.perf_counter(), int(perf.get(P.OUTPUT_TOKENS, len(chunks))),
                        int(perf.get(P.VERIFICATION_STEPS, 0)))
        self.fire(trace, error)
        if error is None and turn is not None and trace.chunks:
            self.environment.stats.get(f"{self.mode} turn {turn + 1}", "TTFT").log(M.ttft(trace) * 1000, 0)
        return None if error is not None else "".join(texts)

    def fire(self, trace: M.Trace, error: Exception | None) -> None:
        fire = self.environment.events.request.fire
        request_type = "gRPC" if self.protocol == "grpc" else "HTTP"
        context = {"mode": self.mode, "output_tokens": trace.output_tokens,
                   "acceptance_length": M.acceptance_length(trace.output_tokens, trace.verification_steps)}
        fire(request_type=request_type, name=self.mode, response_time=M.e2e(trace) * 1000,
             response_length=trace.output_tokens if error is None else 0, exception=error, context=context)
        if error is None:
            log_timings(self.environment.stats, self.mode, trace)


class StructuredOutputError(Exception):
    """An output that does not satisfy its prompt's guide: a failure in Locust's table."""


def log_timings(stats: RequestStats, mode: str, trace: M.Trace) -> None:
    """Log a request's timings into their own entries, not as request events: an entry's
    log() leaves `stats.total` (the Aggregated row) alone, and a worker reports its entries
    and its total separately (the master adds them up the same way), so Aggregated counts
    requests here and in distributed runs alike."""
    for sample in timings.samples(trace):
        stats.get(mode, sample.type).log(sample.ms, sample.length)


CSV_FLUSH_S = 2.0  # Locust writes its CSV files once a second


class ScenarioShape(LoadTestShape):
    """Runs the scenario chosen with --specdec-scenario for --specdec-duration (or -t),
    then drains: users stop after their current request (within --stop-timeout), and the
    test ends once the last results have reached the CSV files."""

    use_common_options = True  # reads --run-time

    def __init__(self):
        super().__init__()
        self.stages = None
        self.drained_at = None

    def tick(self):
        opts = self.runner.environment.parsed_options
        if self.stages is None:
            duration = opts.run_time or scenarios.parse_duration(opts.specdec_duration)
            self.stages = scenarios.plan(opts.specdec_scenario, duration, opts.specdec_users, opts.specdec_ramp_steps)
        step = scenarios.tick(self.stages, self.get_run_time())
        if step is not None:
            return step
        rate = float(max(1, opts.specdec_users))
        if self.get_current_user_count() > 0:
            return 0, rate
        if self.drained_at is None:
            self.drained_at = time.monotonic()
        return (0, rate) if time.monotonic() - self.drained_at < CSV_FLUSH_S else None
