"""Assemble an engine from a model directory and a config: the one place that wires
target, tokenizer and drafters together (used by the CLI, the benchmarks and Triton)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping

import torch

from .config import METHOD_NGRAM, EngineConfig, ModelConfig, SpeculativeConfig
from .drafters.base import Drafter
from .drafters.ngram import NgramDrafter
from .engine import SpecEngine
from .errors import ConfigError
from .models.llama import Transformer
from .models.loading import default_model_dir, load_transformer

log = logging.getLogger(__name__)

DEFAULT_SPECULATIVE = {METHOD_NGRAM: SpeculativeConfig(method=METHOD_NGRAM, max_draft_len=4)}


def resolve_model_dir(model_dir: str | Path | None) -> Path:
    """A configured directory, or the prepared default target."""
    return Path(model_dir) if model_dir else default_model_dir()


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def build_drafters(target_cfg: ModelConfig, speculative: Mapping[str, SpeculativeConfig]) -> dict[str, Drafter]:
    """One drafter per configured method name (e.g. "ngram", "eagle3", "eagle3-tree")."""
    drafters: dict[str, Drafter] = {}
    for name, spec in speculative.items():
        spec.check_target(target_cfg)
        if spec.method == METHOD_NGRAM:
            drafters[name] = NgramDrafter(spec)
        else:
            raise ConfigError("method", f"method {spec.method!r} is not available in this build")
    return drafters


def load_target(model_dir: Path | None, config: EngineConfig) -> Transformer:
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    target = load_transformer(Path(model_dir or default_model_dir()), dtype=config.dtype, device=config.device)
    if config.compile:
        from .models.compile import compile_transformer

        compile_transformer(target)
    return target


def build_engine(
    model_dir: Path | None = None,
    config: EngineConfig | None = None,
    speculative: Mapping[str, SpeculativeConfig] | None = None,
) -> SpecEngine:
    config = config or EngineConfig()
    model_dir = Path(model_dir or default_model_dir())
    target = load_target(model_dir, config)
    drafters = build_drafters(target.cfg, DEFAULT_SPECULATIVE if speculative is None else speculative)
    return SpecEngine(target, config, tokenizer=load_tokenizer(model_dir), drafters=drafters)


def encode_prompt(tokenizer, prompt: str, chat: bool = True) -> list[int]:
    """Chat prompts go through the model's chat template (as a served instruct model would)."""
    if chat and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True))
    return list(tokenizer(prompt).input_ids)


