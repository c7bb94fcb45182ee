"""`specdec-client bench`: load (options, server, prompts, environment) -> run -> report."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from specdec_client import datasets as D
from specdec_client.bench import (BenchConfig, BenchConfigError, BenchResult, LoadPoint, endpoint_modes, parse_modes, run_bench,
                                  schedule)
from specdec_client.command_args import add_connection_arguments, add_sampling_arguments
from specdec_client.client import SpecDecClient
from specdec_client.endpoints import Endpoint, parse_endpoint
from specdec_client.envinfo import environment, stamped
from specdec_client.errors import SpecDecClientError
from specdec_client.local_server import local_server, settings_in_use
from specdec_client.summary import build_summary, validate, write_json, write_requests

DEFAULT_OUT = Path("results/bench/latest")
DEFAULT_CONCURRENCY = "1,16"


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _endpoint(text: str) -> Endpoint:
    try:
        return parse_endpoint(text)
    except SpecDecClientError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_dataset_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data set")
    g.add_argument("--dataset", choices=D.DATASETS, default="sharegpt")
    g.add_argument("--dataset-path", help="the JSONL file (jsonl) or another ShareGPT-format JSON file")
    g.add_argument("--num-prompts", type=int, default=32, help="prompts per (mode, load) and repeat")
    g.add_argument("--prompts-per-concurrency", type=int, help="closed loop: run K x c of the prompts at concurrency c "
                   "(at least 16, at most --num-prompts), so every load is measured over the same number of waves")
    g.add_argument("--dataset-seed", type=int, default=0, help="seed of the prompt sampling")
    g.add_argument("--tokenizer", help="tokenizer directory for length filters (default: the prepared target)")
    g.add_argument("--turns", type=int, default=4, help="sharegpt-multiturn: user turns per conversation (each "
                   "turn sends the whole history with the model's own answers)")
    g.add_argument("--min-input-tokens", type=int, default=4, help="sharegpt filter")
    g.add_argument("--max-input-tokens", type=int, default=512, help="sharegpt filter")
    g.add_argument("--input-tokens", type=int, default=128, help="synthetic: mean prompt length")
    g.add_argument("--input-spread", type=int, default=0, help="synthetic: +- uniform spread of the prompt length")
    g.add_argument("--output-tokens", type=int, help="synthetic: mean max_tokens per prompt (default --max-tokens)")
    g.add_argument("--output-spread", type=int, default=0, help="synthetic: +- spread of max_tokens")


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    add_connection_arguments(p)
    add_sampling_arguments(p, temperature=0.0)
    p.add_argument("--methods", help="comma-separated speculative modes, e.g. 'ngram,ngram-tree:6' (':k' = draft "
                                     "tokens); the baseline is always run (default: every method in the server's specdec.json)")
    g = p.add_argument_group("two deployments side by side (instead of --methods on one server)")
    g.add_argument("--baseline", type=_endpoint, metavar="ENDPOINT",
                   help="the reference deployment: grpc://HOST:PORT[/MODEL], triton+http://HOST:PORT[/MODEL] or "
                        "openai+http://HOST:PORT/v1, with ?method=, draft=, stock=1, model=, metrics=, name= "
                        "(specdec_client/endpoints.py)")
    g.add_argument("--candidate", type=_endpoint, metavar="ENDPOINT", action="append",
                   help="a deployment judged against --baseline (repeatable: each one is a mode of the same blocks)")
    g.add_argument("--prompt-text", choices=("chat", "raw"), default="chat",
                   help="with --baseline/--candidate: chat = each prompt rendered here by the target's chat template "
                        "(--tokenizer) and sent as raw text to both, so both tokenize the same text; raw = as written")
    g.add_argument("--same-model", action=argparse.BooleanOptionalAction, default=True,
                   help="both deployments serve the same model: check greedy identity (default on)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly --max-tokens tokens per request (default on)")
    p.add_argument("--concurrency", type=_ints, help=f"closed-loop concurrencies (default {DEFAULT_CONCURRENCY} "
                                                      "unless only --request-rate is given)")
    p.add_argument("--request-rate", type=_floats, default=[], help="open-loop Poisson rates in requests/s")
    p.add_argument("--slo-ttft-ms", type=float, help="SLO: TTFT limit; with it the report gives goodput and, for "
                   "--request-rate sweeps, the highest rate each mode sustains")
    p.add_argument("--slo-tpot-ms", type=float, help="SLO: TPOT (per-token latency after the first) limit")
    p.add_argument("--slo-attainment", type=float, default=0.9, help="share of requests that must meet the SLO for a "
                   "rate to count as sustained (default 0.9)")
    p.add_argument("--prefix-cache", choices=("on", "off", "both"), default="on",
                   help="on: each mode's requests share the server's prefix cache (scoped per mode, load and repeat, "
                        "so no mode reuses another's KV); off: every request gets a salt of its own (nothing reused); "
                        "both: each mode twice, with and without ('<mode>/no-cache')")
    p.add_argument("--repeats", type=int, default=1, help="times every prompt is run per mode and load")
    p.add_argument("--block-size", type=int, help="prompts per interleaved block (default max(8, 2 x concurrency))")
    p.add_argument("--warmup", type=int, default=2, help="unrecorded warm-up requests per mode")
    p.add_argument("--metrics-url", help="Prometheus metrics URL (default http://<host>:8002/metrics)")
    p.add_argument("--no-metrics", action="store_true", help="do not scrape the metrics port")
    p.add_argument("--server-config", type=Path, help="the server's specdec.json, recorded in the environment "
                                                      "(default $SPECDEC_SETTINGS or model_repository/specdec.json)")
    p.add_argument("--start-server", action="store_true", help="start the project's Triton server on free ports")
    p.add_argument("--server-settings", type=Path, help="with --start-server: a specdec.json for it (SPECDEC_SETTINGS)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--no-progress", action="store_true")
    add_dataset_arguments(p)


# ---- load --------------------------------------------------------------------------------
@dataclass
class Target:
    url: str
    metrics_url: str | None
    settings_path: Path


@contextlib.contextmanager
def target_server(args) -> Iterator[Target]:
    """The server to benchmark: the one at --url, or one started here."""
    if not args.start_server:
        host = args.url.rsplit(":", 1)[0]
        metrics = None if args.no_metrics else (args.metrics_url or f"http://{host}:8002/metrics")
        yield Target(args.url, metrics, args.server_config or settings_in_use(None))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"starting tritonserver (log {args.out / 'triton.log'}) ...", file=sys.stderr, flush=True)
    with local_server(args.out / "triton.log", args.server_settings) as ep:
        yield Target(ep.grpc if args.protocol == "grpc" else ep.http, None if args.no_metrics else ep.metrics_url,
                     settings_in_use(args.server_settings))


def default_methods(settings_path: Path) -> list[str]:
    try:
        return list(json.loads(settings_path.read_text())["methods"])
    except (OSError, ValueError, KeyError) as exc:
        raise BenchConfigError(f"--methods not given and the methods of {settings_path} could not be read: {exc}") from exc


def comparing_deployments(args) -> bool:
    given = (args.baseline is not None, args.candidate is not None)
    if any(given) and not all(given):
        raise BenchConfigError("give both --baseline and --candidate")
    if all(given) and (args.methods or args.start_server):
        raise BenchConfigError("--baseline/--candidate compare two deployments; --methods and --start-server are for one server")
    return all(given)


def load_config(args, target: Target | None) -> BenchConfig:
    """target None: two deployments (--baseline / --candidate) instead of one server's modes."""
    if target is None:
        modes = endpoint_modes(args.baseline, args.candidate, args.prefix_cache)
        url, protocol, metrics_url = args.baseline.spec, args.baseline.kind, None
        counter = D.load_token_counter(args.tokenizer)
        render = D.chat_renderer(args.tokenizer) if args.prompt_text == "chat" or args.dataset == "sharegpt-multiturn" else None
        if render is None and args.prompt_text == "chat":
            raise BenchConfigError("--prompt-text chat needs the target's tokenizer (--tokenizer DIR); or give --prompt-text raw")
        extra = dict(render_chat=render, render_prompts=args.prompt_text == "chat", count_tokens=counter.count,
                     compare_outputs=args.same_model)
    else:
        methods = args.methods.split(",") if args.methods else default_methods(target.settings_path)
        modes = parse_modes(methods, args.prefix_cache)
        url, protocol, metrics_url = target.url, args.protocol, target.metrics_url
        extra = dict(render_chat=D.chat_renderer(args.tokenizer) if args.dataset == "sharegpt-multiturn" else None)
    concurrency = args.concurrency if args.concurrency is not None else ([] if args.request_rate else _ints(DEFAULT_CONCURRENCY))
    loads = [LoadPoint(concurrency=c) for c in concurrency] + [LoadPoint(request_rate=r) for r in args.request_rate]
    return BenchConfig(
        url=url, protocol=protocol, model=args.model, metrics_url=metrics_url,
        modes=tuple(modes), loads=tuple(loads), prefix_cache=args.prefix_cache, **extra,
        max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=tuple(args.stop),
        repeats=args.repeats, block_size=args.block_size, prompts_per_concurrency=args.prompts_per_concurrency,
        warmup=args.warmup, timeout_s=args.timeout,
        arrival_seed=args.seed, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, slo_attainment=args.slo_attainment,
    )


def load_prompts(args) -> D.PromptSet:
    return D.load(args.dataset, args.num_prompts, args.dataset_seed, args.dataset_path, args.tokenizer,
                  args.min_input_tokens, args.max_input_tokens, args.input_tokens, args.input_spread,
                  args.output_tokens, args.output_spread, args.turns)


def server_metadata(config: BenchConfig) -> dict[str, Any]:
    with SpecDecClient(config.url, config.protocol, timeout_s=30) as client:
        return client.server_metadata()


def deployments_metadata(config: BenchConfig) -> dict[str, Any]:
    """Each side's description, and its Triton server's metadata where it has one."""
    out = {}
    for mode in config.modes:
        ep = mode.endpoint
        entry = ep.describe()
        if ep.is_triton:
            try:
                with SpecDecClient(ep.address, "grpc" if ep.kind == "grpc" else "http", timeout_s=30) as client:
                    entry["server"] = client.server_metadata()
            except SpecDecClientError as exc:
                entry["server_error"] = str(exc)
        out[mode.name] = entry
    return {"deployments": out}


# ---- run ---------------------------------------------------------------------------------
def run_with_progress(config: BenchConfig, prompts: list[D.Prompt], show: bool) -> BenchResult:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    total = sum(len(plan.prompt_indices) for plan in schedule(config, len(prompts)))
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, disable=not show, transient=False) as progress:
        task = progress.add_task("warm-up", total=total)
        return asyncio.run(run_bench(
            config, prompts, on_request=lambda: progress.advance(task),
            on_block=lambda plan: progress.update(task, description=f"{plan.load.label} {plan.mode.name}"),
        ))


# ---- report ------------------------------------------------------------------------------
def write_outputs(result: BenchResult, env: dict[str, Any], dataset: dict[str, Any], out: Path) -> dict[str, Any]:
    from specdec_client.report import write_report

    out.mkdir(parents=True, exist_ok=True)
    summary = stamped(build_summary(result, env, dataset))  # commit, clean, date and host at the top (results/)
    write_json(summary, out / "summary.json")
    write_requests(result, out / "requests.jsonl")
    write_report(summary, [r.as_json(result.t0) for r in result.records], out)
    validate(summary)
    return summary


def print_verdicts(summary: dict[str, Any], out: Path) -> None:
    from specdec_client.report import comparing_deployments, verdict_line

    for load in dict.fromkeys(r["load"] for r in summary["runs"]):
        print(verdict_line(load, [s for s in summary["speedup"] if s["load"] == load], comparing_deployments(summary)))
    lossless = summary["lossless"]
    if lossless.get("greedy") and lossless["compared"]:
        print(f"lossless: {lossless['identical']}/{lossless['compared']} speculative outputs identical to the baseline")
    print(f"wrote {out}/summary.json, requests.jsonl, report.md and plots")


def cmd_bench(args) -> int:
    try:
        prompts = load_prompts(args)
        if comparing_deployments(args):
            config = load_config(args, None)
            env = environment(deployments_metadata(config), None)
            result = run_with_progress(config, prompts.prompts, show=not args.no_progress)
        else:
            with target_server(args) as target:
                config = load_config(args, target)
                env = environment(server_metadata(config), target.settings_path)
                result = run_with_progress(config, prompts.prompts, show=not args.no_progress)
    except SpecDecClientError as exc:  # bad option, data set, server or launch
        print(f"specdec-client bench: {exc}", file=sys.stderr)
        return 2
    summary = write_outputs(result, env, prompts.info, args.out)
    print_verdicts(summary, args.out)
    failures = sum(r["failures"] for r in summary["runs"])
    return 1 if failures else 0
