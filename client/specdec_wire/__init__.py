"""The wire contract: the public tensors of `ensemble` and `speculative_loop`, their perf outputs, the metric names, the admin-key header and the baseline's method name.
May import: nothing of the project (standard library only).

Defined once; the server, the client and the tests (which check every config.pbtxt against
MODELS) read it. The client-facing names are those of the TensorRT-LLM backend's
`ensemble`, so tools written for Triton + TensorRT-LLM (e.g. posting text_input /
max_tokens / stream to /v2/models/ensemble/generate_stream) work unchanged. The models'
internal contract (verifier, drafter) lives with the Triton glue
(specdec.triton_models.contract).
"""
from __future__ import annotations

from dataclasses import dataclass

# ---- client-facing (ensemble) --------------------------------------------------------
TEXT_INPUT = "text_input"
MAX_TOKENS = "max_tokens"
STREAM = "stream"
TEMPERATURE = "temperature"
TOP_K = "top_k"
TOP_P = "top_p"
RANDOM_SEED = "random_seed"
# TensorRT-LLM ensembles renamed random_seed to seed in May 2025 (tensorrtllm_backend#749);
# clients of either era send theirs, so the request accepts both.
SEED = "seed"
STOP_WORDS = "stop_words"
NUM_DRAFT_TOKENS = "num_draft_tokens"
RETURN_PERF_METRICS = "return_perf_metrics"
# Ours (optional): which drafting method; absent = the server's default method.
SPECULATIVE_METHOD = "speculative_method"
# Ours (optional): apply the chat template to text_input (default from the server config).
APPLY_CHAT_TEMPLATE = "apply_chat_template"
IGNORE_EOS = "ignore_eos"
# TensorRT-LLM ensemble inputs that shape the target's distribution or the output
# (specdec.engine.logits_processing applies them to every tree node, so verification stays lossless).
MIN_LENGTH = "min_length"
# Current TensorRT-LLM ensembles call min_length min_tokens; both are accepted (one setting).
MIN_TOKENS = "min_tokens"
BAD_WORDS = "bad_words"
END_ID = "end_id"
PAD_ID = "pad_id"
EXCLUDE_INPUT_IN_OUTPUT = "exclude_input_in_output"
RETURN_LOG_PROBS = "return_log_probs"
# vLLM's: the likeliest top_logprobs tokens at each emitted position (implies return_log_probs),
# and which distribution the log probs are of ("raw_logprobs" or "processed_logprobs").
TOP_LOGPROBS = "top_logprobs"
LOGPROBS_MODE = "logprobs_mode"
REPETITION_PENALTY = "repetition_penalty"
# vLLM's min_p: after temperature, tokens less likely than min_p x the likeliest are dropped.
MIN_P = "min_p"
# TensorRT-LLM's embedding bias: each word's tokens get its weight added to their logits
# (OpenAI's logit_bias by words); ours by token ids (what the OpenAI front end sends), with
# the same weights tensor.
EMBEDDING_BIAS_WORDS = "embedding_bias_words"
EMBEDDING_BIAS_WEIGHTS = "embedding_bias_weights"
EMBEDDING_BIAS_TOKEN_IDS = "embedding_bias_token_ids"
PRESENCE_PENALTY = "presence_penalty"
FREQUENCY_PENALTY = "frequency_penalty"
# tensorrt_llm_bls's switch for logits-comparison drafting: accepted and ignored (the
# verifier always compares against the target's distribution; specdec.engine.acceptance).
USE_DRAFT_LOGITS = "use_draft_logits"
# TensorRT-LLM's token counts, each returned only when its flag is set.
RETURN_NUM_INPUT_TOKENS = "return_num_input_tokens"
RETURN_NUM_OUTPUT_TOKENS = "return_num_output_tokens"
NUM_INPUT_TOKENS = "num_input_tokens"  # the prompt's tokens (chat template included)
NUM_OUTPUT_TOKENS = "num_output_tokens"  # the token ids this response carries (TensorRT-LLM's count)
# TensorRT-LLM's structured output: the guide's type ("json", "json_schema", "regex",
# "ebnf_grammar") and its text (a JSON schema, a regex, an EBNF grammar; none for "json").
GUIDED_DECODING_GUIDE_TYPE = "guided_decoding_guide_type"
GUIDED_DECODING_GUIDE = "guided_decoding_guide"
# vLLM's prefix-cache isolation: requests share cached KV (and the suffix method's learnt
# continuations) only with requests of the same salt; "" or absent is one shared scope.
CACHE_SALT = "cache_salt"

# Ours: the speculative_method that turns speculation off (the matched baseline).
METHOD_NONE = "none"

# speculative_loop also takes and returns token ids (like TensorRT-LLM's tensorrt_llm_bls).
INPUT_IDS = "input_ids"
OUTPUT_IDS = "output_ids"

TEXT_OUTPUT = "text_output"
ACCEPTANCE_RATE = "acceptance_rate"
TOTAL_ACCEPTED_DRAFT_TOKENS = "total_accepted_draft_tokens"
TOTAL_DRAFT_TOKENS = "total_draft_tokens"
# Ours: of total_accepted_draft_tokens, those the request's grammar forced (drafted without
# the drafter, specdec/engine/grammar.py); the drafter's own = the difference.
TOTAL_ACCEPTED_FORCED_TOKENS = "total_accepted_forced_tokens"
# Ours: verification steps so far (mean acceptance length = output tokens / steps).
VERIFICATION_STEPS = "verification_steps"
# vLLM's RequestOutput.num_cached_tokens: prompt tokens whose KV came from the prefix cache.
NUM_CACHED_TOKENS = "num_cached_tokens"
OUTPUT_TOKENS = "output_tokens"
# Ours: why the request ended ("stop", "length", "eos", "cancelled"; "" until the last response).
FINISH_REASON = "finish_reason"
# TensorRT-LLM's log-prob outputs (with return_log_probs): per emitted token, and their sum.
OUTPUT_LOG_PROBS = "output_log_probs"
CUM_LOG_PROBS = "cum_log_probs"
# Ours, with top_logprobs: [beam, tokens, top_logprobs] token ids and their log probs.
TOP_LOG_PROB_IDS = "top_log_prob_ids"
TOP_LOG_PROBS = "top_log_probs"

@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # Triton config type, e.g. TYPE_INT32
    dims: tuple[int, ...]
    optional: bool = False


def tensor_specs(*rows: tuple) -> dict[str, TensorSpec]:
    return {row[0]: TensorSpec(*row) for row in rows}


SAMPLING_INPUTS = (
    (TEMPERATURE, "TYPE_FP32", (1,), True),
    (TOP_K, "TYPE_INT32", (1,), True),
    (TOP_P, "TYPE_FP32", (1,), True),
    (RANDOM_SEED, "TYPE_UINT64", (1,), True),
)
PENALTY_INPUTS = (
    (REPETITION_PENALTY, "TYPE_FP32", (1,), True),
    (PRESENCE_PENALTY, "TYPE_FP32", (1,), True),
    (FREQUENCY_PENALTY, "TYPE_FP32", (1,), True),
)
REQUEST_INPUTS = (
    (MAX_TOKENS, "TYPE_INT32", (1,)),
    (STREAM, "TYPE_BOOL", (1,), True),
    *SAMPLING_INPUTS,
    (SEED, "TYPE_UINT64", (1,), True),
    (STOP_WORDS, "TYPE_STRING", (-1,), True),
    (NUM_DRAFT_TOKENS, "TYPE_INT32", (1,), True),
    (RETURN_PERF_METRICS, "TYPE_BOOL", (1,), True),
    (SPECULATIVE_METHOD, "TYPE_STRING", (1,), True),
    (IGNORE_EOS, "TYPE_BOOL", (1,), True),
    (MIN_LENGTH, "TYPE_INT32", (1,), True),
    (MIN_TOKENS, "TYPE_INT32", (1,), True),
    (BAD_WORDS, "TYPE_STRING", (-1,), True),
    (END_ID, "TYPE_INT32", (1,), True),
    (PAD_ID, "TYPE_INT32", (1,), True),
    (EXCLUDE_INPUT_IN_OUTPUT, "TYPE_BOOL", (1,), True),
    (RETURN_LOG_PROBS, "TYPE_BOOL", (1,), True),
    (TOP_LOGPROBS, "TYPE_INT32", (1,), True),
    (LOGPROBS_MODE, "TYPE_STRING", (1,), True),
    *PENALTY_INPUTS,
    (MIN_P, "TYPE_FP32", (1,), True),
    (EMBEDDING_BIAS_WORDS, "TYPE_STRING", (-1,), True),
    (EMBEDDING_BIAS_WEIGHTS, "TYPE_FP32", (-1,), True),
    (EMBEDDING_BIAS_TOKEN_IDS, "TYPE_INT32", (-1,), True),
    (USE_DRAFT_LOGITS, "TYPE_BOOL", (1,), True),
    (RETURN_NUM_INPUT_TOKENS, "TYPE_BOOL", (1,), True),
    (RETURN_NUM_OUTPUT_TOKENS, "TYPE_BOOL", (1,), True),
    (GUIDED_DECODING_GUIDE_TYPE, "TYPE_STRING", (1,), True),
    (GUIDED_DECODING_GUIDE, "TYPE_STRING", (1,), True),
    (CACHE_SALT, "TYPE_STRING", (1,), True),
)
# Running totals the loop reports with every response (and the rate derived from them).
PERF_COUNTS = (
    (TOTAL_ACCEPTED_DRAFT_TOKENS, "TYPE_INT32", (1,)),
    (TOTAL_DRAFT_TOKENS, "TYPE_INT32", (1,)),
    (TOTAL_ACCEPTED_FORCED_TOKENS, "TYPE_INT32", (1,)),
    (VERIFICATION_STEPS, "TYPE_INT32", (1,)),
    (OUTPUT_TOKENS, "TYPE_INT32", (1,)),
    (NUM_CACHED_TOKENS, "TYPE_INT32", (1,)),
)
PERF_OUTPUTS = ((ACCEPTANCE_RATE, "TYPE_FP32", (1,)), *PERF_COUNTS, (FINISH_REASON, "TYPE_STRING", (1,)))
# With return_log_probs (TensorRT-LLM's shapes: [beam] and [beam, tokens], one beam here).
LOG_PROB_OUTPUTS = ((CUM_LOG_PROBS, "TYPE_FP32", (-1,)), (OUTPUT_LOG_PROBS, "TYPE_FP32", (-1, -1)),
                    (TOP_LOG_PROB_IDS, "TYPE_INT32", (-1, -1, -1)), (TOP_LOG_PROBS, "TYPE_FP32", (-1, -1, -1)))
# With return_num_input_tokens / return_num_output_tokens (TensorRT-LLM's names and shapes).
TOKEN_COUNT_OUTPUTS = ((NUM_INPUT_TOKENS, "TYPE_INT32", (1,)), (NUM_OUTPUT_TOKENS, "TYPE_INT32", (1,)))

# model name -> (inputs, outputs); the tests compare each config.pbtxt with these.
ENSEMBLE_CONTRACT = (
    tensor_specs((TEXT_INPUT, "TYPE_STRING", (1,)), (APPLY_CHAT_TEMPLATE, "TYPE_BOOL", (1,), True), *REQUEST_INPUTS),
    tensor_specs((TEXT_OUTPUT, "TYPE_STRING", (1,)), *PERF_OUTPUTS, *LOG_PROB_OUTPUTS, *TOKEN_COUNT_OUTPUTS),
)
# The non-decoupled twin of `ensemble` for unary clients (gRPC ModelInfer / HTTP infer:
# tritonclient's .infer, perf_analyzer without --streaming). Triton (2.51) refuses unary
# inference on any decoupled model, so one name cannot serve both; `ensemble` streams.
ENSEMBLE_UNARY = "ensemble_unary"

MODELS: dict[str, tuple[dict[str, TensorSpec], dict[str, TensorSpec]]] = {
    "ensemble": ENSEMBLE_CONTRACT,
    ENSEMBLE_UNARY: ENSEMBLE_CONTRACT,
    # The ensemble's contract plus token ids (like TensorRT-LLM's tensorrt_llm_bls); the
    # same loop serves both names (specdec.triton_models.loop_model).
    "speculative_loop": (
        tensor_specs(
            (TEXT_INPUT, "TYPE_STRING", (1,), True), (APPLY_CHAT_TEMPLATE, "TYPE_BOOL", (1,), True),
            (INPUT_IDS, "TYPE_INT32", (-1,), True), *REQUEST_INPUTS,
        ),
        tensor_specs((TEXT_OUTPUT, "TYPE_STRING", (1,)), (OUTPUT_IDS, "TYPE_INT32", (-1,)), *PERF_OUTPUTS, *LOG_PROB_OUTPUTS,
                     *TOKEN_COUNT_OUTPUTS),
    ),
}


# Triton's administrative APIs are restricted (specdec.launcher.admin): callers send this
# header with the server's admin key, which the client reads from SPECDEC_ADMIN_KEY.
ADMIN_KEY_ENV = "SPECDEC_ADMIN_KEY"
ADMIN_KEY_HEADER = "specdec-admin-key"
ADMIN_KEY_GRPC_HEADER = "triton-grpc-protocol-" + ADMIN_KEY_HEADER  # Triton's prefix for gRPC metadata

# Head promotion (issue 62; `specdec-client promote`): an admin request to the model that
# hosts the engine, carrying PROMOTE_HEADS (JSON: drafting kind -> a head directory on the
# server) and the admin key in ADMIN_KEY; every co-located method of that kind then drafts
# with the new head, from the next sequence on. HEAD_PARAMETERS: kind -> the head's name in
# messages and in the client's flags.
HEAD_PARAMETERS = {"eagle3": "eagle3_head", "medusa": "medusa_heads"}
ENGINE_HOST_MODEL = "ensemble"
PROMOTE_HEADS = "promote_heads"
ADMIN_KEY = "admin_key"


# ---- Prometheus metrics on Triton's metrics port (served by the models, read by the client's
# benchmark and the tests). Labels: method; position (per-position counters); reason
# (requests); model (active sequences, slot occupancy and wait). Histograms are real
# Prometheus histograms (`<name>_bucket{le=...}`, `_sum`, `_count`; Python backend
# MetricFamily.HISTOGRAM, Triton >= 2.51). ---------------------------------------------------
DRAFT_TOKENS_TOTAL = "specdec_draft_tokens_total"
ACCEPTED_TOKENS_TOTAL = "specdec_accepted_tokens_total"
EMITTED_TOKENS_TOTAL = "specdec_emitted_tokens_total"
VERIFICATION_STEPS_TOTAL = "specdec_verification_steps_total"
DRAFTED_PER_POSITION_TOTAL = "specdec_drafted_per_position_total"
ACCEPTED_PER_POSITION_TOTAL = "specdec_accepted_per_position_total"
ACCEPTANCE_LENGTH = "specdec_acceptance_length"
DRAFT_SECONDS_TOTAL = "specdec_draft_seconds_total"
VERIFY_SECONDS_TOTAL = "specdec_verify_seconds_total"
STEP_SECONDS_TOTAL = "specdec_step_seconds_total"
REQUESTS_TOTAL = "specdec_requests_total"
ACTIVE_SEQUENCES = "specdec_active_sequences"
# Admission, from the loop (`ensemble`, `speculative_loop`): a request waiting for a sequence
# slot waits inside the decoupled loop, where Triton's queue metrics never see it.
SLOT_OCCUPANCY = "specdec_slot_occupancy"
SLOT_WAIT_SECONDS = "specdec_slot_wait_seconds"
SLOT_WAITING = "specdec_slot_waiting_requests"
# Bucket upper bounds (le). Tokens per step are whole numbers; slot waits run up to
# admission_timeout_s (60 s by default).
ACCEPTANCE_LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32)
SLOT_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60)
# The budget planner's current beliefs (adaptive methods; specdec.engine.planner), from the verifier.
ACCEPTANCE_ESTIMATE = "specdec_acceptance_estimate"
PLANNED_TOKENS_PER_SECOND = "specdec_planned_tokens_per_second"
# 1, labelled with how the target's forward runs: weight_format, forward (native or per-op) and
# kernel_path (reference, avx2, avx512_vnni, amx; none for float weights)
ENGINE_INFO = "specdec_engine_info"
# In-flight batching (the verifier's scheduler): how many live sequences share each target
# forward; a median near the live streams means streams are not split into groups.
BATCH_SEQUENCES = "specdec_batch_sequences"
BATCH_SEQUENCES_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
PREFILL_CHUNKED_ROUNDS_TOTAL = "specdec_prefill_chunked_rounds_total"
# Prefix caching, token-level as vLLM counts it (hit rate = hits / queries): prompt tokens
# looked up, and of those the ones whose KV was reused; requests that reused any.
PREFIX_CACHE_QUERIES_TOTAL = "specdec_prefix_cache_queries_total"
PREFIX_CACHE_HITS_TOTAL = "specdec_prefix_cache_hits_total"
PREFIX_CACHE_HIT_REQUESTS_TOTAL = "specdec_prefix_cache_hit_requests_total"
VERIFIER_METRICS = {
    PREFILL_CHUNKED_ROUNDS_TOTAL: ("counter", "Target forwards that carried part of a prompt, its rest left for later rounds, "
                                              "beside running sequences (chunked prefill)"),
    BATCH_SEQUENCES: ("histogram", "Sequences in each target forward (prompt chunks, decode steps and trees together)",
                      BATCH_SEQUENCES_BUCKETS),
    ACTIVE_SEQUENCES: ("gauge", "Sequences holding a KV-cache slot"),
    PREFIX_CACHE_QUERIES_TOTAL: ("counter", "Prompt tokens looked up in the prefix cache"),
    PREFIX_CACHE_HITS_TOTAL: ("counter", "Prompt tokens whose KV came from the prefix cache (not computed)"),
    PREFIX_CACHE_HIT_REQUESTS_TOTAL: ("counter", "Requests that reused at least one cached prompt token"),
    ACCEPTANCE_ESTIMATE: ("gauge", "Estimated chance that draft position `position` is accepted given the one before, per `method`"),
    PLANNED_TOKENS_PER_SECOND: ("gauge", "Tokens per second the planner expects of its last planned step"),
    ENGINE_INFO: ("gauge", "1, labelled with the target's weight_format, forward (native or per-op) and kernel_path"),
}

# name -> (kind, help[, buckets]) of what the speculative loop exports.
LOOP_METRICS = {
    DRAFT_TOKENS_TOTAL: ("counter", "Draft tokens proposed"),
    ACCEPTED_TOKENS_TOTAL: ("counter", "Draft tokens accepted by the target"),
    EMITTED_TOKENS_TOTAL: ("counter", "Tokens emitted (accepted + bonus/recovered)"),
    VERIFICATION_STEPS_TOTAL: ("counter", "Target verification steps"),
    DRAFTED_PER_POSITION_TOTAL: ("counter", "Drafts that reached draft position `position`"),
    ACCEPTED_PER_POSITION_TOTAL: ("counter", "Drafts accepted at draft position `position`"),
    ACCEPTANCE_LENGTH: ("histogram", "Tokens emitted per verification step (bonus or recovered included)", ACCEPTANCE_LENGTH_BUCKETS),
    DRAFT_SECONDS_TOTAL: ("counter", "Time spent drafting (beside the target, or in the drafter model)"),
    VERIFY_SECONDS_TOTAL: ("counter", "Time spent verifying (target forward + acceptance)"),
    STEP_SECONDS_TOTAL: ("counter", "Wall time of verification steps as the loop sees them (calls included)"),
    REQUESTS_TOTAL: ("counter", "Finished requests by finish reason"),
    SLOT_OCCUPANCY: ("gauge", "Fraction of the server's sequence slots held by this model's requests (sum over `model`: the server's)"),
    SLOT_WAITING: ("gauge", "Requests of this model waiting for a sequence slot now"),
    SLOT_WAIT_SECONDS: ("histogram", "Time a request waited for a sequence slot (admitted or refused as busy)", SLOT_WAIT_BUCKETS),
}
