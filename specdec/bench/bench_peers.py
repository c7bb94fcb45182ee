"""`specdec bench-peers`: llama.cpp beside our server on the same GGUF, in one run -> results/peers/.

llama-server (built portable by `specdec.bench.llama_cpp` into tmp/llamacpp) serves the
embedded target's GGUF plain and with its own prompt-lookup speculation; our Triton server
serves the same model plain and with our methods. One `specdec-client bench` run per load
point puts them all in the same interleaved blocks of the same prompts, with llama.cpp plain
as the baseline, so every ratio in the report is measured side by side. At c=16 each llama-server has 16 slots (`-np 16`).

Our server runs once per weight format asked (`--weight-formats`, engine.weight_format):
int8 (the served default) and gguf (the file's own Q4_1/Q8_0 codes) by default, both on our
row-invariant int8 kernels, and float32 (the de-quantized weights) when asked; each its own
Triton server, all in the same blocks. The engines round differently (both quantize activations
to 8 bits in blocks of 32, with their own kernels), so greedy outputs may part between engines
while each is exact for its own weights: identity is counted within each engine and format.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

from specdec_client.bench import RequestRecord
from specdec_client.envinfo import write_result
from specdec_client.summary import identical_outputs

from specdec.config import REPO_ROOT, SERVED_SETTINGS
from specdec.engine.models.loading import default_gguf_path
from specdec.launcher import DEFAULT_MODEL_REPOSITORY, TritonServer, free_ports
from specdec.bench.llama_cpp import build

LLAMA_DIR = REPO_ROOT / "tmp" / "llamacpp"
LLAMA_PLAIN, OURS_PLAIN = "llama.cpp", "ours"  # each engine's plain decoding, the labels identity is counted against


def ours_label(method: str, weight_format: str = "float32") -> str:
    """ours, ours-eagle3-hybrid for float32 (the labels before the int8 default); ours-int8,
    ours-int8-eagle3-hybrid and so on for the other formats."""
    engine = OURS_PLAIN if weight_format == "float32" else f"{OURS_PLAIN}-{weight_format}"
    return engine if method == "none" else f"{engine}-{method}"


def settings_for(weight_format: str, out: Path) -> Path:
    """The served specdec.json with engine.weight_format set, for one of our servers."""
    settings = json.loads(SERVED_SETTINGS.read_text())
    settings["engine"]["weight_format"] = weight_format
    path = out / f"specdec-{weight_format}.json"
    path.write_text(json.dumps(settings, indent=1))
    return path


def llama_server_binary(version: str) -> Path:
    binary = LLAMA_DIR / "build" / "bin" / "llama-server"
    if not binary.is_file():
        build(version, LLAMA_DIR, os.cpu_count() or 2)
    return binary


def server_help(binary: Path) -> str:
    return subprocess.run([str(binary), "--help"], capture_output=True, text=True).stdout


def llama_configs(binary: Path) -> dict[str, list[str]]:
    """llama-server's configurations: plain, and its prompt-lookup speculation (`ngram-simple`,
    sized as our `ngram`: a 3-token lookup, 4 drafted). Not its draft-model mode: the draft
    model this project ships drafts over a reduced vocabulary (d2t) from the target's shared
    embedding, and llama.cpp's draft-simple takes only a standalone full-vocabulary model."""
    if "ngram-simple" not in server_help(binary):
        raise SystemExit(f"{binary}: this llama-server has no --spec-type ngram-simple")
    return {LLAMA_PLAIN: [],
            f"{LLAMA_PLAIN}-ngram": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "4"]}


@contextlib.contextmanager
def llama_server(binary: Path, extra: list[str], slots: int, threads: int, log: Path, context_per_slot: int = 2048) -> Iterator[str]:
    """One llama-server on a free port; yields its OpenAI base URL."""
    (port,) = free_ports(1)
    cmd = [str(binary), "-m", str(default_gguf_path()), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-np", str(slots), "-c", str(context_per_slot * slots), "--no-webui",
           # an HTTP thread per streaming slot and a few for /health and /models, not left to
           # the build's default
           "--threads-http", str(slots + 4), *extra]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({proc.returncode}): {' '.join(cmd)}; see {log}")
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server not healthy after 300 s; see {log}")
            time.sleep(0.5)
        yield f"openai+http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        if proc.poll() is None:
            proc.kill()


def identity_within_engines(requests_jsonl: Path, engines: dict[str, str]) -> dict[str, dict]:
    """Greedy identity where it is a claim: each speculative configuration against its own
    engine's plain one (label -> plain label; the bench's mode names add "/no-cache")."""
    records = [RequestRecord(**json.loads(line)) for line in requests_jsonl.read_text().splitlines()]
    mode_of = {r.mode.split("/")[0]: r.mode for r in records}
    out = {}
    for label, plain in engines.items():
        compared, identical = identical_outputs(records, mode_of[plain], [mode_of[label]])[mode_of[label]]
        out[label] = {"against": plain, "compared": compared, "identical": identical}
    return out


@contextlib.contextmanager
def our_server(weight_format: str, out: Path) -> Iterator[tuple[int, int]]:
    """Our Triton server serving the target in one weight format; yields its gRPC and metrics ports."""
    http, grpc, metrics = free_ports(3)
    with TritonServer(log_path=out / f"triton-{weight_format}.log") as server:
        server.start(DEFAULT_MODEL_REPOSITORY, http_port=http, grpc_port=grpc, metrics_port=metrics,
                     env={"SPECDEC_SETTINGS": str(settings_for(weight_format, out).resolve())})
        server.wait_ready(timeout=600)
        yield grpc, metrics


def run(args) -> dict:
    binary = llama_server_binary(args.llama_cpp_version)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = llama_configs(binary)
    with contextlib.ExitStack() as servers:
        ours = {fmt: servers.enter_context(our_server(fmt, out)) for fmt in args.weight_formats}
        for concurrency in args.concurrency:
            with contextlib.ExitStack() as stack:
                urls = {name: stack.enter_context(llama_server(binary, extra, concurrency, args.threads,
                                                               out / f"llama-server-{name}-c{concurrency}.log"))
                        for name, extra in configs.items()}
                baseline, *others = urls.items()
                cmd = [str(Path(sys.executable).parent / "specdec-client"), "bench", "--baseline", f"{baseline[1]}?name={baseline[0]}"]
                for name, url in others:
                    cmd += ["--candidate", f"{url}?name={name}"]
                for fmt, (grpc, metrics) in ours.items():
                    for method in ["none", *args.ours]:
                        cmd += ["--candidate", f"grpc://127.0.0.1:{grpc}?method={method}&name={ours_label(method, fmt)}"
                                               f"&metrics=http://127.0.0.1:{metrics}/metrics"]
                prompts = args.prompts_per_concurrency * concurrency if concurrency > 1 else args.prompts
                cmd += ["--concurrency", str(concurrency), "--num-prompts", str(prompts),
                        "--max-tokens", str(args.max_tokens), "--warmup", "2", "--prefix-cache", "off", "--no-progress",
                        "--out", str(out / f"c{concurrency}")]
                print("+", " ".join(cmd), flush=True)
                subprocess.run(cmd, check=True)
    return collect(out, configs, args.ours, args.concurrency, args.weight_formats)


def collect(out: Path, configs: dict[str, list[str]], ours: list[str], concurrencies: list[int],
            weight_formats: list[str] = ("float32",)) -> dict:
    """peers.json from the load points' folders: per load point the bench summary, with the
    greedy identity of each speculative mode against its own engine's plain mode."""
    engines = {name: LLAMA_PLAIN for name in configs if name != LLAMA_PLAIN}
    for fmt in weight_formats:
        engines.update({ours_label(m, fmt): ours_label("none", fmt) for m in ours})
    results = {"llama_server_command_extras": configs, "ours_methods": ours, "ours_weight_formats": list(weight_formats),
               "load_points": {}}
    for concurrency in concurrencies:
        summary = json.loads((out / f"c{concurrency}" / "summary.json").read_text())
        summary["identity_within_engines"] = identity_within_engines(out / f"c{concurrency}" / "requests.jsonl", engines)
        results["load_points"][str(concurrency)] = summary
    results["env"] = results["load_points"][str(concurrencies[0])]["env"]  # commit, date, machine (readme-tables)
    write_result(out / "peers.json", results, indent=1)
    print(f"wrote {out / 'peers.json'}")
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="results/peers")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    parser.add_argument("--ours", type=lambda s: [m for m in s.split(",") if m], default=["eagle3-hybrid", "suffix"],
                        help="our methods beside our baseline")
    parser.add_argument("--weight-formats", type=lambda s: [f for f in s.split(",") if f], default=["int8", "gguf"],
                        help="our server once per engine.weight_format")
    parser.add_argument("--prompts", type=int, default=16, help="prompts at c=1")
    parser.add_argument("--prompts-per-concurrency", type=int, default=2, help="prompts per slot at c>1")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama-server threads")
    parser.add_argument("--llama-cpp-version", default="11434.0.0")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specdec bench-peers", description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
