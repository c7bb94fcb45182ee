"""The request path of the TensorRT-LLM variant's Triton model (deploy/trtllm/model_repository/
ensemble/1/model.py): the served model.yaml checked by the generator's rules (served_variant),
our ensemble's inputs mapped onto one LLM API request (parse_request), and TensorRT-LLM's
per-request counts mapped onto our perf outputs (perf_counts). Pure, and tested on the CPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import specdec_wire as P
from specdec.config import (
    METHOD_DRAFT_MODEL,
    METHOD_EAGLE3,
    METHOD_EAGLE3_TREE,
    METHOD_MEDUSA,
    METHOD_NGRAM,
    METHOD_NONE,
    SpeculativeConfig,
)
from specdec.errors import ConfigError, InvalidRequestError
from specdec.serving.request import ServedOffer
from specdec.serving.request import parse_request as parse_common
from trtllm_repository.llm_api import DECODING_TYPES, DYNAMIC_TREE_SINCE, TENSORRT_BACKEND, supports_dynamic_tree
from trtllm_repository.medusa_choices import check_choices
from trtllm_repository.schedule import from_trtllm


@dataclass(frozen=True)
class ServedVariant:
    """What one model.yaml serves, as the request path needs it."""

    method: str  # none | eagle3 | eagle3-tree | draft_model | ngram | medusa
    num_draft_tokens: int  # draft tokens per verification step (0 for the baseline)
    max_batch_size: int
    max_tokens_limit: int
    apply_chat_template: bool

    def offer(self) -> ServedOffer:
        methods = {} if self.method == METHOD_NONE else {self.method: self.num_draft_tokens}
        return ServedOffer(methods, self.method, self.num_draft_tokens, self.max_tokens_limit, self.apply_chat_template, fixed=True)


def served_variant(config: Mapping[str, Any], trtllm_version: str | None = None) -> ServedVariant:
    """Validate a loaded model.yaml with the same rules as the generator (a hand edit that
    breaks the tree budget fails at model load, naming the field). trtllm_version: the
    installed tensorrt_llm.__version__; a dynamic tree below DYNAMIC_TREE_SINCE is refused."""
    triton = dict(config.get("triton_config") or {})
    for key in ("max_batch_size", "max_seq_len"):
        if not isinstance(config.get(key), int):
            raise ConfigError(key, "must be stated in model.yaml (TensorRT-LLM preallocates buffers from it)")
    if triton.get("max_batch_size") != config["max_batch_size"]:
        raise ConfigError(
            "triton_config.max_batch_size",
            f"must equal max_batch_size={config['max_batch_size']}, got {triton.get('max_batch_size')!r}",
        )
    if triton.get("decoupled") is not True:
        raise ConfigError("triton_config.decoupled", "must be true: responses are streamed")
    spec_raw = config.get("speculative_config")
    if spec_raw is None:
        method, budget = METHOD_NONE, 0
    else:
        decoding = spec_raw.get("decoding_type")
        if decoding not in set(DECODING_TYPES.values()):
            raise ConfigError("speculative_config.decoding_type", f"must be one of {sorted(set(DECODING_TYPES.values()))}, got {decoding!r}")
        if decoding == "Medusa":
            return ServedVariant(METHOD_MEDUSA, _medusa_draft_tokens(config), config["max_batch_size"], config["max_seq_len"],
                                 bool(triton.get("apply_chat_template", True)))
        schedule = _our_schedule(spec_raw, config["max_batch_size"])
        if decoding in ("Draft_Target", "NGram"):
            if decoding == "Draft_Target" and not spec_raw.get("speculative_model"):
                raise ConfigError("speculative_config.speculative_model", "Draft_Target needs the draft model")
            method = METHOD_DRAFT_MODEL if decoding == "Draft_Target" else METHOD_NGRAM
            spec = SpeculativeConfig(method=method, max_draft_len=spec_raw.get("max_draft_len"),
                                     prompt_lookup_max=spec_raw.get("max_matching_ngram_size", 2),  # TensorRT-LLM's default
                                     max_concurrency=spec_raw.get("max_concurrency"), draft_len_schedule=schedule)
            return ServedVariant(method, spec.max_draft_len, config["max_batch_size"], config["max_seq_len"],
                                 bool(triton.get("apply_chat_template", True)))
        tree = bool(spec_raw.get("use_dynamic_tree", False))
        if tree and trtllm_version is not None and not supports_dynamic_tree(trtllm_version):
            raise ConfigError("speculative_config.use_dynamic_tree",
                              f"TensorRT-LLM {trtllm_version} ignores it (one-model EAGLE-3 drafts a chain of max_draft_len); "
                              f"dynamic trees need >= {DYNAMIC_TREE_SINCE}")
        if tree and "dynamic_tree_max_topK" not in spec_raw:
            raise ConfigError("speculative_config.dynamic_tree_max_topK", "is required with use_dynamic_tree")
        spec = SpeculativeConfig(
            method=METHOD_EAGLE3_TREE if tree else METHOD_EAGLE3,
            max_draft_len=spec_raw.get("max_draft_len"),
            use_dynamic_tree=tree,
            dynamic_tree_max_topK=spec_raw.get("dynamic_tree_max_topK", 1),  # unused without a tree
            max_total_draft_tokens=spec_raw.get("max_total_draft_tokens"),
            max_concurrency=spec_raw.get("max_concurrency"),
            draft_len_schedule=schedule,
        )
        method, budget = spec.method, int(spec.max_total_draft_tokens)
    return ServedVariant(
        method=method,
        num_draft_tokens=budget,
        max_batch_size=config["max_batch_size"],
        max_tokens_limit=config["max_seq_len"],
        apply_chat_template=bool(triton.get("apply_chat_template", True)),
    )


def _medusa_draft_tokens(config: Mapping[str, Any]) -> int:
    """A medusa file checked by TensorRT-LLM's engine-backend rules; its draft tokens a step."""
    spec_raw = config["speculative_config"]
    if config.get("backend") != TENSORRT_BACKEND:
        raise ConfigError("backend", f"TensorRT-LLM runs Medusa on its TensorRT engine backend only ({TENSORRT_BACKEND!r}), "
                                     f"got {config.get('backend')!r}")
    if "cuda_graph_config" in config:
        raise ConfigError("cuda_graph_config", "is a PyTorch backend setting; the TensorRT backend's LLM refuses it")
    if not spec_raw.get("speculative_model"):
        raise ConfigError("speculative_config.speculative_model", "Medusa needs its heads (TensorRT-LLM's format)")
    for load_control in ("max_concurrency", "draft_len_schedule"):
        if spec_raw.get(load_control) is not None:
            raise ConfigError(f"speculative_config.{load_control}", "is PyTorch backend only in TensorRT-LLM")
    heads = spec_raw.get("num_medusa_heads")
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise ConfigError("speculative_config.num_medusa_heads", f"must be an integer >= 1, got {heads!r}")
    choices = check_choices(spec_raw.get("medusa_choices"), heads)
    if spec_raw.get("max_draft_len") != len(choices):
        raise ConfigError("speculative_config.max_draft_len",
                          f"is the engine's Medusa token budget: must equal the {len(choices)} nodes of medusa_choices, "
                          f"got {spec_raw.get('max_draft_len')!r}")
    return len(choices)


def _our_schedule(spec_raw: Mapping[str, Any], max_batch_size: int) -> dict[int, int] | None:
    """A model.yaml's draft_len_schedule (TensorRT-LLM's meaning) in ours, checked by TensorRT-LLM's rules."""
    raw = spec_raw.get("draft_len_schedule")
    if raw is None:
        return None
    try:
        return from_trtllm(raw, spec_raw.get("max_draft_len"), max_batch_size)
    except ConfigError as exc:
        raise ConfigError("speculative_config.draft_len_schedule", str(exc)[len(exc.field) + 2:]) from None


@dataclass(frozen=True)
class TrtllmRequest:
    """One request for tensorrt_llm.LLM.generate_async (our fields; not TensorRT-LLM's own LlmRequest)."""

    prompt: str
    apply_chat_template: bool
    stream: bool
    return_perf_metrics: bool
    sampling: dict[str, Any] = field(default_factory=dict)  # tensorrt_llm.SamplingParams(**sampling)
    exclude_input_in_output: bool = False  # False: a non-streamed answer starts with the prompt
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False


def parse_request(inputs: Mapping[str, Any], served: ServedVariant) -> TrtllmRequest:
    """Our ensemble's inputs (name -> array, absent = None) -> one LLM API request, through
    the project's one request parser (specdec.serving.request.parse_request).

    TensorRT-LLM fixes the speculative configuration when the LLM is built, so a request
    may not ask for another method or draft budget: it is refused naming the field (the
    matched baseline is the same repository served with LLM_CONFIG_PATH=baseline.yaml).
    """
    req = parse_common(inputs, served.offer())
    if req.prompt is None:
        raise InvalidRequestError(P.TEXT_INPUT, "must be a non-empty string")
    params = req.params
    # Our conventions -> TensorRT-LLM's: temperature 0 is greedy there too; top_k 0 and
    # top_p 1 mean "off", which is TensorRT-LLM's default when the field is absent.
    sampling: dict[str, Any] = {"max_tokens": params.max_tokens, "temperature": params.temperature}
    if params.top_k:
        sampling["top_k"] = params.top_k
    if params.top_p < 1.0:
        sampling["top_p"] = params.top_p
    if params.seed is not None:
        sampling["seed"] = params.seed
    if params.stop:
        sampling["stop"] = list(params.stop)
    if params.ignore_eos:
        sampling["ignore_eos"] = True
    if req.return_perf_metrics:
        sampling["return_perf_metrics"] = True
    # TensorRT-LLM's own logits rules, under the LLM API's names.
    for ours, theirs, neutral in (
        ("min_length", "min_tokens", 0), ("end_id", "end_id", None), ("pad_id", "pad_id", None),
        ("repetition_penalty", "repetition_penalty", 1.0), ("presence_penalty", "presence_penalty", 0.0),
        ("frequency_penalty", "frequency_penalty", 0.0),
    ):
        if getattr(params, ours) != neutral:
            sampling[theirs] = getattr(params, ours)
    if params.bad_words:
        sampling["bad"] = list(params.bad_words)
    if params.min_p:
        sampling["min_p"] = params.min_p  # the LLM API's SamplingParams name
    if params.logit_bias or params.bias_words:  # the LLM API takes a vocabulary-wide tensor; not mapped (nor tested on a GPU) yet
        raise InvalidRequestError(P.EMBEDDING_BIAS_WEIGHTS, "is not served by the TensorRT-LLM variant of this ensemble yet")
    if params.wants_log_probs:
        raise InvalidRequestError(P.TOP_LOGPROBS if params.top_logprobs else P.RETURN_LOG_PROBS, "is not served by the TensorRT-LLM variant of this ensemble yet")
    if params.guided:  # the LLM API has GuidedDecodingParams; not mapped (nor tested on a GPU) yet
        raise InvalidRequestError(P.GUIDED_DECODING_GUIDE_TYPE, "is not served by the TensorRT-LLM variant of this ensemble yet")
    if params.cache_salt:  # its KV reuse has no per-request scope mapped here: refused, not silently shared
        raise InvalidRequestError(P.CACHE_SALT, "is not served by the TensorRT-LLM variant of this ensemble yet")
    return TrtllmRequest(
        prompt=req.prompt, apply_chat_template=req.apply_chat_template, stream=req.stream,
        return_perf_metrics=req.return_perf_metrics, sampling=sampling, exclude_input_in_output=req.exclude_input_in_output,
        return_num_input_tokens=req.return_num_input_tokens, return_num_output_tokens=req.return_num_output_tokens,
    )


def perf_counts(output_tokens: int, accepted: int, drafted: int) -> dict[str, float]:
    """Our perf outputs from what TensorRT-LLM reports per request.

    TensorRT-LLM does not report its iteration count per request. The prefill emits the
    first token and every verification step emits its accepted draft tokens plus one
    (recovered or bonus), so steps = output tokens - 1 - accepted (plain decoding:
    tokens - 1, as our own server reports). Tokens accepted past max_tokens and dropped
    make this a slight undercount on the last step.
    """
    steps = max(0, output_tokens - 1 - accepted)
    return {
        P.ACCEPTANCE_RATE: accepted / drafted if drafted else 0.0,
        P.TOTAL_ACCEPTED_DRAFT_TOKENS: accepted,
        P.TOTAL_DRAFT_TOKENS: drafted,
        P.TOTAL_ACCEPTED_FORCED_TOKENS: 0,  # grammars are not served by this variant yet
        P.VERIFICATION_STEPS: steps,
        P.OUTPUT_TOKENS: output_tokens,
        P.NUM_CACHED_TOKENS: 0,  # the LLM API's per-request KV reuse count is not mapped yet
    }
