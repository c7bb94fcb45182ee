"""Tensor names and types of the served models: defined once, used by the Triton adapters,
the client and the tests (which check every config.pbtxt against these tables).

The client-facing names are those of the TensorRT-LLM backend's `ensemble`, so tools
written for Triton + TensorRT-LLM (e.g. posting text_input / max_tokens / stream to
/v2/models/ensemble/generate_stream) work unchanged.
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
# (specdec/logits_processing.py applies them to every tree node, so verification stays lossless).
MIN_LENGTH = "min_length"
BAD_WORDS = "bad_words"
END_ID = "end_id"
PAD_ID = "pad_id"
EXCLUDE_INPUT_IN_OUTPUT = "exclude_input_in_output"
RETURN_LOG_PROBS = "return_log_probs"
REPETITION_PENALTY = "repetition_penalty"
PRESENCE_PENALTY = "presence_penalty"
FREQUENCY_PENALTY = "frequency_penalty"

TEXT_OUTPUT = "text_output"
ACCEPTANCE_RATE = "acceptance_rate"
TOTAL_ACCEPTED_DRAFT_TOKENS = "total_accepted_draft_tokens"
TOTAL_DRAFT_TOKENS = "total_draft_tokens"
# Ours: verification steps so far (mean acceptance length = output tokens / steps).
VERIFICATION_STEPS = "verification_steps"
OUTPUT_TOKENS = "output_tokens"
# Ours: why the request ended ("stop", "length", "eos", "cancelled"; "" until the last response).
FINISH_REASON = "finish_reason"
# TensorRT-LLM's log-prob outputs (with return_log_probs): per emitted token, and their sum.
OUTPUT_LOG_PROBS = "output_log_probs"
CUM_LOG_PROBS = "cum_log_probs"

# ---- internal (between models) -------------------------------------------------------
INPUT_IDS = "input_ids"
OUTPUT_IDS = "output_ids"
NUM_ACCEPTED = "num_accepted"
DRAFT_BUDGET = "draft_budget"
DRAFT_TOKENS = "draft_tokens"
DRAFT_PARENTS = "draft_parents"
DRAFT_PROBS = "draft_probs"
HIDDEN_STATES = "hidden_states"
# The request's logits rules at token level, for the verifier only (the loop resolves them):
# the ids that end a sequence (banned before min_length) and the bad words as token ids,
# flattened with BAD_WORDS_SEPARATOR after each word.
END_IDS = "end_ids"
BAD_WORDS_IDS = "bad_words_ids"
BAD_WORDS_SEPARATOR = -1
RETURN_HIDDEN = "return_hidden"
# The verifier's per-step numbers in one FP32 vector (one tensor, not six, per response).
STEP_STATS = "step_stats"
STEP_STATS_FIELDS = ("accepted", "draft_depth", "draft_tokens", "verify_seconds", "draft_seconds")

# Proof that a call to the verifier or the drafter comes from the speculative loop: a
# per-server secret, generated at start-up into this environment variable (never logged).
INTERNAL_KEY = "internal_key"
INTERNAL_KEY_ENV = "SPECDEC_INTERNAL_KEY"

# Triton's administrative APIs (restricted-API feature): callers must send this header with
# the server's admin key (SPECDEC_ADMIN_KEY). Health, metadata and inference stay open.
ADMIN_KEY_ENV = "SPECDEC_ADMIN_KEY"
ADMIN_KEY_HEADER = "specdec-admin-key"
ADMIN_KEY_GRPC_HEADER = "triton-grpc-protocol-" + ADMIN_KEY_HEADER  # Triton's prefix for gRPC metadata
RESTRICTED_APIS = ("model-repository", "logging", "trace", "shared-memory", "statistics")


def restricted_api_args(admin_key: str) -> list[str]:
    """tritonserver flags that put RESTRICTED_APIS behind ADMIN_KEY_HEADER, HTTP and gRPC."""
    spec = f"{','.join(RESTRICTED_APIS)}:{ADMIN_KEY_HEADER}={admin_key}"
    return [f"--http-restricted-api={spec}", f"--grpc-restricted-protocol={spec}"]

# Sequence-batcher control inputs of the stateful drafter and verifier.
CONTROL_START = "START"
CONTROL_END = "END"
CONTROL_READY = "READY"
CONTROL_CORRID = "CORRID"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # Triton config type, e.g. TYPE_INT32
    dims: tuple[int, ...]
    optional: bool = False


def _specs(*rows: tuple) -> dict[str, TensorSpec]:
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
# Sampling settings as the loop sends them to the verifier and the drafter (request.encode_sampling).
WIRE_SAMPLING_INPUTS = ((MAX_TOKENS, "TYPE_INT32", (1,), True), *SAMPLING_INPUTS)
# ... and what only the verifier needs: the logits rules, and whether to return log probs.
WIRE_RULES_INPUTS = (
    (MIN_LENGTH, "TYPE_INT32", (1,), True),
    (END_IDS, "TYPE_INT32", (-1,), True),
    (BAD_WORDS_IDS, "TYPE_INT32", (-1,), True),
    *PENALTY_INPUTS,
    (RETURN_LOG_PROBS, "TYPE_BOOL", (1,), True),
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
    (BAD_WORDS, "TYPE_STRING", (-1,), True),
    (END_ID, "TYPE_INT32", (1,), True),
    (PAD_ID, "TYPE_INT32", (1,), True),
    (EXCLUDE_INPUT_IN_OUTPUT, "TYPE_BOOL", (1,), True),
    (RETURN_LOG_PROBS, "TYPE_BOOL", (1,), True),
    *PENALTY_INPUTS,
)
# Running totals the loop reports with every response (and the rate derived from them).
PERF_COUNTS = (
    (TOTAL_ACCEPTED_DRAFT_TOKENS, "TYPE_INT32", (1,)),
    (TOTAL_DRAFT_TOKENS, "TYPE_INT32", (1,)),
    (VERIFICATION_STEPS, "TYPE_INT32", (1,)),
    (OUTPUT_TOKENS, "TYPE_INT32", (1,)),
)
PERF_OUTPUTS = ((ACCEPTANCE_RATE, "TYPE_FP32", (1,)), *PERF_COUNTS, (FINISH_REASON, "TYPE_STRING", (1,)))
# With return_log_probs (TensorRT-LLM's shapes: [beam] and [beam, tokens], one beam here).
LOG_PROB_OUTPUTS = ((CUM_LOG_PROBS, "TYPE_FP32", (-1,)), (OUTPUT_LOG_PROBS, "TYPE_FP32", (-1, -1)))

# model name -> (inputs, outputs); the tests compare each config.pbtxt with these.
MODELS: dict[str, tuple[dict[str, TensorSpec], dict[str, TensorSpec]]] = {
    "ensemble": (
        _specs((TEXT_INPUT, "TYPE_STRING", (1,)), (APPLY_CHAT_TEMPLATE, "TYPE_BOOL", (1,), True), *REQUEST_INPUTS),
        _specs((TEXT_OUTPUT, "TYPE_STRING", (1,)), *PERF_OUTPUTS, *LOG_PROB_OUTPUTS),
    ),
    # The ensemble's contract plus token ids (like TensorRT-LLM's tensorrt_llm_bls); the
    # same loop serves both names (specdec_triton/loop_model.py).
    "speculative_loop": (
        _specs(
            (TEXT_INPUT, "TYPE_STRING", (1,), True), (APPLY_CHAT_TEMPLATE, "TYPE_BOOL", (1,), True),
            (INPUT_IDS, "TYPE_INT32", (-1,), True), *REQUEST_INPUTS,
        ),
        _specs((TEXT_OUTPUT, "TYPE_STRING", (1,)), (OUTPUT_IDS, "TYPE_INT32", (-1,)), *PERF_OUTPUTS, *LOG_PROB_OUTPUTS),
    ),
    # One speculation step per call: verify the tree (drafted beside the target last step,
    # or handed in by a drafter served apart), then draft the next with the co-located drafter.
    "verifier": (
        _specs(
            (INPUT_IDS, "TYPE_INT32", (-1,), True),
            (SPECULATIVE_METHOD, "TYPE_STRING", (1,), True),
            (DRAFT_BUDGET, "TYPE_INT32", (1,), True),
            (DRAFT_TOKENS, "TYPE_INT32", (-1,), True),
            (DRAFT_PARENTS, "TYPE_INT32", (-1,), True),
            (DRAFT_PROBS, "TYPE_FP32", (-1, -1), True),
            (RETURN_HIDDEN, "TYPE_BOOL", (1,), True),
            (INTERNAL_KEY, "TYPE_STRING", (1,), True),
            *WIRE_SAMPLING_INPUTS,
            *WIRE_RULES_INPUTS,
        ),
        _specs((OUTPUT_IDS, "TYPE_INT32", (-1,)), (STEP_STATS, "TYPE_FP32", (len(STEP_STATS_FIELDS),)),
               (HIDDEN_STATES, "TYPE_FP32", (-1, -1)), (OUTPUT_LOG_PROBS, "TYPE_FP32", (-1,))),
    ),
    "drafter": (
        _specs(
            (INPUT_IDS, "TYPE_INT32", (-1,), True),
            (NUM_ACCEPTED, "TYPE_INT32", (1,), True),
            (HIDDEN_STATES, "TYPE_FP32", (-1, -1), True),
            (DRAFT_BUDGET, "TYPE_INT32", (1,), True),
            (SPECULATIVE_METHOD, "TYPE_STRING", (1,), True),
            (INTERNAL_KEY, "TYPE_STRING", (1,), True),
            *WIRE_SAMPLING_INPUTS,
        ),
        _specs((DRAFT_TOKENS, "TYPE_INT32", (-1,)), (DRAFT_PARENTS, "TYPE_INT32", (-1,)), (DRAFT_PROBS, "TYPE_FP32", (-1, -1))),
    ),
}


# ---- Prometheus metrics on Triton's metrics port (served by the models, read by the client's
# benchmark and the tests). Labels: method; position (per-position counters); length
# (acceptance-length histogram); reason (requests); model (active sequences). ----------------
DRAFT_TOKENS_TOTAL = "specdec_draft_tokens_total"
ACCEPTED_TOKENS_TOTAL = "specdec_accepted_tokens_total"
EMITTED_TOKENS_TOTAL = "specdec_emitted_tokens_total"
VERIFICATION_STEPS_TOTAL = "specdec_verification_steps_total"
DRAFTED_PER_POSITION_TOTAL = "specdec_drafted_per_position_total"
ACCEPTED_PER_POSITION_TOTAL = "specdec_accepted_per_position_total"
ACCEPTANCE_LENGTH_TOTAL = "specdec_acceptance_length_total"
DRAFT_SECONDS_TOTAL = "specdec_draft_seconds_total"
VERIFY_SECONDS_TOTAL = "specdec_verify_seconds_total"
STEP_SECONDS_TOTAL = "specdec_step_seconds_total"
REQUESTS_TOTAL = "specdec_requests_total"
ACTIVE_SEQUENCES = "specdec_active_sequences"
# The budget planner's current beliefs (adaptive methods; specdec/planner.py), from the verifier.
ACCEPTANCE_ESTIMATE = "specdec_acceptance_estimate"
PLANNED_TOKENS_PER_SECOND = "specdec_planned_tokens_per_second"
VERIFIER_METRICS = {
    ACTIVE_SEQUENCES: ("gauge", "Sequences holding a KV-cache slot"),
    ACCEPTANCE_ESTIMATE: ("gauge", "Estimated chance that draft position `position` is accepted given the one before, per `method`"),
    PLANNED_TOKENS_PER_SECOND: ("gauge", "Tokens per second the planner expects of its last planned step"),
}

# name -> (kind, help) of what the speculative loop exports.
LOOP_METRICS = {
    DRAFT_TOKENS_TOTAL: ("counter", "Draft tokens proposed"),
    ACCEPTED_TOKENS_TOTAL: ("counter", "Draft tokens accepted by the target"),
    EMITTED_TOKENS_TOTAL: ("counter", "Tokens emitted (accepted + bonus/recovered)"),
    VERIFICATION_STEPS_TOTAL: ("counter", "Target verification steps"),
    DRAFTED_PER_POSITION_TOTAL: ("counter", "Drafts that reached draft position `position`"),
    ACCEPTED_PER_POSITION_TOTAL: ("counter", "Drafts accepted at draft position `position`"),
    ACCEPTANCE_LENGTH_TOTAL: ("counter", "Verification steps that emitted `length` tokens (histogram)"),
    DRAFT_SECONDS_TOTAL: ("counter", "Time spent drafting (beside the target, or in the drafter model)"),
    VERIFY_SECONDS_TOTAL: ("counter", "Time spent verifying (target forward + acceptance)"),
    STEP_SECONDS_TOTAL: ("counter", "Wall time of verification steps as the loop sees them (calls included)"),
    REQUESTS_TOTAL: ("counter", "Finished requests by finish reason"),
}
