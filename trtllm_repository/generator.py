"""`specdec trtllm-config`: the TensorRT-LLM variant of the model repository (LLM API,
PyTorch backend), written from the same typed SpeculativeConfig the engine uses.

Three served configurations share one Triton model (`ensemble`, the tensor names of
specdec_wire, so specdec-client and the Locust scenarios drive it unchanged):

  baseline.yaml     the matched baseline: no speculative_config, everything else identical
  eagle3.yaml       EAGLE-3, linear draft of max_draft_len tokens
  eagle3-tree.yaml  EAGLE-3 with a dynamic (EAGLE-2 style) draft tree, only for a
                    TensorRT-LLM release that honours it (DYNAMIC_TREE_SINCE; not the pinned one)
  draft-target.yaml an independent draft model (Draft_Target: Llama-3.2-1B-Instruct drafting
                    for Llama-3.1-8B-Instruct by default), linear
  ngram.yaml        n-gram lookup (NGram: NGramDecodingConfig), no draft weights
  medusa*.yaml      Medusa heads (MedusaDecodingConfig), one file per `medusa` method of the
                    served settings (model_repository/specdec.json), with baseline-tensorrt.yaml:
                    TensorRT-LLM runs Medusa on its TensorRT engine backend only (trtllm_repository/medusa_choices.py)

Keys other than `triton_config` go to `tensorrt_llm.LLM(...)` (as in TensorRT-LLM's own
`llmapi` model); the container picks one file with LLM_CONFIG_PATH. The budget rules and
the target checks (no dynamic tree for sliding-window or MLA targets) are those of
SpeculativeConfig, so an invalid variant is refused here, naming the field, before a GPU
is involved. The request helpers below (parse_request, perf_counts) are what the Triton
model in deploy/trtllm/ calls; they are pure and tested on the CPU.

This module needs neither TensorRT-LLM nor Triton (the `trtllm` extra is installed only in
the GPU container).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from packaging.version import InvalidVersion, Version

import specdec_wire as P
from specdec.config import (
    METHOD_DRAFT_MODEL,
    METHOD_EAGLE3,
    METHOD_EAGLE3_TREE,
    METHOD_MEDUSA,
    METHOD_NGRAM,
    METHOD_NONE,
    ModelConfig,
    ServingConfig,
    SpeculativeConfig,
)
from specdec.errors import ConfigError, InvalidRequestError, SpecDecError
from specdec.serving.request import ServedOffer
from specdec.serving.request import parse_request as parse_common
from trtllm_repository.medusa_choices import check_choices, derive_choices
from trtllm_repository.schedule import from_trtllm, to_trtllm

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "deploy" / "trtllm" / "model_repository"
MODEL_NAME = "ensemble"  # the client-facing name of our own repository
DEFAULT_TARGET = "meta-llama/Llama-3.1-8B-Instruct"
DEFAULT_DRAFT = "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
DEFAULT_DRAFT_TARGET = "meta-llama/Llama-3.2-1B-Instruct"  # an independent draft sharing the target's tokenizer
DRAFT_TARGET = "draft-target"
# TensorRT-LLM's decoding_type per method of ours.
DECODING_TYPES = {METHOD_EAGLE3: "Eagle3", METHOD_EAGLE3_TREE: "Eagle3", METHOD_DRAFT_MODEL: "Draft_Target", METHOD_NGRAM: "NGram",
                  METHOD_MEDUSA: "Medusa"}
# Drafters TensorRT-LLM runs inside the target's forward (one-model EAGLE-3). In 1.2.x they
# draft and verify greedily unless speculative_config.allow_advanced_sampling is set: a
# request with temperature > 0 would get greedy output (llm_args.DecodingBaseConfig; the
# two-model paths, Draft_Target and NGram, always sample). Later releases read sampling per
# request and keep the flag as a no-op.
ONE_MODEL_METHODS = (METHOD_EAGLE3, METHOD_EAGLE3_TREE)
NGRAM = "ngram"
# The TensorRT-LLM release the GPU image serves: NGC tritonserver 26.07-trtllm-python-py3
# ships 1.2.1 (triton-inference-server/server docs/introduction/compatibility.md);
# deploy/docker/Dockerfile.gpu asserts it at build time.
PINNED_TRTLLM = "1.2.1"
# The PyTorch backend's one-model EAGLE-3 path reads use_dynamic_tree / dynamic_tree_max_topK
# from 1.3.0rc13 on (NVIDIA/TensorRT-LLM#13081). Before it, Eagle3DecodingConfig sets
# max_total_draft_tokens = max_draft_len and drafts a chain: a tree file would claim a
# budget the server does not run.
DYNAMIC_TREE_SINCE = "1.3.0rc13"
DEFAULT_CONFIG_FILE = "eagle3.yaml"  # what the model serves when LLM_CONFIG_PATH is unset
BASELINE = "baseline"
DEFAULT_SETTINGS = REPO_ROOT / "model_repository" / "specdec.json"  # its `medusa` methods become medusa*.yaml
PYTORCH_BACKEND = "pytorch"
# Medusa in 1.2.x: MedusaDecodingConfig.supports_backend(backend) is `backend not in ("pytorch",
# "_autodeploy")`, so TorchLlmArgs refuses it ("Speculation type Medusa does not support backend
# pytorch"); TrtLlmArgs.validate_speculative_config takes it (build_config.max_draft_len =
# max_draft_len, DecodingConfig(DecodingMode.Medusa(), medusa_choices)). Checked in
# NVIDIA/TensorRT-LLM tensorrt_llm/llmapi/llm_args.py of the 1.2 line (DecodingBaseConfig with
# allow_advanced_sampling, Eagle3DecodingConfig refused by TrtLlmArgs, no dynamic tree before
# 1.3.0rc13) and, unchanged, in the 1.0/1.1 files; the TensorRT backend's LLM is
# tensorrt_llm._tensorrt_engine.LLM (examples/llm-api/llm_medusa_decoding.py). The medusa files
# and their matched baseline therefore say backend: tensorrt and leave out cuda_graph_config,
# a TorchLlmArgs field the TensorRT backend's LLM refuses as an invalid argument.
TENSORRT_BACKEND = "tensorrt"
BASELINE_TENSORRT = "baseline-tensorrt"  # the matched baseline of the medusa files

# Llama-3.1-8B-Instruct's config.json (the values SpeculativeConfig.check_target needs and
# the rest of ModelConfig), so the default generation works offline without the weights.
LLAMA_3_1_8B_INSTRUCT: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}

# Llama-3.2-1B-Instruct's config.json: the independent draft paired with it (same tokenizer,
# vocabulary and special tokens; ModelConfig.check_draft_pairing checks that offline).
LLAMA_3_2_1B_INSTRUCT: dict[str, Any] = {
    **LLAMA_3_1_8B_INSTRUCT,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rope_scaling": {**LLAMA_3_1_8B_INSTRUCT["rope_scaling"], "factor": 32.0},
    "tie_word_embeddings": True,
}


# ---- generation --------------------------------------------------------------------------
@dataclass(frozen=True)
class TrtllmDeployment:
    """Everything the generated files say. Sizes shared by all variants live here once, so
    the baseline is matched by construction: only `speculative_config` differs."""

    target: ModelConfig
    variants: Mapping[str, SpeculativeConfig | None]  # file stem -> config (None = baseline)
    model: str = DEFAULT_TARGET
    draft_model: str = DEFAULT_DRAFT
    draft_target_model: str = DEFAULT_DRAFT_TARGET
    draft_target: ModelConfig | None = None  # its config.json, checked against the target when given
    # Medusa heads in TensorRT-LLM's own format (FasterDecoding Medusa: per-head residual
    # blocks and full-vocabulary lm_heads, config.json medusa_num_heads) trained for `model`.
    # Ours (models/medusa-smollm2-135m) share one draft-vocabulary lm_head and do not load there.
    medusa_model: str | None = None
    # TensorRT-LLM preallocates its runtime buffers (KV-cache blocks, CUDA graphs, draft
    # buffers) from these, so they are stated, not left to defaults.
    max_batch_size: int = 64
    max_seq_len: int = 8192
    max_num_tokens: int = 8192
    free_gpu_memory_fraction: float = 0.85
    tensor_parallel_size: int = 1
    dtype: str = "bfloat16"
    apply_chat_template: bool = True

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ConfigError("max_batch_size", f"must be >= 1, got {self.max_batch_size}")
        if not 1 <= self.max_seq_len <= self.target.max_position_embeddings:
            raise ConfigError(
                "max_seq_len",
                f"must be in [1, max_position_embeddings={self.target.max_position_embeddings}], got {self.max_seq_len}",
            )
        if self.max_num_tokens < 1:
            raise ConfigError("max_num_tokens", f"must be >= 1, got {self.max_num_tokens}")
        if not 0.0 < self.free_gpu_memory_fraction < 1.0:
            raise ConfigError("free_gpu_memory_fraction", f"must be in (0, 1), got {self.free_gpu_memory_fraction}")
        if self.tensor_parallel_size < 1:
            raise ConfigError("tensor_parallel_size", f"must be >= 1, got {self.tensor_parallel_size}")
        if self.dtype not in ("bfloat16", "float16", "auto"):
            raise ConfigError("dtype", f"must be bfloat16, float16 or auto, got {self.dtype!r}")
        for name, spec in self.variants.items():
            if spec is None:
                continue
            if spec.method == METHOD_MEDUSA:
                self._check_medusa(name, spec)
            elif spec.method in (METHOD_DRAFT_MODEL, METHOD_NGRAM):
                if spec.use_dynamic_tree:
                    raise ConfigError(f"{name}.use_dynamic_tree", f"TensorRT-LLM's {DECODING_TYPES[spec.method]} decoding drafts a chain only")
                if spec.method == METHOD_NGRAM and spec.prompt_lookup_min != 1:
                    # TensorRT-LLM's NGram drafter tries every match length from max_matching_ngram_size down to 1.
                    raise ConfigError(f"{name}.prompt_lookup_min", f"TensorRT-LLM's NGram matches down to 1 token; got {spec.prompt_lookup_min}")
            else:
                expected = METHOD_EAGLE3_TREE if spec.use_dynamic_tree else METHOD_EAGLE3
                if spec.method != expected:
                    raise ConfigError(
                        f"{name}.method",
                        f"TensorRT-LLM's Eagle3 decoding serves {expected!r} for use_dynamic_tree={spec.use_dynamic_tree}, "
                        f"got {spec.method!r}",
                    )
            spec.check_target(self.target)
        drafts_apart = any(spec is not None and spec.method == METHOD_DRAFT_MODEL for spec in self.variants.values())
        if drafts_apart and self.draft_target is not None:  # after the variants' own rules, which name their fields
            self.target.check_draft_pairing(self.draft_target, self.draft_target_model)
            if self.draft_target.max_position_embeddings < self.max_seq_len:
                raise ConfigError("max_seq_len", f"{self.max_seq_len} exceeds the draft's context ({self.draft_target.max_position_embeddings})")

    def _check_medusa(self, name: str, spec: SpeculativeConfig) -> None:
        """What TensorRT-LLM's engine-backend Medusa cannot take from our settings, refused by name."""
        if self.medusa_model is None:
            raise ConfigError("medusa_model", f"{name} needs Medusa heads in TensorRT-LLM's (FasterDecoding) format for "
                                              f"{self.model}: pass --medusa-model (ours share one draft-vocabulary lm_head "
                                              "and do not load there)")
        if spec.adaptive:
            raise ConfigError(f"{name}.adaptive", "TensorRT-LLM verifies one fixed Medusa tree; our planner has no counterpart there")
        for load_control in ("max_concurrency", "draft_len_schedule"):
            if getattr(spec, load_control) is not None:
                raise ConfigError(f"{name}.{load_control}", "is PyTorch backend only in TensorRT-LLM; Medusa runs on its "
                                                            "TensorRT engine backend")

    def backend(self, name: str) -> str:
        spec = self.variants[name]
        medusa = (spec is not None and spec.method == METHOD_MEDUSA) or name == BASELINE_TENSORRT
        return TENSORRT_BACKEND if medusa else PYTORCH_BACKEND

    def speculative_config(self, spec: SpeculativeConfig) -> dict[str, Any]:
        """The `speculative_config` block, in TensorRT-LLM's field names (Eagle3DecodingConfig,
        DraftTargetDecodingConfig, NGramDecodingConfig, MedusaDecodingConfig)."""
        out: dict[str, Any] = {"decoding_type": DECODING_TYPES[spec.method]}
        if spec.method == METHOD_MEDUSA:
            choices = derive_choices(spec)
            out["speculative_model"] = self.medusa_model  # speculative_model_dir is its alias in 1.2.x
            out["max_draft_len"] = len(choices)  # the engine-backend meaning: draft tokens (tree nodes) a step
            out["num_medusa_heads"] = spec.max_draft_len  # heads used: the tree's depth
            out["medusa_choices"] = choices
            return out
        if spec.method != METHOD_NGRAM:  # the n-gram lookup has no weights
            out["speculative_model"] = self.draft_target_model if spec.method == METHOD_DRAFT_MODEL else self.draft_model
        out["max_draft_len"] = spec.max_draft_len
        if spec.method == METHOD_NGRAM:
            out["max_matching_ngram_size"] = spec.prompt_lookup_max
            # Each request looks up its own context, as ours does: no pool shared across
            # requests (TensorRT-LLM's default), whose matches would depend on other tenants' text.
            out["is_public_pool"] = False
        if spec.method in ONE_MODEL_METHODS:
            out["allow_advanced_sampling"] = True
        if spec.use_dynamic_tree:
            out["use_dynamic_tree"] = True
            out["dynamic_tree_max_topK"] = spec.dynamic_tree_max_topK
            out["max_total_draft_tokens"] = spec.max_total_draft_tokens
        if spec.max_concurrency is not None:
            out["max_concurrency"] = spec.max_concurrency
        if spec.draft_len_schedule is not None:  # ours means batch <= key, TensorRT-LLM's batch >= key
            out["draft_len_schedule"] = to_trtllm(spec.draft_len_schedule, spec.max_draft_len)
        return out

    def llm_config(self, name: str) -> dict[str, Any]:
        """One model.yaml as a dict: LLM(...) keyword arguments plus `triton_config`."""
        config: dict[str, Any] = {
            "model": self.model,
            "backend": self.backend(name),
            "dtype": self.dtype,
            "tensor_parallel_size": self.tensor_parallel_size,
            "max_batch_size": self.max_batch_size,
            "max_seq_len": self.max_seq_len,
            "max_num_tokens": self.max_num_tokens,
            # Block reuse (prefix caching) off: repeated benchmark prompts would otherwise
            # measure cache hits, not decoding.
            "kv_cache_config": {"free_gpu_memory_fraction": self.free_gpu_memory_fraction, "enable_block_reuse": False},
            "cuda_graph_config": {"max_batch_size": self.max_batch_size, "enable_padding": True},
        }
        if config["backend"] == TENSORRT_BACKEND:
            del config["cuda_graph_config"]
        spec = self.variants[name]
        if spec is not None:
            config["speculative_config"] = self.speculative_config(spec)
        config["triton_config"] = {
            "max_batch_size": self.max_batch_size,
            "decoupled": True,
            "apply_chat_template": self.apply_chat_template,
        }
        return config

    def files(self) -> dict[str, str]:
        """Relative path (inside the model repository) -> file content."""
        out = {f"{MODEL_NAME}/config.pbtxt": render_config_pbtxt(self.max_batch_size)}
        for name in self.variants:
            out[f"{MODEL_NAME}/1/{name}.yaml"] = render_yaml(self.llm_config(name), header=_yaml_header(name, self.variants[name]))
        return out


def supports_dynamic_tree(trtllm_version: str) -> bool:
    try:
        return Version(trtllm_version) >= Version(DYNAMIC_TREE_SINCE)
    except InvalidVersion as exc:
        raise ConfigError("trtllm_version", f"not a version: {trtllm_version!r}") from exc


def default_variants(
    max_draft_len: int = 3, tree_max_draft_len: int = 6, tree_topk: int = 10, tree_max_total_draft_tokens: int | None = 60,
    draft_target_len: int = 4, trtllm_version: str = PINNED_TRTLLM, ngram_len: int = 4, ngram_size: int = 3,
) -> dict[str, SpeculativeConfig | None]:
    """The served files for one TensorRT-LLM release: the tree only where it is honoured."""
    variants: dict[str, SpeculativeConfig | None] = {
        BASELINE: None,
        DRAFT_TARGET: SpeculativeConfig(method=METHOD_DRAFT_MODEL, max_draft_len=draft_target_len),
        METHOD_EAGLE3: SpeculativeConfig(method=METHOD_EAGLE3, max_draft_len=max_draft_len),
        # As model_repository/specdec.json's `ngram`: 4 draft tokens, match lengths 3..1.
        NGRAM: SpeculativeConfig(method=METHOD_NGRAM, max_draft_len=ngram_len, prompt_lookup_max=ngram_size),
    }
    if supports_dynamic_tree(trtllm_version):
        variants[METHOD_EAGLE3_TREE] = SpeculativeConfig(
            method=METHOD_EAGLE3_TREE,
            max_draft_len=tree_max_draft_len,
            use_dynamic_tree=True,
            dynamic_tree_max_topK=tree_topk,
            max_total_draft_tokens=tree_max_total_draft_tokens,
        )
    return variants


def medusa_variants(settings: ServingConfig) -> dict[str, SpeculativeConfig]:
    """The served settings' `medusa` methods, by name (each becomes <name>.yaml), without
    their load controls: PyTorch-backend settings in TensorRT-LLM, whose engine backend
    (the one Medusa runs on) verifies every step."""
    return {name: spec.replace(max_concurrency=None, draft_len_schedule=None)
            for name, spec in settings.methods.items() if spec.method == METHOD_MEDUSA}


_MEDUSA_BACKEND_NOTE = (
    "# TensorRT engine backend (backend: tensorrt): TensorRT-LLM 1.2.x's PyTorch backend has no Medusa\n"
    "# (MedusaDecodingConfig.supports_backend), so the model builds tensorrt_llm._tensorrt_engine.LLM;\n"
    "# compare with baseline-tensorrt.yaml. speculative_model: Medusa heads in TensorRT-LLM's own\n"
    "# (FasterDecoding) format for the target; ours share one draft-vocabulary lm_head and do not load.\n"
)


def _yaml_header(name: str, spec: SpeculativeConfig | None) -> str:
    note = ""
    if spec is None and name == BASELINE_TENSORRT:
        what = "the matched baseline of the medusa files: no speculative_config, TensorRT engine backend"
        note = "# backend: tensorrt as the medusa files (TensorRT-LLM 1.2.x runs Medusa on that backend only).\n"
    elif spec is None:
        what = "the matched baseline: no speculative_config, every other key as in the speculative variants"
    elif spec.method == METHOD_MEDUSA:
        shape = (f"a static tree of the heads' top-{spec.dynamic_tree_max_topK} guesses, {spec.max_total_draft_tokens} nodes"
                 if spec.use_dynamic_tree else "a chain of the heads' argmaxes")
        what = f"Medusa heads, {shape}, depth {spec.max_draft_len} (medusa_choices: trtllm_repository/medusa_choices.py)"
        note = _MEDUSA_BACKEND_NOTE
    elif spec.method == METHOD_DRAFT_MODEL:
        what = f"an independent draft model (Draft_Target) proposing max_draft_len={spec.max_draft_len} tokens"
    elif spec.method == METHOD_NGRAM:
        what = f"n-gram lookup (NGram) proposing max_draft_len={spec.max_draft_len} tokens"
    elif spec.use_dynamic_tree:
        what = (
            f"EAGLE-3 dynamic tree (depth max_draft_len={spec.max_draft_len}, top-K {spec.dynamic_tree_max_topK}, "
            f"{spec.max_total_draft_tokens} draft tokens per step)"
        )
    else:
        what = f"EAGLE-3 linear draft of max_draft_len={spec.max_draft_len} tokens"
    return (
        "# Generated by `specdec trtllm-config` (trtllm_repository/generator.py) -- do not edit; regenerate.\n"
        f"# Variant {name!r}: {what}.\n"
        "# Keys other than triton_config are passed to tensorrt_llm.LLM(...); serve this file with\n"
        f"# LLM_CONFIG_PATH={name}.yaml. max_batch_size sizes preallocated buffers (KV cache, CUDA graphs).\n"
        + note
    )


def render_yaml(data: Mapping[str, Any], header: str = "") -> str:
    """Block-style YAML, keys in the order given (PyYAML's safe_dump is deterministic)."""
    import yaml

    return header + yaml.safe_dump(dict(data), sort_keys=False, default_flow_style=False)


def render_config_pbtxt(max_batch_size: int) -> str:
    """config.pbtxt of the TensorRT-LLM `ensemble`: the tensors of protocol.MODELS['ensemble'],
    built as Triton's own ModelConfig (tritonclient's model_config_pb2) and written by protobuf's
    text format, so what Triton parses is what we rendered."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    inputs, outputs = P.MODELS[MODEL_NAME]
    config = mc.ModelConfig(name=MODEL_NAME, backend="python", max_batch_size=max_batch_size,
                            model_transaction_policy=mc.ModelTransactionPolicy(decoupled=True),
                            instance_group=[mc.ModelInstanceGroup(kind=mc.ModelInstanceGroup.KIND_CPU, count=1)])
    for spec in inputs.values():
        config.input.add(name=spec.name, data_type=mc.DataType.Value(spec.dtype), dims=spec.dims, optional=spec.optional)
    for spec in outputs.values():
        config.output.add(name=spec.name, data_type=mc.DataType.Value(spec.dtype), dims=spec.dims)
    return (
        "# Generated by `specdec trtllm-config` (trtllm_repository/generator.py) -- do not edit; regenerate.\n"
        "# TensorRT-LLM (LLM API, PyTorch backend) behind the tensor names of our ensemble\n"
        "# (specdec_wire/__init__.py). Decoupled: one response per streamed chunk, the last one final.\n"
        "# max_batch_size equals the LLM's max_batch_size in every model.yaml (checked at load).\n"
        + text_format.MessageToString(config)
    )


BUILT_IN_CONFIGS = {DEFAULT_TARGET: LLAMA_3_1_8B_INSTRUCT, DEFAULT_DRAFT_TARGET: LLAMA_3_2_1B_INSTRUCT}


def target_model_config(target: str, target_config: Path | None, field: str = "target_config") -> ModelConfig:
    """A model's ModelConfig: --target-config (--draft-target-config), else <model>/config.json
    for a local directory, else the built-in values of the default pair."""
    if target_config is not None:
        return ModelConfig.from_file(Path(target_config))
    local = Path(target) / "config.json"
    if local.is_file():
        return ModelConfig.from_file(local)
    if target not in BUILT_IN_CONFIGS:
        raise ConfigError(
            field,
            f"needed for {target!r}: pass --{field.replace('_', '-')} path/to/config.json "
            f"(built-in values exist only for {', '.join(BUILT_IN_CONFIGS)})",
        )
    return ModelConfig.from_hf_dict(BUILT_IN_CONFIGS[target])


def write_files(files: Mapping[str, str], out: Path) -> list[Path]:
    written = []
    for rel, text in files.items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            written.append(path)
    return written


def stale_files(files: Mapping[str, str], out: Path) -> list[str]:
    return [rel for rel, text in files.items() if not (out / rel).is_file() or (out / rel).read_text() != text]


# ---- serving (called by deploy/trtllm/model_repository/ensemble/1/model.py) -------------
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
class LlmRequest:
    prompt: str
    apply_chat_template: bool
    stream: bool
    return_perf_metrics: bool
    sampling: dict[str, Any] = field(default_factory=dict)  # tensorrt_llm.SamplingParams(**sampling)
    exclude_input_in_output: bool = False  # False: a non-streamed answer starts with the prompt
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False


def parse_request(inputs: Mapping[str, Any], served: ServedVariant) -> LlmRequest:
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
    if params.return_log_probs:
        raise InvalidRequestError(P.RETURN_LOG_PROBS, "is not served by the TensorRT-LLM variant of this ensemble yet")
    if params.guided:  # the LLM API has GuidedDecodingParams; not mapped (nor tested on a GPU) yet
        raise InvalidRequestError(P.GUIDED_DECODING_GUIDE_TYPE, "is not served by the TensorRT-LLM variant of this ensemble yet")
    if params.cache_salt:  # its KV reuse has no per-request scope mapped here: refused, not silently shared
        raise InvalidRequestError(P.CACHE_SALT, "is not served by the TensorRT-LLM variant of this ensemble yet")
    return LlmRequest(
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


# ---- CLI -----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specdec trtllm-config",
        description="Write the TensorRT-LLM (LLM API) model repository: baseline, EAGLE-3 (linear; dynamic tree where the release honours it), "
                    "Draft_Target, NGram and, for the settings' medusa methods, Medusa.",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="model repository to write (default: %(default)s)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if the files there differ")
    p.add_argument("--target", default=DEFAULT_TARGET, help="target model (HF id or local directory)")
    p.add_argument("--target-config", type=Path, default=None, help="the target's config.json (required for other targets)")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="EAGLE-3 head (HF id or local directory)")
    p.add_argument("--draft-target-model", default=DEFAULT_DRAFT_TARGET, help="independent draft model for draft-target.yaml")
    p.add_argument("--draft-target-config", type=Path, default=None, help="its config.json (required for other draft models)")
    p.add_argument("--draft-target-len", type=int, default=4, help="draft-target.yaml's max_draft_len")
    p.add_argument("--settings", type=Path, default=DEFAULT_SETTINGS,
                   help="served settings whose `medusa` methods become medusa files (default: %(default)s)")
    p.add_argument("--medusa-model", default=None,
                   help="Medusa heads in TensorRT-LLM's (FasterDecoding) format for the target; needed when --settings has medusa methods")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=8192)
    p.add_argument("--max-num-tokens", type=int, default=8192)
    p.add_argument("--free-gpu-memory-fraction", type=float, default=0.85)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--trtllm-version", default=PINNED_TRTLLM, help="the TensorRT-LLM release served (default: the pinned %(default)s)")
    p.add_argument("--max-draft-len", type=int, default=3, help="linear EAGLE-3 draft length")
    p.add_argument("--tree-max-draft-len", type=int, default=6, help="dynamic tree depth")
    p.add_argument("--tree-topk", type=int, default=10, help="dynamic_tree_max_topK")
    p.add_argument(
        "--tree-max-total-draft-tokens", type=int, default=60,
        help="draft tokens per step, in [depth, topK * depth] (default %(default)s)",
    )
    return p


def deployment_from_args(args: argparse.Namespace) -> TrtllmDeployment:
    variants = default_variants(args.max_draft_len, args.tree_max_draft_len, args.tree_topk, args.tree_max_total_draft_tokens,
                                args.draft_target_len, args.trtllm_version)
    pairs = args.target == DEFAULT_TARGET or args.draft_target_model != DEFAULT_DRAFT_TARGET
    if not pairs:  # the default draft pairs with the default target only; others name theirs
        del variants[DRAFT_TARGET]
    medusa = medusa_variants(ServingConfig.from_file(args.settings))
    if medusa and args.medusa_model is None:
        # The shipped medusa methods serve heads TensorRT-LLM cannot load (one shared draft-vocabulary
        # lm_head); their files are written only for heads in its format.
        print(f"medusa methods {sorted(medusa)} skipped: pass --medusa-model (heads in TensorRT-LLM's format) to write them",
              file=sys.stderr)
        medusa = {}
    if medusa:
        taken = sorted(set(medusa) & (set(variants) | {BASELINE_TENSORRT}))
        if taken:
            raise ConfigError(f"methods.{taken[0]}", "names a file the generator writes already: rename the method")
        variants.update({BASELINE_TENSORRT: None, **medusa})
    return TrtllmDeployment(
        target=target_model_config(args.target, args.target_config),
        variants=variants,
        model=args.target,
        draft_model=args.draft,
        draft_target_model=args.draft_target_model,
        draft_target=target_model_config(args.draft_target_model, args.draft_target_config, "draft_target_config") if pairs else None,
        medusa_model=args.medusa_model,
        max_batch_size=args.max_batch_size,
        max_seq_len=args.max_seq_len,
        max_num_tokens=args.max_num_tokens,
        free_gpu_memory_fraction=args.free_gpu_memory_fraction,
        tensor_parallel_size=args.tensor_parallel_size,
        dtype=args.dtype,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        files = deployment_from_args(args).files()
    except SpecDecError as exc:
        print(f"specdec trtllm-config: error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        stale = stale_files(files, args.out)
        for rel in stale:
            print(f"specdec trtllm-config: out of date: {args.out / rel}", file=sys.stderr)
        return 1 if stale else 0
    for path in write_files(files, args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
