"""`specdec demo` (what `make run` does): start the Triton server on the model repository,
stream one prompt through the ensemble with speculation and once without, print TTFT,
tok/s and mean acceptance length for both, then stop the server."""
from __future__ import annotations

import argparse
import sys
import time

from specdec import protocol as P

DEMO_PROMPT = (
    "Add type hints to this Python function and return the whole function:\n\n"
    "def moving_average(values, window):\n"
    "    result = []\n"
    "    for i in range(len(values) - window + 1):\n"
    "        result.append(sum(values[i:i + window]) / window)\n"
    "    return result\n"
)


def summarize(label: str, gen) -> str:
    tokens = int(gen.perf.get(P.OUTPUT_TOKENS, 0))
    steps = int(gen.perf.get(P.VERIFICATION_STEPS, 0))
    decode_s = gen.end_time - gen.chunk_times[0] if gen.chunk_times else 0.0
    tok_s = (tokens - 1) / decode_s if tokens > 1 and decode_s > 0 else 0.0
    # Each verification step emits its accepted draft tokens + 1 (bonus or recovered).
    mal = 1.0 + gen.perf.get(P.TOTAL_ACCEPTED_DRAFT_TOKENS, 0) / steps if steps else 0.0
    return f"[{label}] {tokens} tokens, TTFT {gen.ttft_s * 1e3:.0f} ms, {tok_s:.1f} tok/s, mean acceptance length {mal:.2f}"


def main(argv: list[str] | None = None) -> int:
    from specdec_client import Generation, GenerateRequest, SpecDecClient

    from triton_launcher import DEFAULT_MODEL_REPOSITORY, TritonServer

    parser = argparse.ArgumentParser(prog="specdec demo", description=__doc__)
    parser.add_argument("--prompt", default=DEMO_PROMPT)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--method", default=None, help="drafting method (default: the server's default)")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--model-repository", default=str(DEFAULT_MODEL_REPOSITORY))
    args = parser.parse_args(argv)
    server = TritonServer()
    print(f"starting Triton on {args.model_repository} ...", flush=True)
    server.start(args.model_repository, http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port)
    lines = []
    try:
        server.wait_ready(timeout=600)
        print(f"ready: {server.endpoints}\n", flush=True)
        with SpecDecClient(server.endpoints.grpc) as client:
            client.generate(GenerateRequest("Hello", max_tokens=4))  # warm-up (first forward packs weights)
            for label, k in (("speculative", None), ("baseline", 0)):
                print(f"--- {label} ---", flush=True)
                request = GenerateRequest(args.prompt, max_tokens=args.max_tokens, method=args.method, num_draft_tokens=k)
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
