"""Assemble an engine from a model directory and a config: the one place that wires
target, tokenizer and drafters together (used by the CLI, the benchmarks and Triton)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping

import torch

from specdec.config import METHOD_NGRAM, SERVED_SETTINGS, EngineConfig, ModelConfig, ServingConfig, SpeculativeConfig, resolve_model_dir, target_weight_dtype
from specdec.engine.drafters.base import Drafter
from specdec.engine.drafters.registry import BuildContext, kind_of
from specdec.engine.drafters.service import union_of_layers
from specdec.serving.spec_engine import SpecEngine
from specdec.engine.grammar import Grammars
from specdec.engine.speculator import Speculator
from specdec.errors import ConfigError
from specdec.engine.models.llama import Transformer
from specdec.config import default_model_dir
from specdec.engine.models.loading import load_embedding, load_transformer
from specdec.engine.models.quantized import quantize

log = logging.getLogger(__name__)


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def served_methods() -> dict[str, SpeculativeConfig]:
    """The methods the model repository serves, so in-process runs match the server."""
    if SERVED_SETTINGS.is_file():
        return dict(ServingConfig.from_file(SERVED_SETTINGS).methods)
    return {METHOD_NGRAM: SpeculativeConfig(method=METHOD_NGRAM, max_draft_len=4)}


def build_drafters(
    target_cfg: ModelConfig,
    speculative: Mapping[str, SpeculativeConfig],
    engine: EngineConfig | None = None,
    model_dir: Path | None = None,
    embed: torch.nn.Embedding | None = None,
) -> dict[str, Drafter]:
    """One drafter per configured method name (e.g. "ngram", "eagle3", "eagle3-tree"), each
    built by its registered kind. Heads that share the target's embedding get `embed`, or
    read it from model_dir once."""
    target_dir = resolve_model_dir(model_dir)
    ctx = BuildContext(target_cfg, engine or EngineConfig(), lambda: load_embedding(target_dir), embed, target_dir)
    return {name: kind_of(spec.check_target(target_cfg)).build(spec, ctx) for name, spec in speculative.items()}


def tap_layers_of(spec: SpeculativeConfig, target_cfg: ModelConfig) -> tuple[int, ...]:
    """The target layers a method's drafter taps (empty: it needs no hidden states)."""
    return kind_of(spec).tap_layers(spec, target_cfg)


def tap_layers_for(target_cfg: ModelConfig, speculative: Mapping[str, SpeculativeConfig]) -> tuple[int, ...]:
    """Every target layer the configured drafters need, ascending (one forward taps the union)."""
    return union_of_layers(tap_layers_of(spec, target_cfg) for spec in speculative.values())


def handed_tap_layers(settings: ServingConfig, target_cfg: ModelConfig) -> tuple[int, ...]:
    """The layers the verifier's forward taps, and so the columns of the hidden states it
    hands a drafter served apart: every served drafter's, and the capture's when it is on."""
    from specdec.serving.traffic_capture import feature_layers

    return union_of_layers([tap_layers_for(target_cfg, settings.methods), feature_layers(target_cfg) if settings.capture else ()])


def load_target(model_dir: Path | None, config: EngineConfig) -> Transformer:
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    model_dir = Path(model_dir or default_model_dir())
    model = load_transformer(model_dir, dtype=target_weight_dtype(config), device=config.device)
    return quantize(model, config.weight_format, model_dir)


def colocated_methods(settings: ServingConfig, colocated: bool = True) -> dict[str, SpeculativeConfig]:
    """The configured methods whose drafter runs beside the target (or, False, apart)."""
    return {name: spec for name, spec in settings.methods.items() if spec.colocated == colocated}


def build_colocated_speculator(settings: ServingConfig) -> Speculator:
    """The Triton verifier's engine: the target plus every co-located drafter, which share
    the target's embedding (EAGLE-3) and its threads."""
    model_dir = resolve_model_dir(settings.model_dir)
    target = load_target(model_dir, settings.engine)
    drafters = build_drafters(target.cfg, colocated_methods(settings), settings.engine, model_dir, embed=target.embed)
    grammars = Grammars.for_tokenizer(lambda: load_tokenizer(model_dir), target.cfg.vocab_size, settings.engine.guide_compile_timeout_s)
    grammars.warm()  # the vocabulary table and the compile probe, before any request waits on them
    # Drafters served apart may need hidden taps too (returned on request).
    return Speculator(target, settings.engine, drafters, tap_layers_for(target.cfg, colocated_methods(settings, False)),
                      methods=settings.methods, grammars=grammars, observer=traffic_capture(settings, target.cfg, model_dir))


def traffic_capture(settings: ServingConfig, target_cfg: ModelConfig, model_dir: Path) -> "TrafficCapture | None":
    """The served-traffic recorder the settings ask for (None: capture off, the default)."""
    if settings.capture is None:
        return None
    from specdec.serving.traffic_capture import TrafficCapture

    log.warning("capture on: recording %.0f%% of requests' tokens and hidden states to %s (at most %d MiB)",
                100 * settings.capture.sample_rate, settings.capture.directory, settings.capture.max_bytes >> 20)
    return TrafficCapture(settings.capture, target_cfg, model_dir.name)


def build_engine(
    model_dir: Path | None = None,
    config: EngineConfig | None = None,
    speculative: Mapping[str, SpeculativeConfig] | None = None,
) -> SpecEngine:
    config = config or EngineConfig()
    model_dir = Path(model_dir or default_model_dir())
    target = load_target(model_dir, config)
    drafters = build_drafters(target.cfg, served_methods() if speculative is None else speculative, config, model_dir, embed=target.embed)
    return SpecEngine(target, config, tokenizer=load_tokenizer(model_dir), drafters=drafters)


def encode_prompt(tokenizer, prompt: str, chat: bool = True) -> list[int]:
    """Chat prompts go through the model's chat template (as a served instruct model would)."""
    if chat and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True))
    return list(tokenizer(prompt).input_ids)


