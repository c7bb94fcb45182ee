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
is involved. The request path of the served model (served_variant, parse_request,
perf_counts) is in requests.py; the LLM API's names and release facts in llm_api.py.

This module needs neither TensorRT-LLM nor Triton (the `trtllm` extra is installed only in
the GPU container).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import specdec_wire as P
from specdec.config import (
    METHOD_DRAFT_MODEL,
    METHOD_EAGLE3,
    METHOD_EAGLE3_TREE,
    METHOD_MEDUSA,
    METHOD_NGRAM,
    ModelConfig,
    ServingConfig,
    SpeculativeConfig,
)
from specdec.errors import ConfigError, SpecDecError
from trtllm_repository.llm_api import (
    DECODING_TYPES,
    DYNAMIC_TREE_SINCE,
    ONE_MODEL_METHODS,
    PINNED_TRTLLM,
    PYTORCH_BACKEND,
    TENSORRT_BACKEND,
    supports_dynamic_tree,
)
from trtllm_repository.medusa_choices import derive_choices
from trtllm_repository.requests import served_variant
from trtllm_repository.schedule import to_trtllm

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "deploy" / "trtllm" / "model_repository"
MODEL_NAME = "ensemble"  # the client-facing name of our own repository
DEFAULT_TARGET = "meta-llama/Llama-3.1-8B-Instruct"
DEFAULT_DRAFT = "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
DEFAULT_DRAFT_TARGET = "meta-llama/Llama-3.2-1B-Instruct"  # an independent draft sharing the target's tokenizer
DRAFT_TARGET = "draft-target"
NGRAM = "ngram"
DEFAULT_CONFIG_FILE = "eagle3.yaml"  # what the model serves when LLM_CONFIG_PATH is unset
BASELINE = "baseline"
DEFAULT_SETTINGS = REPO_ROOT / "model_repository" / "specdec.json"  # its `medusa` methods become medusa*.yaml
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
            spec.check_target(self.target, trtllm=True)
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
