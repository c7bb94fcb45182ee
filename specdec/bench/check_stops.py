"""`specdec check-stops`: stop strings end speculative output exactly where they end the baseline.

For each prompt the baseline first runs without stop strings (greedy, EOS ignored); stop
sets are then taken from that text (a few characters from its middle that may straddle
tokens, two stops where the one listed second comes first, one never met) and a few fixed
ones (" is" / ".", "def" / ":", a newline). The baseline and every served method then run
with each stop set. A case passes when a method's text, output token ids and finish
reason equal the baseline's, and the baseline stopped where plain decoding must: its ids
are the shortest prefix of the unstopped ids whose text contains a stop string (the token
that completed one is the last kept), and its text is that prefix's text cut just before
the earliest stop string in it. With overlapping stops ("abc" and "b") the first to
complete wins: "b" ends the sequence before "abc" can, although "abc" starts earlier.

`--where engine` runs the in-process engine; `--where server` starts the real Triton
server and asks `speculative_loop` (gRPC streaming: text, ids, finish reason) and the
`ensemble` (text, output_tokens, finish reason) alternately.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import specdec_wire as P
from specdec.config import METHOD_NONE, SamplingParams, ServingConfig
from specdec.tools.sharegpt import sharegpt_prompts
from specdec.config import SERVED_SETTINGS, resolve_model_dir
from specdec.serving.runtime import encode_prompt, load_tokenizer
from specdec_client.envinfo import provenance, write_result

FIXED_STOP_SETS = ((" is", "."), ("def", ":"), ("\n",))
NEVER = "\x00never\x00"


@dataclass(frozen=True)
class Outcome:
    text: str
    ids: tuple[int, ...]  # empty from the ensemble (it returns no ids)
    count: int  # output tokens as the server reports them (usage)
    finish_reason: str | None


def stop_sets(text: str) -> list[tuple[str, ...]]:
    """Stop sets for one prompt, from the text the baseline wrote without stops."""
    sets = [*FIXED_STOP_SETS, (NEVER,)]
    n = len(text)
    if n >= 12:
        sets.append((text[n // 2 : n // 2 + 4],))
        sets.append((text[2 * n // 3 : 2 * n // 3 + 3], text[n // 3 : n // 3 + 3]))  # the second listed comes first
    # A slice of the text may be empty or a run of spaces: not a stop anyone would set.
    return [s for s in sets if all(w.strip(" ") or w == " " for w in s) and all(s)]


def stop_cut(ids: Sequence[int], stops: Sequence[str], decode: Callable[[Sequence[int]], str]) -> tuple[int, str]:
    """Where plain decoding with these stops ends an output whose unstopped ids are `ids`:
    (tokens kept, text). Tokens arrive one at a time; the first whose text completes a stop
    string is the last kept, and the text is cut before the earliest stop string then
    present (several may complete in one token). `decode`: ids -> their literal text."""
    for k in range(1, len(ids) + 1):
        text = decode(ids[:k])
        hits = [at for s in stops if (at := text.find(s)) != -1]
        if hits:
            return k, text[: min(hits)]
    return len(ids), decode(ids)


def literal_decoder(tokenizer) -> Callable[[Sequence[int]], str]:
    """The tokens' literal text (no clean-up of spaces), as the server streams it."""
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)


@dataclass(frozen=True)
class Case:
    prompt: int  # index into the prompts
    stops: tuple[str, ...]


def compare(cases: Sequence[Case], unstopped: Sequence[Outcome], runs: dict[str, Sequence[Outcome]],
            decode: Callable[[Sequence[int]], str]) -> dict:
    """Per method: cases equal to the baseline; and whether the baseline cut where it should
    (unstopped outcomes carry ids; the ensemble's stopped ones may not, then their count)."""
    base = runs[METHOD_NONE]
    baseline_wrong = []
    for i, (case, out) in enumerate(zip(cases, base)):
        ids = unstopped[case.prompt].ids
        kept, text = stop_cut(ids, case.stops, decode)
        if out.text != text or out.count != kept or (out.ids and tuple(out.ids) != tuple(ids[:kept])):
            baseline_wrong.append(i)
    report = {"cases": len(cases), "baseline_cut_wrong": baseline_wrong, "methods": {}}
    for method, outs in runs.items():
        if method == METHOD_NONE:
            continue
        diff = [i for i, (b, o) in enumerate(zip(base, outs)) if b != o]
        report["methods"][method] = {"identical": len(cases) - len(diff), "differ": diff[:20],
                                     "stopped": sum(o.finish_reason == "stop" for o in outs)}
    return report


def check(run: Callable, inputs: Sequence, methods: Sequence[str], max_tokens: int, decode: Callable[[Sequence[int]], str],
          progress: Callable = lambda _: None) -> dict:
    """Run the unstopped baseline, then the baseline and every method on every stop set."""
    unstopped = run(inputs, [Case(i, ()) for i in range(len(inputs))], METHOD_NONE, max_tokens, alternate=False)
    cases = [Case(i, s) for i, out in enumerate(unstopped) for s in stop_sets(out.text)]
    runs = {}
    for method in (METHOD_NONE, *methods):
        runs[method] = run(inputs, cases, method, max_tokens)
        progress(f"{method}: {len(cases)} cases done")
    return {**compare(cases, unstopped, runs, decode),
            "examples": [{"stops": c.stops, **asdict(runs[METHOD_NONE][i])} for i, c in enumerate(cases[:12])]}


def passed(report: dict) -> bool:
    return not report["baseline_cut_wrong"] and all(not m["differ"] for m in report["methods"].values())


# ---- in process ---------------------------------------------------------------------------

def engine_runner(settings: ServingConfig, concurrency: int) -> Callable:
    from specdec.bench.bench_serving import in_process_engine

    engine = in_process_engine(settings)

    def run(prompts: Sequence[list[int]], cases: Sequence[Case], method: str, max_tokens: int, alternate: bool = True) -> list[Outcome]:
        k = 0 if method == METHOD_NONE else settings.default_draft_tokens(method)
        outs: dict[int, list] = {}
        todo = list(enumerate(cases))
        while todo or engine.has_work():
            while todo and len(engine.sequences) < concurrency:
                i, case = todo.pop(0)
                params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop=case.stops)
                engine.add_request(str(i), prompts[case.prompt], params, method, k)
                outs[i] = [[], [], None]
            for step in engine.step():
                out = outs[int(step.request_id)]
                out[0].append(step.text_delta)
                out[1] += step.new_token_ids
                out[2] = step.finish_reason
        return [Outcome("".join(outs[i][0]), tuple(outs[i][1]), len(outs[i][1]), outs[i][2]) for i in range(len(cases))]

    return run


# ---- through the server -------------------------------------------------------------------

def server_runner(grpc_url: str, concurrency: int) -> Callable:
    import asyncio

    from specdec_client import AsyncSpecDecClient, GenerateRequest

    def run(texts: Sequence[str], cases: Sequence[Case], method: str, max_tokens: int, alternate: bool = True) -> list[Outcome]:
        async def one(clients, i: int, case: Case, gate) -> Outcome:
            # Alternate the two public models (both run the same loop; the ensemble returns no ids).
            client = clients[i % 2] if alternate else clients[0]
            req = GenerateRequest(texts[case.prompt], max_tokens=max_tokens, stop=case.stops, ignore_eos=True,
                                  method=None if method == METHOD_NONE else method,
                                  num_draft_tokens=0 if method == METHOD_NONE else None)
            async with gate:
                gen = await client.generate(req)
            return Outcome(gen.text, tuple(gen.token_ids), int(gen.perf[P.OUTPUT_TOKENS]), gen.finish_reason)

        async def main() -> list[Outcome]:
            gate = asyncio.Semaphore(concurrency)
            async with AsyncSpecDecClient(grpc_url, model="speculative_loop") as loop, AsyncSpecDecClient(grpc_url, model="ensemble") as ensemble:
                return list(await asyncio.gather(*(one((loop, ensemble), i, c, gate) for i, c in enumerate(cases))))

        return asyncio.run(main())

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specdec check-stops", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--where", choices=("engine", "server"), default="engine")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--methods", default=None, help="comma-separated served methods (default: every one in specdec.json)")
    p.add_argument("--out", default=None, help="JSON report path (default: results/stops/<where>.json)")
    args = p.parse_args(argv)
    settings = ServingConfig.from_file(SERVED_SETTINGS)
    methods = args.methods.split(",") if args.methods else list(settings.methods)
    tokenizer = load_tokenizer(resolve_model_dir(settings.model_dir))
    texts = sharegpt_prompts(args.prompts, seed=7, tokenizer=tokenizer, min_tokens=4, max_tokens=48)
    started = provenance()
    t0 = time.time()
    with _runner(args, settings, tokenizer, texts) as (run, inputs):
        found = check(run, inputs, methods, args.max_tokens, literal_decoder(tokenizer), lambda line: print(f"{line} ({time.time() - t0:.0f} s)", flush=True))
    report = {"where": args.where, "max_tokens": args.max_tokens, "concurrency": args.concurrency,
              "prompts": len(texts), "seconds": round(time.time() - t0), **found}
    out = write_result(args.out or f"results/stops/{args.where}.json", report, started, indent=1, default=list)
    ok = passed(report)
    for method, m in report["methods"].items():
        print(f"{method:24s} identical {m['identical']}/{report['cases']}  stopped {m['stopped']}")
    print(f"baseline cut wrong: {len(report['baseline_cut_wrong'])}; {'PASS' if ok else 'FAIL'} -> {out}")
    return 0 if ok else 1


class _runner:
    """The run function and its inputs (token ids in process, texts through the server)."""

    def __init__(self, args, settings: ServingConfig, tokenizer, texts: list[str]):
        self.args, self.settings, self.tokenizer, self.texts = args, settings, tokenizer, texts
        self.server = None

    def __enter__(self):
        if self.args.where == "engine":
            ids = [encode_prompt(self.tokenizer, t) for t in self.texts]
            return engine_runner(self.settings, self.args.concurrency), ids
        from specdec.launcher import DEFAULT_MODEL_REPOSITORY, TritonServer, free_ports

        http, grpc, metrics = free_ports(3)
        self.server = TritonServer()
        self.server.start(DEFAULT_MODEL_REPOSITORY, http_port=http, grpc_port=grpc, metrics_port=metrics)
        self.server.wait_ready(timeout=600)
        return server_runner(self.server.endpoints.grpc, self.args.concurrency), self.texts

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            self.server.stop()

