"""`specdec format-quality`: how far each quantized weight format's next-token distribution is
from the float32 reference (issue 59) -> results/quantized/quality.json.

Held-out text: the last ShareGPT conversations of the package (the heads train on the first
ones), each conversation's turns joined as plain text, cut to --context tokens. Every position
of every window is one next-token distribution: per format, top-1 agreement with float32 and
KL(float32 || format) (mean, median, 99th percentile) over at least --positions positions. The
same windows and positions for every format, in one run. Nothing is asserted.

llama.cpp's own figure for its Q4_1 file (`llama-perplexity --kl-divergence`) sits beside it
when `--llama-perplexity` names that binary and `--reference-gguf` a float GGUF of the same
weights (`make format-quality` de-quantizes the file with llama-quantize: the numbers our float32
reference holds). llama.cpp chunks the same text with its own tokenizer run, so its position
count differs slightly.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from specdec_client.envinfo import provenance, write_result

from specdec.config import QUANTIZED_WEIGHT_FORMATS, EngineConfig, default_model_dir
from specdec.engine.models.llama import build_batch
from specdec.serving.runtime import load_target, load_tokenizer
from specdec.tools.sharegpt import sharegpt_conversations


def held_out_windows(tokenizer, positions: int, context: int) -> list[list[int]]:
    """Token windows from the last conversations, newest first, until `positions` are covered."""
    windows, total = [], 0
    for conversation in reversed(sharegpt_conversations()):
        ids = tokenizer(" ".join(text for _, text in conversation)).input_ids[:context]
        if len(ids) < 32:
            continue
        windows.append(ids)
        total += len(ids)
        if total >= positions:
            break
    return windows


@torch.inference_mode()
def log_probs(model, windows: list[list[int]]) -> torch.Tensor:
    """[positions, vocab] next-token log probs of every window position, windows in order."""
    out = []
    for window in windows:
        cache = model.new_cache(1, len(window) + 8, len(window))
        slot = cache.allocate()
        out.append(model(build_batch([slot], [0], [window]), cache).logits[0].float().log_softmax(-1))
    return torch.cat(out)


def compare(reference: torch.Tensor, other: torch.Tensor) -> dict:
    kl = (reference.exp() * (reference - other)).sum(-1).clamp_min(0)
    return {"positions": int(kl.numel()), "top1_agreement": round(float((reference.argmax(-1) == other.argmax(-1)).float().mean()), 4),
            "kl_mean": round(float(kl.mean()), 5), "kl_median": round(float(kl.median()), 5),
            "kl_p99": round(float(kl.quantile(0.99)), 5)}


def llama_cpp_kl(binary: Path, reference_gguf: Path, quantized_gguf: Path, text: str, context: int) -> dict:
    """llama-perplexity's KL divergence of the quantized file against the reference file's logits."""
    with tempfile.TemporaryDirectory() as tmp:
        corpus, base = Path(tmp) / "text.txt", Path(tmp) / "base.kld"
        corpus.write_text(text)
        common = ["-f", str(corpus), "-c", str(context), "-b", str(context), "--kl-divergence-base", str(base), "-t", "2"]
        subprocess.run([str(binary), "-m", str(reference_gguf), *common], check=True, capture_output=True, text=True)
        run = subprocess.run([str(binary), "-m", str(quantized_gguf), *common, "--kl-divergence"], check=True,
                             capture_output=True, text=True)
    log = run.stdout + run.stderr
    found = {}
    for key, pattern in (("kl_mean", r"Mean\s+KLD:\s+([-\d.]+)"), ("kl_median", r"Median\s+KLD:\s+([-\d.]+)"),
                         ("kl_p99", r"99\.0%\s+KLD:\s+([-\d.]+)"), ("top1_agreement", r"Same top p:\s+([\d.]+)")):
        match = re.search(pattern, log)
        if match:
            value = float(match.group(1))
            found[key] = round(value / 100 if key == "top1_agreement" else value, 5)
    found["log_tail"] = log[-1500:]
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specdec format-quality", description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default=",".join(QUANTIZED_WEIGHT_FORMATS))
    ap.add_argument("--positions", type=int, default=2048)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--llama-perplexity", type=Path, default=None)
    ap.add_argument("--reference-gguf", type=Path, default=None, help="a float GGUF of the target (llama.cpp's reference)")
    ap.add_argument("--out", type=Path, default=Path("results/quantized/quality.json"))
    args = ap.parse_args(argv)
    tokenizer = load_tokenizer(default_model_dir())
    windows = held_out_windows(tokenizer, args.positions, args.context)
    t0 = time.monotonic()
    reference = log_probs(load_target(None, EngineConfig(weight_format="float32")), windows)
    result = {**provenance(), "command": "specdec format-quality " + " ".join(argv or []), "reference": "float32",
              "windows": len(windows), "context": args.context, "formats": {}}
    for weight_format in args.formats.split(","):
        result["formats"][weight_format] = compare(reference, log_probs(load_target(None, EngineConfig(weight_format=weight_format)), windows))
        print(weight_format, json.dumps(result["formats"][weight_format]), flush=True)
    if args.llama_perplexity and args.reference_gguf:
        from specdec.engine.models.loading import default_gguf_path

        text = "\n".join(tokenizer.decode(w) for w in windows)
        result["llama_cpp_q4_1"] = llama_cpp_kl(args.llama_perplexity, args.reference_gguf, default_gguf_path(), text, args.context)
        print("llama.cpp Q4_1", json.dumps({k: v for k, v in result["llama_cpp_q4_1"].items() if k != "log_tail"}))
    else:
        result["llama_cpp_q4_1"] = None
    result["seconds"] = round(time.monotonic() - t0, 1)
    write_result(args.out, result, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
