"""`make stress`: back-to-back rounds against one server, counting server and stub deaths.

The default round (`--shape mixed`, issue 43) sweeps concurrency 1..16 across rounds; each
worker sends random requests: every served method and the baseline, greedy and sampled,
stop strings, bad words, guides, through the ensemble and the speculative loop, a fifth
cancelled after the first chunk. A Python stub that dies is counted (Triton keeps running and
fails that model's requests), and the server is started again.

`--shape plain` is issue 22's round. The workload that crashed tritonserver once (issue 22: `Signal (11)` inside
TRITONBACKEND_ModelInstanceExecute, then boost::interprocess::lock_exception): gRPC streams
through the ensemble, one after another per method (bench-serving's c=1), then concurrent
streams of mixed methods, then streams cancelled after their first chunk (over HTTP by
default: bundled Triton 2.51's gRPC frontend aborts on concurrent client cancellations, a
known bug fixed in a later release, triton-inference-server/server#7368, which would hide
the crash looked for here; `--cancel-protocol grpc` shows it). After every round
the server must still be live; a death is recorded with the tail of its log, and the server
is started again so the run goes on. `--python-shm-mib 0` keeps Triton's own Python-backend
shared-memory defaults (1 MiB, grown 1 MiB at a time) to compare with the launcher's.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from pathlib import Path

from specdec_client import AsyncSpecDecClient, GenerateRequest
from specdec_client.envinfo import provenance, write_result

# The shape that must never kill a stub (issue 43): every served method and the baseline,
# concurrency swept over CONCURRENCY one level per round, greedy and sampled, stop strings,
# bad words, guides (a JSON schema, a regex and one the vocabulary cannot finish), through
# the ensemble and the speculative loop, and a share of streams cancelled after their first
# chunk.
CONCURRENCY = (1, 2, 4, 8, 16)
SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                     "required": ["name", "age"]})
GUIDES = ((None, None), ("json_schema", SCHEMA), ("regex", "[a-z ]{4,24}\\."), ("json", None),
          ("regex", "ab\x16"))  # the last ends on a character no token spells: an error naming the guide
STOPS = ((), ("\n",), (".", "the"))
MODELS = ("ensemble", "speculative_loop")


def served_method_names() -> list[str]:
    from specdec.config import SERVED_SETTINGS
    return ["none", *json.loads(Path(SERVED_SETTINGS).read_text())["methods"]]


def request(prompt: str, method: str, max_tokens: int, rng: random.Random | None = None) -> GenerateRequest:
    """A plain request (rng None) or one with random options."""
    baseline = method == "none"
    options = {}
    if rng is not None:
        guide_type, guide = rng.choice(GUIDES) if rng.random() < 0.3 else (None, None)
        sampled = rng.random() < 0.5
        options = dict(stop=rng.choice(STOPS), guide_type=guide_type, guide=guide,
                       temperature=rng.choice((0.7, 1.0)) if sampled else 0.0, seed=rng.randrange(2**31) if sampled else None,
                       top_k=rng.choice((None, 20)) if sampled else None, top_p=rng.choice((None, 0.9)) if sampled else None,
                       bad_words=rng.choice(((), ("the",))), repetition_penalty=rng.choice((None, 1.1)))
    return GenerateRequest(prompt, max_tokens=max_tokens, ignore_eos=rng is None, method=None if baseline else method,
                           num_draft_tokens=0 if baseline else None, **options)


def stub_failure(text: str) -> bool:
    return any(sign in text for sign in ("not healthy", "Stub process", "Failed to process the request"))


async def one_round(endpoints, prompts: list[str], args, n: int = 0) -> dict:
    """`mixed` (default): CONCURRENCY[n % len] workers, each sending `--requests-per-worker`
    random requests (method, options, model, cancel) back to back. `plain`: the issue-22
    round (sequential streams per method, then --concurrency mixed streams, then cancels)."""
    errors: list[str] = []
    counts = {"finished": 0, "cancelled": 0, "refused": 0}

    async def stream(client, req: GenerateRequest, cancel: bool) -> None:
        try:
            gen = client.stream(req)
            async for _ in gen:
                if cancel:
                    await gen.aclose()
                    counts["cancelled"] += 1
                    return
            counts["finished"] += 1
        except Exception as exc:  # noqa: BLE001 - counted, the round goes on
            text = str(exc)
            if not stub_failure(text) and "guided_decoding_guide" in text:  # the unfinishable guide, refused by name
                counts["refused"] += 1
            else:
                errors.append(f"{text[:300]} <- {client.model} {client.protocol} cancel={cancel} {req}")

    methods = served_method_names()
    cancel_url = endpoints.grpc if args.cancel_protocol == "grpc" else endpoints.http
    if args.shape == "plain":
        async with AsyncSpecDecClient(endpoints.grpc, "grpc") as client, AsyncSpecDecClient(cancel_url, args.cancel_protocol) as canceller:
            for method in PLAIN_METHODS:
                for prompt in prompts[:2]:
                    await stream(client, request(prompt, method, args.max_tokens), False)
            mixed = [request(prompts[i % len(prompts)], PLAIN_METHODS[i % len(PLAIN_METHODS)], args.max_tokens)
                     for i in range(args.concurrency)]
            await asyncio.gather(*(stream(client, r, False) for r in mixed))
            await asyncio.gather(*(stream(canceller, r, True) for r in mixed))
    else:
        concurrency = CONCURRENCY[n % len(CONCURRENCY)]

        async def worker(w: int) -> None:
            rng = random.Random(args.seed * 1_000_003 + n * 101 + w)
            clients = {(model, proto): AsyncSpecDecClient(endpoints.grpc if proto == "grpc" else endpoints.http, proto, model=model,
                                                    timeout_s=args.request_timeout_s)
                       for model in MODELS for proto in ("grpc", "http")}
            try:
                for _ in range(args.requests_per_worker):
                    cancel = rng.random() < 0.2
                    # cancels over HTTP by default (see the module's docstring)
                    proto = args.cancel_protocol if cancel else "grpc"
                    client = clients[(rng.choice(MODELS), proto)]
                    await stream(client, request(rng.choice(prompts), rng.choice(methods), args.max_tokens, rng), cancel)
            finally:
                for client in clients.values():
                    await client.close()

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return {**counts, "concurrency": args.concurrency if args.shape == "plain" else concurrency,
            "stub_failures": sum(stub_failure(e) for e in errors), "errors": errors[:5], "error_count": len(errors)}


PLAIN_METHODS = ("none", "eagle3", "eagle3-hybrid", "ngram")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.stress", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--shape", choices=("mixed", "plain"), default="mixed")
    p.add_argument("--requests-per-worker", type=int, default=12, help="mixed: requests each worker sends per round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout-s", type=float, default=180.0, help="mixed: a request not answered by then is a hang")
    p.add_argument("--concurrency", type=int, default=8, help="plain: the concurrent streams")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--cancel-protocol", choices=("http", "grpc"), default="http")
    p.add_argument("--python-shm-mib", type=int, default=None,
                   help="Python-backend shared memory per model instance (default: the launcher's; 0: Triton's 1 MiB)")
    p.add_argument("--out", type=Path, default=Path("results/stress"))
    args = p.parse_args(argv)

    from specdec.tools.sharegpt import sharegpt_prompts
    from specdec.launcher import DEFAULT_MODEL_REPOSITORY, TritonServer, free_ports

    args.out.mkdir(parents=True, exist_ok=True)
    prompts = sharegpt_prompts(8, seed=3, max_tokens=100)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the server on the way out
    shm = {} if args.python_shm_mib is None else {"shm_default_byte_size": args.python_shm_mib * 2**20 or 2**20,
                                                   "shm_growth_byte_size": args.python_shm_mib * 2**20 or 2**20}
    log = args.out / "triton.log"

    def start() -> TritonServer:
        http, grpc, metrics = free_ports(3)
        server = TritonServer(log_path=log)
        server.start(DEFAULT_MODEL_REPOSITORY, http_port=http, grpc_port=grpc, metrics_port=metrics, **shm)
        server.wait_ready(timeout=600)
        return server

    started = provenance()
    report: dict = {"settings": vars(args) | {"out": str(args.out)}, "rounds": [], "deaths": []}
    t0 = time.monotonic()
    server = start()
    report["server_command"] = [a for a in server.command if not a.startswith("--http-restricted") and "key" not in a]
    try:
        for n in range(args.rounds):
            started = time.monotonic()
            result = asyncio.run(one_round(server.endpoints, prompts, args, n))
            dead = server.dead_stubs()
            alive = server.is_running()
            result.update(round=n, seconds=round(time.monotonic() - started, 1), server_alive=alive, dead_stubs=dead)
            report["rounds"].append(result)
            print(json.dumps(result), flush=True)
            if not alive or dead:
                tail = log.read_text(errors="replace").splitlines()[-30:]
                cause = next((sign for sign in ("Signal (11)", "prior > 0", "lock_exception", "Signal (6)") if any(sign in l for l in tail)), "?")
                report["deaths"].append({"round": n, "exit_code": server.returncode, "dead_stubs": dead, "cause": cause,
                                         "log_tail": tail})
                server.stop()
                server = start()
    finally:  # also when stopped early: the rounds run so far are the result
        server.stop()
        report["summary"] = {"rounds": len(report["rounds"]), "server_deaths": len(report["deaths"]),
                             "requests_finished": sum(r["finished"] for r in report["rounds"]),
                             "requests_cancelled": sum(r["cancelled"] for r in report["rounds"]),
                             "requests_refused_by_name": sum(r.get("refused", 0) for r in report["rounds"]),
                             "stub_deaths": sum(len(d["dead_stubs"]) for d in report["deaths"]),
                             "stub_failures": sum(r["stub_failures"] for r in report["rounds"]),
                             "request_errors": sum(r["error_count"] for r in report["rounds"]),
                             "minutes": round((time.monotonic() - t0) / 60, 1)}
        write_result(args.out / "stress.json", report, started, indent=1)
        print(json.dumps(report["summary"]))
    return 0 if not report["deaths"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
