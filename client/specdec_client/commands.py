"""`specdec-client`: generate (stream to the terminal), health, bench.

    specdec-client health [--url HOST:PORT] [--protocol grpc|http]
    specdec-client generate "prompt" [--method ngram] [--num-draft-tokens 4] [--max-tokens 128] ...
    specdec-client bench [--methods ngram,ngram-tree] [--concurrency 1,16] [--out DIR] ...
    specdec-client promote --eagle3-head DIR [--medusa-heads DIR]   (admin: SPECDEC_ADMIN_KEY)
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

import specdec_wire as P

from specdec_client import metrics as M
from specdec_client.bench_command import add_bench_arguments, cmd_bench
from specdec_client.command_args import EXIT_NOT_READY, EXIT_UNREACHABLE, add_connection_arguments, add_sampling_arguments, default_url
from specdec_client.client import GenerateRequest, Generation, SpecDecClient
from specdec_client.errors import ClientConnectionError, SpecDecClientError

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec-client", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    health = sub.add_parser("health", help="check live/ready and list the models")
    add_connection_arguments(health)

    gen = sub.add_parser("generate", help="stream one completion to the terminal, then its timings and acceptance")
    gen.add_argument("prompt")
    add_connection_arguments(gen)
    gen.add_argument("--method", help="speculative method (default: the server's default)")
    gen.add_argument("--num-draft-tokens", type=int, help="0 = plain decoding (the baseline)")
    gen.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    add_sampling_arguments(gen, temperature=None)

    bench = sub.add_parser("bench", help="matched benchmark: baseline vs speculative modes")
    add_bench_arguments(bench)

    promote = sub.add_parser("promote", help="serve a new head without a restart: the next streams draft with it, running "
                                             "ones finish with theirs (admin: SPECDEC_ADMIN_KEY; gRPC)")
    add_connection_arguments(promote)
    for kind, parameter in P.HEAD_PARAMETERS.items():
        promote.add_argument(f"--{parameter.replace('_', '-')}", dest=parameter, default=None,
                             help=f"the {kind} head directory, as the server sees it")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "url", None) is None and hasattr(args, "protocol"):
        args.url = default_url(args.protocol)
    if args.command == "health":
        return cmd_health(args)
    if args.command == "generate":
        return cmd_generate(args)
    if args.command == "promote":
        return cmd_promote(args)
    return cmd_bench(args)


# ---- promote -----------------------------------------------------------------------------
def cmd_promote(args) -> int:
    heads = {kind: getattr(args, parameter) for kind, parameter in P.HEAD_PARAMETERS.items() if getattr(args, parameter)}
    if not heads:
        print("promote: name a head (" + ", ".join(f"--{p.replace('_', '-')}" for p in P.HEAD_PARAMETERS.values()) + ")",
              file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        with SpecDecClient(args.url, args.protocol, timeout_s=args.timeout) as client:
            message = client.promote_heads(heads)
    except (SpecDecClientError, ValueError) as exc:
        print(f"promote: {exc}", file=sys.stderr)
        return 1
    print(f"{message} ({time.perf_counter() - t0:.1f} s)")
    return 0


# ---- health ------------------------------------------------------------------------------
def cmd_health(args) -> int:
    client = SpecDecClient(args.url, args.protocol, timeout_s=min(args.timeout, 10.0))
    try:
        state = client.health()
    except ClientConnectionError as exc:
        print(f"unreachable: {args.url} ({args.protocol}): {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except SpecDecClientError as exc:
        print(f"error: {args.url}: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    finally:
        client.close()
    print(f"server {args.url} ({args.protocol}): live={state['live']} ready={state['ready']}")
    for model in state["models"]:
        print(f"  {model['name']:<20} {model['state'] or '-'}")
    return 0 if state["live"] and state["ready"] else EXIT_NOT_READY


# ---- generate ----------------------------------------------------------------------------
def cmd_generate(args) -> int:
    request = GenerateRequest(
        args.prompt, max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, stop=tuple(args.stop), method=args.method, num_draft_tokens=args.num_draft_tokens,
        ignore_eos=True if args.ignore_eos else None,
    )
    chunks = []
    with SpecDecClient(args.url, args.protocol, args.model, timeout_s=args.timeout) as client:
        send = time.perf_counter()
        try:
            for chunk in client.stream(request):
                chunks.append(chunk)
                print(chunk.text, end="", flush=True)
        except SpecDecClientError as exc:
            print(f"\nerror: {exc}", file=sys.stderr)
            return EXIT_UNREACHABLE if isinstance(exc, ClientConnectionError) else 1
    print()
    print(generation_stats(Generation.from_chunks(chunks, send)), file=sys.stderr)
    return 0


def generation_stats(gen: Generation) -> str:
    """One line: TTFT, tok/s (after the first token, and overall), acceptance."""
    perf = gen.perf
    tokens = int(perf.get("output_tokens", len(gen.chunk_times)))
    trace = M.Trace(gen.send_time, gen.chunk_times, gen.end_time, tokens, int(perf.get("verification_steps", 0)),
                    int(perf.get(P.TOTAL_ACCEPTED_DRAFT_TOKENS, 0)), int(perf.get(P.TOTAL_DRAFT_TOKENS, 0)))
    ttft, e2e, per_user = M.ttft(trace), M.e2e(trace), M.per_user_tok_s(trace)
    length = M.acceptance_length(trace.output_tokens, trace.verification_steps)
    rate = M.acceptance_rate(trace.accepted, trace.drafted)
    parts = [
        f"TTFT {ttft * 1000:.1f} ms" if ttft is not None else "TTFT –",
        f"{tokens} tokens in {e2e:.2f} s",
        f"{per_user:.1f} tok/s after the first token" if per_user is not None else "tok/s –",
        f"{tokens / e2e:.1f} tok/s overall" if e2e > 0 else "",
        f"mean acceptance length {length:.2f} tokens/step" if length is not None else "mean acceptance length –",
        f"acceptance rate {100 * rate:.1f}% ({trace.accepted}/{trace.drafted})" if rate is not None else "acceptance rate – (no drafts)",
    ]
    return " | ".join(p for p in parts if p)


if __name__ == "__main__":
    sys.exit(main())
