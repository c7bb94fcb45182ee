"""`make stress`: back-to-back bench-serving-shaped rounds against one server, counting deaths.

The workload that crashed tritonserver once (issue 22: `Signal (11)` inside
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
import signal
import sys
import time
from pathlib import Path

from specdec_client import AsyncSpecDecClient, GenerateRequest

METHODS = ("none", "eagle3", "eagle3-hybrid", "ngram")


def request(prompt: str, method: str, max_tokens: int) -> GenerateRequest:
    baseline = method == "none"
    return GenerateRequest(prompt, max_tokens=max_tokens, ignore_eos=True, method=None if baseline else method,
                           num_draft_tokens=0 if baseline else None)


async def one_round(endpoints, prompts: list[str], args) -> dict:
    """Sequential streams per method, then `--concurrency` mixed streams, then cancels."""
    errors: list[str] = []
    done = cancelled = 0

    async def stream(client, req: GenerateRequest, cancel: bool) -> None:
        nonlocal done, cancelled
        try:
            gen = client.stream(req)
            async for _ in gen:
                if cancel:
                    await gen.aclose()
                    cancelled += 1
                    return
            done += 1
        except Exception as exc:  # noqa: BLE001 - counted, the round goes on
            errors.append(str(exc)[:200])

    cancel_url = endpoints.grpc if args.cancel_protocol == "grpc" else endpoints.http
    async with AsyncSpecDecClient(endpoints.grpc, "grpc") as client, AsyncSpecDecClient(cancel_url, args.cancel_protocol) as canceller:
        for method in METHODS:
            for prompt in prompts[:2]:
                await stream(client, request(prompt, method, args.max_tokens), False)
        mixed = [request(prompts[i % len(prompts)], METHODS[i % len(METHODS)], args.max_tokens) for i in range(args.concurrency)]
        await asyncio.gather(*(stream(client, r, False) for r in mixed))
        await asyncio.gather(*(stream(canceller, r, True) for r in mixed))
    return {"finished": done, "cancelled": cancelled, "errors": errors[:5], "error_count": len(errors)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.stress", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--concurrency", type=int, default=8)
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

    report: dict = {"settings": vars(args) | {"out": str(args.out)}, "rounds": [], "deaths": []}
    t0 = time.monotonic()
    server = start()
    report["server_command"] = [a for a in server.command if not a.startswith("--http-restricted") and "key" not in a]
    try:
        for n in range(args.rounds):
            started = time.monotonic()
            result = asyncio.run(one_round(server.endpoints, prompts, args))
            alive = server.is_running()
            result.update(round=n, seconds=round(time.monotonic() - started, 1), server_alive=alive)
            report["rounds"].append(result)
            print(json.dumps(result), flush=True)
            if not alive:
                tail = log.read_text(errors="replace").splitlines()[-30:]
                cause = next((sign for sign in ("Signal (11)", "prior > 0", "lock_exception", "Signal (6)") if any(sign in l for l in tail)), "?")
                report["deaths"].append({"round": n, "exit_code": server.returncode, "cause": cause, "log_tail": tail})
                server.stop()
                server = start()
    finally:  # also when stopped early: the rounds run so far are the result
        server.stop()
        report["summary"] = {"rounds": len(report["rounds"]), "server_deaths": len(report["deaths"]),
                             "requests_finished": sum(r["finished"] for r in report["rounds"]),
                             "requests_cancelled": sum(r["cancelled"] for r in report["rounds"]),
                             "request_errors": sum(r["error_count"] for r in report["rounds"]),
                             "minutes": round((time.monotonic() - t0) / 60, 1)}
        (args.out / "stress.json").write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps(report["summary"]))
    return 0 if not report["deaths"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
