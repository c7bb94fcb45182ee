"""`specdec demo` (what `make run` does): start the Triton server on the model repository,
stream one prompt through the ensemble with the method that measured fastest at c=1 on this
machine class (results/serving_overhead.json, from `make bench-serving`) and once without
speculation, print TTFT, tok/s and mean acceptance length for both, then stop the server."""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import specdec_wire as P
from specdec.config import METHOD_ARCTIC_SUFFIX, METHOD_SUFFIX, REPO_ROOT

DEMO_PROMPT = (
    "Add type hints to this Python function and return the whole function:\n\n"
    "def moving_average(values, window):\n"
    "    result = []\n"
    "    for i in range(len(values) - window + 1):\n"
    "        result.append(sum(values[i:i + window]) / window)\n"
    "    return result\n"
)


MEASURED = REPO_ROOT / "results" / "serving_overhead.json"
# Drafters that learn from earlier requests: bench-serving asks every mode the same prompts,
# so theirs replays answers already given (a repeated-task measurement, not a first answer's).
LEARNS_ACROSS_REQUESTS = (METHOD_SUFFIX, METHOD_ARCTIC_SUFFIX)


def fastest_measured(served: set[str], path: Path = MEASURED) -> tuple[str, int, str] | None:
    """(method, draft tokens, why) of the fastest served mode through Triton at c=1 in a
    bench-serving result, or None without one."""
    try:
        modes = json.loads(path.read_text())["modes"]
    except (OSError, ValueError, KeyError):
        return None
    spec = {label: m for label, m in modes.items()
            if m.get("num_draft_tokens") and m.get("method") in served and "triton_over_baseline" in m
            and m.get("method") not in LEARNS_ACROSS_REQUESTS}
    if not spec:
        return None
    label = max(spec, key=lambda name: spec[name]["triton_over_baseline"])
    best = spec[label]
    why = (f"fastest through Triton at c=1 on this machine class: {best['triton_over_baseline']:.2f}x the baseline "
           f"in {path.relative_to(path.parent.parent)} (make bench-serving)")
    return best["method"], int(best["num_draft_tokens"]), why


def summarize(label: str, gen) -> str:
    tokens = int(gen.perf.get(P.OUTPUT_TOKENS, 0))
    steps = int(gen.perf.get(P.VERIFICATION_STEPS, 0))
    decode_s = gen.end_time - gen.chunk_times[0] if gen.chunk_times else 0.0
    tok_s = (tokens - 1) / decode_s if tokens > 1 and decode_s > 0 else 0.0
    # Each verification step emits its accepted draft tokens + 1 (bonus or recovered).
    mal = 1.0 + gen.perf.get(P.TOTAL_ACCEPTED_DRAFT_TOKENS, 0) / steps if steps else 0.0
    return f"[{label}] {tokens} tokens, TTFT {gen.ttft_s * 1e3:.0f} ms, {tok_s:.1f} tok/s, mean acceptance length {mal:.2f}"


def demo_runs(prompt: str, max_tokens: int, method: str | None, num_draft_tokens: int | None) -> list:
    """(label, request) of the speculative run and the baseline: the speculative request
    carries the method its label names (None: the server's default), the baseline none. Each
    its own cache salt, so neither finds the other's prompt in the prefix cache: both TTFTs
    include the same prefill, and their difference is what speculation costs (the baseline ran
    second and hit the cache before, which showed as speculation's cost)."""
    from specdec_client import GenerateRequest

    return [
        (f"speculative: {method or 'server default'}",
         GenerateRequest(prompt, max_tokens=max_tokens, method=method, num_draft_tokens=num_draft_tokens,
                         cache_salt="demo-speculative")),
        ("baseline", GenerateRequest(prompt, max_tokens=max_tokens, method=None, num_draft_tokens=0, cache_salt="demo-baseline")),
    ]


def main(argv: list[str] | None = None) -> int:
    from specdec_client import Generation, SpecDecClient

    from specdec.launcher import DEFAULT_MODEL_REPOSITORY, TritonServer

    parser = argparse.ArgumentParser(prog="specdec demo", description=__doc__)
    parser.add_argument("--prompt", default=DEMO_PROMPT)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--method", default=None, help="drafting method (default: the fastest measured at c=1)")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--model-repository", default=str(DEFAULT_MODEL_REPOSITORY))
    args = parser.parse_args(argv)
    method, k, why = args.method, None, "chosen on the command line"
    if method is None:
        served = set(json.loads((Path(args.model_repository) / "specdec.json").read_text())["methods"])
        method, k, why = fastest_measured(served) or (None, None, "the server's default method (no measured result found)")
    print(f"speculative method: {method or 'server default'} ({why})", flush=True)
    server = TritonServer()
    print(f"starting Triton on {args.model_repository} ...", flush=True)
    server.start(args.model_repository, http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port)
    lines = []
    try:
        server.wait_ready(timeout=600)
        print(f"ready: {server.endpoints}\n", flush=True)
        with SpecDecClient(server.endpoints.grpc) as client:
            runs = demo_runs(args.prompt, args.max_tokens, method, k)
            for _, request in runs:  # both modes warm (first-call costs stay out of either run)
                client.generate(replace(request, prompt="Hello", max_tokens=8))
            for label, request in runs:
                print(f"--- {label} ---", flush=True)
                send, chunks = time.perf_counter(), []
                for chunk in client.stream(request):
                    print(chunk.text, end="", flush=True)
                    chunks.append(chunk)
                lines.append(summarize(label, Generation.from_chunks(chunks, send)))
                print("\n")
    finally:
        server.stop()
    print("\n".join(lines))
    print("\nTo keep a server running: make serve   (or: specdec serve --help)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
