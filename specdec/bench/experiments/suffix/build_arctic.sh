#!/usr/bin/env bash
# Builds Arctic Inference's suffix-decoding extension alone (C++ suffix trees + its Python
# SuffixDecodingCache) into the project's venv, for the `arctic_suffix` comparison method.
# The full arctic-inference package needs vLLM and a GPU torch to build; its suffix
# decoding does not. Needs the package index (pip download), cmake, ninja and a C++20 compiler.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
VENV=${VENV:-.venv}
WORK=$(mktemp -d)
"$VENV/bin/pip" download -q arctic-inference==0.3.0 --no-deps --no-binary :all: -d "$WORK"
tar xzf "$WORK"/arctic_inference-0.3.0.tar.gz -C "$WORK"
SRC="$WORK/arctic_inference-0.3.0"
"$VENV/bin/pip" install -q --target "$WORK/deps" nanobind==2.9.2
mkdir -p "$SRC/csrc/suffix_decoding/build"
(cd "$SRC/csrc/suffix_decoding/build" && PYTHONPATH="$WORK/deps" cmake .. -G Ninja -DPython_EXECUTABLE="$(realpath "$VENV/bin/python")" >/dev/null && ninja -j2 >/dev/null)
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$SITE/arctic_inference/suffix_decoding"
: > "$SITE/arctic_inference/__init__.py"
cp "$SRC/arctic_inference/suffix_decoding/"*.py "$SRC"/csrc/suffix_decoding/build/_C*.so "$SITE/arctic_inference/suffix_decoding/"
cp "$SRC/LICENSE" "$SITE/arctic_inference/" 2>/dev/null || true
"$VENV/bin/python" -c 'from arctic_inference.suffix_decoding import SuffixDecodingCache; SuffixDecodingCache(24); print("arctic_inference suffix decoding: OK")'
