"""`specdec bench-openai`: what the OpenAI front end adds to end-to-end latency at c=1,
measured side by side in one run -> results/openai/.

Starts the real Triton server and `specdec openai` in front of it, then for each ShareGPT
prompt, alternating which goes first, runs the same greedy request through tritonclient's
gRPC stream to the `ensemble` and through the official OpenAI SDK (streaming chat) to the
front end; both produce the same tokens, so the per-request ratio of end-to-end times is
the front end's cost. Nothing here is asserted.
"""
import argparse
import contextlib
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from specdec_client.envinfo import provenance, write_result

# ShareGPT first turns of 4 to 256 tokens: the prompts of both front-end benchmarks.
PROMPT_TOKENS = (4, 256)


@contextlib.contextmanager
def served_with_openai(out: Path, base: str = "m", settings_file: Path | None = None) -> Iterator[tuple[Any, int]]:
    """The real Triton server on free ports (with `settings_file` as its specdec.json, else
    the repository's) and `specdec openai` in front of it (model ids `<base>[:method]`):
    yields (server, front end port); stops both."""
    import uvicorn

    from specdec.launcher import DEFAULT_MODEL_REPOSITORY, TritonServer, free_ports

    from specdec.config import ServingConfig
    from specdec_openai.frontend import Frontend, Served, create_app
    from specdec.config import SERVED_SETTINGS, resolve_model_dir
    from specdec.serving.runtime import load_tokenizer

    http, grpc, metrics = free_ports(3)
    server = TritonServer(log_path=out / "triton.log")
    server.start(DEFAULT_MODEL_REPOSITORY, http_port=http, grpc_port=grpc, metrics_port=metrics,
                 env={"SPECDEC_SETTINGS": str(Path(settings_file).resolve())} if settings_file else None)
    settings = ServingConfig.from_file(settings_file or SERVED_SETTINGS)
    frontend = Frontend(server.endpoints.http, Served.from_settings(settings, base), load_tokenizer(resolve_model_dir(settings.model_dir)))
    (port,) = free_ports(1)
    api = uvicorn.Server(uvicorn.Config(create_app(frontend), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=api.run, daemon=True)
    try:
        server.wait_ready(timeout=600)
        thread.start()
        while not api.started:
            time.sleep(0.05)
        yield server, port
    finally:
        api.should_exit = True
        server.stop()


def run(args) -> dict:
    import openai

    from specdec_client import GenerateRequest, SpecDecClient
    from specdec_client.datasets import load_sharegpt, load_token_counter

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = [p.text for p in load_sharegpt(args.prompts, 0, load_token_counter(), *PROMPT_TOKENS).prompts]
    rows = []
    with served_with_openai(out) as (server, port):
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        model = f"m:{args.method}"
        with SpecDecClient(server.endpoints.grpc) as client:

            def via_grpc(prompt):
                t0 = time.perf_counter()
                gen = client.generate(GenerateRequest(prompt, max_tokens=args.max_tokens, temperature=0.0, method=args.method,
                                                      ignore_eos=False))
                return time.perf_counter() - t0, gen.text

            def via_openai(prompt):
                t0 = time.perf_counter()
                stream = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                     max_tokens=args.max_tokens, temperature=0, stream=True)
                text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                return time.perf_counter() - t0, text

            for prompt in prompts[:2]:  # warm-up, unrecorded
                via_grpc(prompt), via_openai(prompt)
            for i, prompt in enumerate(prompts):
                order = (via_grpc, via_openai) if i % 2 == 0 else (via_openai, via_grpc)
                results = {fn.__name__: fn(prompt) for fn in order}
                (tg, text_g), (to, text_o) = results["via_grpc"], results["via_openai"]
                rows.append({"grpc_s": tg, "openai_s": to, "ratio": to / tg, "same_text": text_g == text_o, "chars": len(text_g)})
    ratios = [r["ratio"] for r in rows]
    return {"method": args.method, "prompts": len(rows), "max_tokens": args.max_tokens, "concurrency": 1,
            "median_ratio": statistics.median(ratios), "mean_ratio": statistics.mean(ratios),
            "grpc_e2e_median_s": statistics.median(r["grpc_s"] for r in rows),
            "openai_e2e_median_s": statistics.median(r["openai_s"] for r in rows),
            "identical_text": sum(r["same_text"] for r in rows), "rows": rows}


def run_siblings(args) -> dict:
    """n sampled choices per prompt (RL-style rollouts), side by side per prompt with the order
    rotating: the baseline's n streams at once; the suffix method's at once; and the suffix
    method's in turn (`siblings_in_turn`: each later sibling drafts from the earlier ones'
    finished text). Per mode: output tokens per second of wall time and tokens per step."""
    import openai

    from specdec_client.datasets import load_sharegpt, load_token_counter

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = [p.text for p in load_sharegpt(args.prompts, 0, load_token_counter(), *PROMPT_TOKENS).prompts]
    modes = {"baseline": ("m:none", False), "suffix": ("m:suffix", False), "suffix in turn": ("m:suffix", True)}
    totals = {name: {"seconds": 0.0, "tokens": 0, "steps": 0, "accepted": 0} for name in modes}
    with served_with_openai(out) as (server, port):
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)

        def once(prompt: str, name: str, seed: int, record: bool = True) -> None:
            model, in_turn = modes[name]
            t0 = time.perf_counter()
            reply = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], n=args.siblings,
                                                max_tokens=args.max_tokens, temperature=args.temperature, seed=seed,
                                                extra_body={"siblings_in_turn": in_turn})
            if record:
                row = totals[name]
                row["seconds"] += time.perf_counter() - t0
                row["tokens"] += reply.usage.completion_tokens
                row["steps"] += sum(c["verification_steps"] for c in reply.model_extra["specdec"]["choices"])
                row["accepted"] += sum(c["accepted_draft_tokens"] for c in reply.model_extra["specdec"]["choices"])

        once(prompts[0], "suffix", 1, record=False)  # warm-up
        names = list(modes)
        for i, prompt in enumerate(prompts):
            for name in names[i % len(names):] + names[: i % len(names)]:
                once(prompt, name, 1000 + i)
    for row in totals.values():
        row["tok_s"] = row["tokens"] / row["seconds"]
        row["tokens_per_step"] = row["tokens"] / max(row["steps"], 1)
    base = totals["baseline"]["tok_s"]
    return {"siblings": args.siblings, "prompts": len(prompts), "max_tokens": args.max_tokens, "temperature": args.temperature,
            "modes": totals, "x_baseline": {name: row["tok_s"] / base for name, row in totals.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specdec bench-openai", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--method", default="eagle3-hybrid")
    p.add_argument("--out", default="results/openai")
    p.add_argument("--siblings", type=int, default=0, help="> 0: measure n sampled choices per prompt instead (-> siblings.json)")
    p.add_argument("--temperature", type=float, default=0.8, help="with --siblings")
    args = p.parse_args(argv)
    if args.siblings:
        started = provenance()
        result = run_siblings(args)
        write_result(Path(args.out) / "siblings.json", result, started)
        print(json.dumps({"x_baseline": result["x_baseline"], "tokens_per_step": {n: r["tokens_per_step"] for n, r in result["modes"].items()}}))
        return 0
    started = provenance()
    result = run(args)
    write_result(Path(args.out) / "bench_openai.json", result, started)
    print(f"OpenAI path / gRPC ensemble, end to end at c=1: median {result['median_ratio']:.3f}x, mean {result['mean_ratio']:.3f}x "
          f"({result['prompts']} prompts, {result['identical_text']} identical texts; "
          f"medians {result['grpc_e2e_median_s']:.2f} s vs {result['openai_e2e_median_s']:.2f} s)")
    return 0
