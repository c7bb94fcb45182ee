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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specdec bench-openai", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--method", default="eagle3-hybrid")
    p.add_argument("--out", default="results/openai")
    args = p.parse_args(argv)
    result = run(args)
    (Path(args.out) / "bench_openai.json").write_text(json.dumps(result, indent=2))
    print(f"OpenAI path / gRPC ensemble, end to end at c=1: median {result['median_ratio']:.3f}x, mean {result['mean_ratio']:.3f}x "
          f"({result['prompts']} prompts, {result['identical_text']} identical texts; "
          f"medians {result['grpc_e2e_median_s']:.2f} s vs {result['openai_e2e_median_s']:.2f} s)")
    return 0
